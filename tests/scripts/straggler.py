"""A straggler: rank 1 sleeps ``SLEEP`` seconds before op #6; the others wait ``TIMEOUT``.

``python straggler.py SLEEP TIMEOUT`` under any launcher, with ``RINGCOMM_TRACE_DIR`` set:
five all_reduces, then rank 1 sleeps, then the sixth (float64[10]). Ranks whose call fails
exit 1 (their flight record is written then).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import ringcomm as rc

sleep_s, timeout_s = float(sys.argv[1]), float(sys.argv[2])
pg = rc.init_process_group(timeout_s=timeout_s)
x = np.ones(10)
for _ in range(5):
    pg.all_reduce(x)
if pg.rank == 1:
    time.sleep(sleep_s)
try:
    pg.all_reduce(x)
except rc.RingcommError as exc:
    print(f"rank {pg.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    sys.exit(1)
pg.close()
