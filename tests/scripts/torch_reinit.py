"""The torch backend formed again after ``destroy_process_group()``, ``REPS`` times, and
(with ``plain``) the plain API's groups as many times: ``python torch_reinit.py REPS [plain]``.

Prints ``REINIT <rank> <repetitions>`` (and ``PLAIN <rank> <repetitions>``) at the end.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

import ringcomm as rc
import ringcomm.torch_backend

reps = int(sys.argv[1])
torch.set_num_threads(1)
for i in range(reps):
    dist.init_process_group("ringcomm")
    n, r = dist.get_world_size(), dist.get_rank()
    t = torch.full((5,), float(r + i))
    dist.all_reduce(t)
    assert t[0].item() == n * (n - 1) / 2 + n * i, (i, t)
    dist.destroy_process_group()
print(f"REINIT {r} {reps}", flush=True)
if "plain" in sys.argv[2:]:
    for i in range(reps):
        with rc.init_process_group() as pg:
            x = np.full(3, float(pg.rank + i))
            pg.all_reduce(x)
            assert x[0] == n * (n - 1) / 2 + n * i
            port = pg.config.master_port
    print(f"PLAIN {r} {reps} {port}", flush=True)
