"""Form the group from the launcher's environment, all_reduce, and report the result.

Prints ``SUM <rank> <hostname> <values as JSON>``. Rank r contributes arange(n) * (r + 1),
n = 1000 + 3 (big enough for several ring chunks with RINGCOMM_CHUNK_BYTES small).
"""

import json
import socket

import numpy as np

import ringcomm as rc

with rc.init_process_group(timeout_s=60) as pg:
    x = np.arange(1003, dtype=np.float64) * (pg.rank + 1)
    pg.all_reduce(x)
    w = pg.world_size
    expected = np.arange(1003, dtype=np.float64) * (w * (w + 1) // 2)
    ok = bool(np.array_equal(x, expected))
    print(f"SUM {pg.rank} {socket.gethostname()} {json.dumps([ok, float(x[1]), float(x[-1])])}")
