"""Groups as instances: a second and a third group in one process, ``REPS`` times.

Each repetition forms group A and closes it, then B, then C beside the live B, runs an
all_reduce on each (C and B interleaved), and closes both. Under any launcher
(``ringcomm run``, mpirun, torchrun) or from ``rc.spawn`` (:func:`run`). Prints
``GROUPS <rank> <repetitions done>`` at the end; any failure raises.
"""

from __future__ import annotations

import sys

import numpy as np

import ringcomm as rc


def _check(pg: rc.ProcessGroup, salt: int) -> None:
    x = np.full(8, pg.rank + salt, dtype=np.float64)
    pg.all_reduce(x)
    n = pg.world_size
    assert x[0] == n * (n - 1) / 2 + n * salt, (salt, x[0])


def run(pg: rc.ProcessGroup | None, reps: int) -> int:
    """``reps`` repetitions; ``pg`` (from ``rc.spawn``) is used and closed first."""
    if pg is not None:
        _check(pg, 100)
        pg.close()
    for i in range(reps):
        a = rc.init_process_group()
        _check(a, 3 * i)
        a.close()
        b = rc.init_process_group()
        c = rc.init_process_group()  # beside the live b
        _check(c, 3 * i + 1)
        _check(b, 3 * i + 2)
        _check(c, 3 * i + 2)
        c.close()
        b.close()
    return reps


def spawned(pg: rc.ProcessGroup, reps: int) -> int:
    return run(pg, reps)


if __name__ == "__main__":
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    done = run(None, reps)
    rank = rc.init_process_group()
    print(f"GROUPS {rank.rank} {done}", flush=True)
    rank.close()
