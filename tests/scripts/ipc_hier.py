"""Device arrays (the host stand-in) on pretend hosts: the hierarchical collectives take
the device windows inside each host and host staging only across hosts. Prints one line
per case (``ok``/``BAD``) and, per rank, which algorithms the host's group took.

    ringcomm run -n N ipc_hier.py HOSTS          HOSTS: each rank's host, e.g. 0,0,1,1
"""

from __future__ import annotations

import os
import sys

import numpy as np

HOSTS = [int(h) for h in sys.argv[1].split(",")]
os.environ["RINGCOMM_HOST_ID"] = f"pretend-host-{HOSTS[int(os.environ['RINGCOMM_RANK'])]}"
os.environ["RINGCOMM_IPC_WINDOW_BYTES"] = "1024"  # many rounds inside the hosts
os.environ["RINGCOMM_IPC_SMALL_BYTES"] = "0"

import ringcomm as rc  # noqa: E402
from ringcomm.collectives import hierarchy  # noqa: E402
from ringcomm.device.standin import StandinArray, standin_array  # noqa: E402
from ringcomm.ops import reference_reduce  # noqa: E402

hierarchy.SEGMENT_BYTES = 4096  # several overlapped segments


def data(rank: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([rank, count, len(dtype)])
    return rng.integers(-50, 50, count).astype(dtype)


def main() -> None:
    pg = rc.init_process_group(timeout_s=60)
    n, me = pg.world_size, pg.rank
    local_algos: set[str] = set()
    bad = 0

    def note(label: str, ok: bool) -> None:
        nonlocal bad
        bad += not ok
        print(f"rank {me} {label}: {'ok' if ok else 'BAD'}", flush=True)
        hier = pg.core.hierarchy()
        if hier is not None and hier.local is not None and hier.local.world_size > 1:
            local_algos.add(hier.local.core.last_algo)

    for dtype in ("float32", "int64"):
        for count in (1, 7, 1000, 5003):
            for op in ("sum", "max", "avg"):
                x = standin_array(data(me, count, dtype))
                got = pg.all_reduce(x, op)
                want = reference_reduce(op, [data(r, count, dtype) for r in range(n)])
                ok = isinstance(got, StandinArray) and pg.core.last_algo == "hier"
                if op == "avg" and dtype == "int64":
                    ok = isinstance(got, StandinArray)  # (integer means go flat)
                close = np.allclose(got.get(), want, rtol=1e-6)
                note(
                    f"all_reduce {dtype} {count} {op} ({pg.core.last_algo}, close {close})",
                    ok and close,
                )
        rows = standin_array(data(me, n * 301, dtype).reshape(n, 301))
        out = pg.reduce_scatter(rows)
        want = reference_reduce("sum", [data(r, n * 301, dtype).reshape(n, 301) for r in range(n)])
        note(
            f"reduce_scatter {dtype}",
            pg.core.last_algo == "hier" and np.allclose(out.get(), want[me]),
        )
        got = pg.all_gather(standin_array(data(me, 777, dtype)))
        note(
            f"all_gather {dtype}",
            pg.core.last_algo == "hier"
            and np.array_equal(got.get(), np.stack([data(r, 777, dtype) for r in range(n)])),
        )
        for src in range(n):
            b = standin_array(data(me, 3001, dtype))
            pg.broadcast(b, src=src)
            note(f"broadcast {dtype} from {src}", np.array_equal(b.get(), data(src, 3001, dtype)))
    print(f"rank {me} local algos: {','.join(sorted(local_algos))}", flush=True)
    pg.close()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
