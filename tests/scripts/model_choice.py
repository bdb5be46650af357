"""Which algorithm each all_reduce and broadcast takes on pretend hosts, with or without a
cost model (``RINGCOMM_TUNE_FILE``), checked against NumPy; one line per call.

    ringcomm run -n N model_choice.py HOSTS [OTHERS_FILE]
        HOSTS: the host of each rank, e.g. 0,0,1,1; OTHERS_FILE: RINGCOMM_TUNE_FILE for
        every rank but 0 (rank 0's model is the group's: theirs is not read)

Prints ``MODEL rank source|none`` and ``CALL rank op bytes algo ok``; ``algo`` as the
flight recorder saw it: the world group's entry for the call, or ``hier`` when the call
ran on sub-groups (ringcomm.collectives.hierarchy).
"""

from __future__ import annotations

import os
import sys

import numpy as np

HOSTS = [int(h) for h in sys.argv[1].split(",")]
RANK = int(os.environ["RINGCOMM_RANK"])
os.environ["RINGCOMM_HOST_ID"] = f"pretend-host-{HOSTS[RANK]}"  # before the group forms
if RANK != 0 and len(sys.argv) > 2:
    os.environ["RINGCOMM_TUNE_FILE"] = sys.argv[2]

import ringcomm as rc  # noqa: E402

#: float32 elements per call: 8 B, 64 KiB, 1 MiB
COUNTS = (2, 16 << 10, 256 << 10)


def algo_of(pg: rc.ProcessGroup, start: int, op: str) -> str:
    """The algorithm of the call whose flight entries follow the first ``start``."""
    entries = pg.core.state.recorder.records()[start:]
    mine = [e for e in entries if e["group"] == pg.group_id and e["op"] == op]
    if mine:
        return str(mine[-1]["algo"])
    return "hier" if any(e["group"] != pg.group_id for e in entries) else "?"


def main() -> None:
    pg = rc.init_process_group(timeout_s=60)
    model = pg.cost_model
    print(f"MODEL {pg.rank} {'none' if model is None else model.source}", flush=True)
    n = pg.world_size
    for op in ("all_reduce", "broadcast"):
        for count in COUNTS:
            xs = [np.arange(count, dtype=np.float32) * (r + 1) for r in range(n)]
            x = xs[pg.rank].copy()
            start = len(pg.core.state.recorder.records())
            if op == "all_reduce":
                pg.all_reduce(x)
                ok = np.allclose(x, np.sum(xs, axis=0))
            else:
                pg.broadcast(x, src=0)
                ok = np.array_equal(x, xs[0])
            print(f"CALL {pg.rank} {op} {x.nbytes} {algo_of(pg, start, op)} {int(ok)}", flush=True)
    pg.close()


if __name__ == "__main__":
    main()
