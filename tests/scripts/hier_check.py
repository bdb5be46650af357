"""The all_reduce matrix on pretend hosts (``RINGCOMM_HOST_ID`` per rank), checked against
NumPy; prints one line per case with a digest of the result (the test compares ranks).

    ringcomm run -n N hier_check.py HOSTS ALGO
        HOSTS: the host of each rank, e.g. 0,0,1,1 or 0,1,0,1, or "real" (the ranks' own
        hosts, e.g. under ringcomm run --hostfile); ALGO: hier | ring | auto
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

ALGO = sys.argv[2]
if sys.argv[1] != "real":
    HOSTS = [int(h) for h in sys.argv[1].split(",")]
    RANK = int(os.environ["RINGCOMM_RANK"])
    os.environ["RINGCOMM_HOST_ID"] = f"pretend-host-{HOSTS[RANK]}"  # before the group forms

import ringcomm as rc  # noqa: E402
from ringcomm import hierarchy  # noqa: E402

calls = [0]
_original = hierarchy.Hierarchy.all_reduce


def _counted(self, x, op, timeout_s):  # type: ignore[no-untyped-def]
    calls[0] += 1
    return _original(self, x, op, timeout_s)


hierarchy.Hierarchy.all_reduce = _counted  # type: ignore[method-assign]
# Tiny segments (HIER_SEGMENT_BYTES): many overlapped segments even at these counts.
hierarchy.SEGMENT_BYTES = int(os.environ.get("HIER_SEGMENT_BYTES", hierarchy.SEGMENT_BYTES))

DTYPES = ["float32", "float64", "float16", "int8", "int32", "int64", "uint8", "uint64", "bool"]
OPS = ["sum", "max", "min", "prod", "avg"]


def data(rank: int, count: int, dtype: str, op: str) -> np.ndarray:
    rng = np.random.default_rng([rank, count, DTYPES.index(dtype), OPS.index(op)])
    if dtype == "bool":
        return rng.random(count) < 0.5
    if op == "prod":  # small factors: no overflow
        return rng.integers(1, 3, count).astype(dtype)
    if dtype.startswith(("int", "uint")):
        return rng.integers(0, 10, count).astype(dtype)
    return (rng.standard_normal(count) * 4).astype(dtype)


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    a = np.stack(xs)
    if a.dtype == bool:
        return {"sum": a.any(0), "max": a.any(0), "min": a.all(0), "prod": a.all(0)}[op]
    wide = a.astype(np.float64) if a.dtype.kind == "f" else a
    out = {"sum": wide.sum(0), "max": wide.max(0), "min": wide.min(0), "prod": wide.prod(0),
           "avg": wide.mean(0) if a.dtype.kind == "f" else None}[op]  # fmt: skip
    return np.asarray(out)


def main() -> None:
    pg = rc.init_process_group(timeout_s=60)
    n = pg.world_size
    topo = pg.topology
    m = topo.max_local_size
    algo = None if ALGO == "auto" else ALGO
    print(f"TOPO {pg.rank} {topo.host_of} {topo.local_rank(pg.rank)} {topo.ring_order}", flush=True)
    counts = sorted({0, 1, m - 1, m, m + 1, 2 * m + 1, 1000, 100_003} - {-1})
    bad = 0
    for dtype in DTYPES:
        for op in OPS:
            if dtype == "bool" and op == "avg":
                continue
            if op == "avg" and dtype[0] in "iu":
                continue  # integer means take the flat path (tested with the collectives)
            for count in counts:
                xs = [data(r, count, dtype, op) for r in range(n)]
                x = xs[pg.rank].copy()
                pg.all_reduce(x, op, algo=algo)
                want = reference(xs, op)
                if dtype in ("float16", "float32", "float64"):
                    tol = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
                    ok = np.allclose(x.astype(np.float64), want, rtol=tol, atol=tol * 10)
                else:
                    ok = np.array_equal(x, want.astype(x.dtype))
                bad += not ok
                digest = hashlib.sha1(x.tobytes()).hexdigest()[:12]
                print(f"CASE {pg.rank} {dtype} {op} {count} {int(ok)} {digest}", flush=True)
    print(f"DONE {pg.rank} bad={bad} hier_calls={calls[0]}", flush=True)
    pg.close()


if __name__ == "__main__":
    main()
