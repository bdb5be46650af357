"""Collectives under any launcher: ``ringcomm run``, mpirun, srun, torchrun.

    ringcomm run -n 4 collectives.py
    mpirun -np 4 python collectives.py       # one host: no variables to export
    srun -n 4 python collectives.py          # or: sbatch collectives.sbatch

Every rank forms the group from its launcher's environment, runs a few collectives, checks
them against the values it can compute alone, and prints one line:
``RESULT <rank> <world size> <JSON of the results>``.
"""

import json
import sys

import numpy as np

import ringcomm as rc

with rc.init_process_group(timeout_s=120) as pg:
    rank, world = pg.rank, pg.world_size

    x = np.arange(1003, dtype=np.float64) * (rank + 1)  # rank r: arange(n) * (r + 1)
    pg.all_reduce(x)
    total = np.arange(1003, dtype=np.float64) * (world * (world + 1) // 2)

    gathered = pg.all_gather(np.array([rank, rank * rank], dtype=np.int64))

    b = np.array([rank + 100], dtype=np.int32)
    pg.broadcast(b, src=world - 1)

    rows = np.stack([np.full(3, rank * 10 + j, dtype=np.int64) for j in range(world)])
    mine = pg.reduce_scatter(rows)  # row `rank` summed over ranks
    swapped = pg.all_to_all(rows)  # swapped[j] is rank j's rows[rank]

    m = np.array([float(rank)], dtype=np.float32)
    pg.all_reduce(m, op="max")
    pg.barrier()

    results = {
        "all_reduce": [float(x[1]), float(x[-1])],
        "all_gather": gathered.tolist(),
        "broadcast": int(b[0]),
        "reduce_scatter": mine.tolist(),
        "all_to_all": swapped[:, 0].tolist(),
        "max": float(m[0]),
    }
    ok = (
        np.array_equal(x, total)
        and gathered.tolist() == [[r, r * r] for r in range(world)]
        and int(b[0]) == world - 1 + 100
        and mine.tolist() == [10 * world * (world - 1) // 2 + world * rank] * 3
        and swapped[:, 0].tolist() == [r * 10 + rank for r in range(world)]
        and float(m[0]) == world - 1
    )
    print(f"RESULT {rank} {world} {json.dumps(results, sort_keys=True)}", flush=True)
    if not ok:
        print(f"rank {rank}: wrong results {results}", file=sys.stderr, flush=True)
        sys.exit(1)
