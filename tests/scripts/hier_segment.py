"""The segment size each hierarchical call runs with on pretend hosts, with or without a
cost model (``RINGCOMM_TUNE_FILE``), results checked against NumPy; one line per call.

    ringcomm run -n N hier_segment.py HOSTS BYTES
        HOSTS: the host of each rank, e.g. 0,0,1,1; BYTES: the buffer as nccl-tests counts it

Prints ``SEG rank op segment_bytes|none spans ok`` (spans: the segments it ran in).
"""

from __future__ import annotations

import os
import sys

import numpy as np

HOSTS = [int(h) for h in sys.argv[1].split(",")]
NBYTES = int(sys.argv[2])
RANK = int(os.environ["RINGCOMM_RANK"])
os.environ["RINGCOMM_HOST_ID"] = f"pretend-host-{HOSTS[RANK]}"  # before the group forms

import ringcomm as rc  # noqa: E402
from ringcomm.collectives import hierarchy  # noqa: E402

SEEN: list[tuple[int | None, int]] = []
_segments = hierarchy.Hierarchy._segments


def _spy(count: int, itemsize: int, rows: int, segment_bytes: int | None = None) -> list:
    spans = _segments(count, itemsize, rows, segment_bytes)
    SEEN.append((segment_bytes, len(spans)))
    return spans


hierarchy.Hierarchy._segments = staticmethod(_spy)  # type: ignore[method-assign]


def main() -> None:
    pg = rc.init_process_group(timeout_s=60)
    n, count = pg.world_size, NBYTES // 4
    xs = [np.arange(count, dtype=np.float32) % 251 * (r + 1) for r in range(n)]
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        SEEN.clear()
        if op == "all_reduce":
            x = xs[pg.rank].copy()
            pg.all_reduce(x)
            ok = np.array_equal(x, np.sum(xs, axis=0))
        elif op == "reduce_scatter":
            rows = xs[pg.rank].reshape(n, -1)
            got = pg.reduce_scatter(rows)
            ok = np.array_equal(got, np.sum(xs, axis=0).reshape(n, -1)[pg.rank])
        else:
            mine = xs[pg.rank].reshape(n, -1)[pg.rank].copy()
            got = pg.all_gather(mine)
            ok = np.array_equal(got, np.stack([x.reshape(n, -1)[r] for r, x in enumerate(xs)]))
        seg, spans = SEEN[-1] if SEEN else (None, 0)
        print(f"SEG {pg.rank} {op} {'none' if seg is None else seg} {spans} {int(ok)}", flush=True)
    pg.close()


if __name__ == "__main__":
    main()
