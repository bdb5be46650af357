"""The collectives matrix on pretend hosts (``RINGCOMM_HOST_ID`` per rank), checked against
NumPy; prints one line per case with a digest of the result (the test compares ranks).

    ringcomm run -n N hier_check.py HOSTS ALGO [COLLECTIVES]
        HOSTS: the host of each rank, e.g. 0,0,1,1 or 0,1,0,1, or "real" (the ranks' own
        hosts, e.g. under ringcomm run --hostfile); ALGO: hier | auto | ring (each
        collective's flat algorithm by name) | env (RINGCOMM_ALGO=ring, no algo=);
        COLLECTIVES: comma-separated, of all_reduce (the default), reduce_scatter,
        all_gather, broadcast, barrier.

A reduce_scatter case checks every rank's row: the rows are gathered (flat) and the whole
result compared, so its digest is the same on every rank too.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np

ALGO = sys.argv[2]
COLLECTIVES = (sys.argv[3] if len(sys.argv) > 3 else "all_reduce").split(",")
if ALGO == "env":
    os.environ["RINGCOMM_ALGO"] = "ring"
if sys.argv[1] != "real":
    HOSTS = [int(h) for h in sys.argv[1].split(",")]
    RANK = int(os.environ["RINGCOMM_RANK"])
    os.environ["RINGCOMM_HOST_ID"] = f"pretend-host-{HOSTS[RANK]}"  # before the group forms

import ringcomm as rc  # noqa: E402
from ringcomm.collectives import hierarchy  # noqa: E402
from ringcomm.collectives.base import FP_STEP, CollectiveOp  # noqa: E402

NAMES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"]
FLAT = {
    "all_reduce": "ring",
    "reduce_scatter": "ring",
    "all_gather": "ring",
    "broadcast": "chain",
    "barrier": "dissemination",
}
calls = dict.fromkeys(NAMES, 0)


def _counting(name: str):  # type: ignore[no-untyped-def]
    original = getattr(hierarchy.Hierarchy, name)

    def counted(self, *args):  # type: ignore[no-untyped-def]
        calls[name] += 1
        return original(self, *args)

    return counted


for _name in NAMES:
    setattr(hierarchy.Hierarchy, _name, _counting(_name))

# The group ranks each flat ring/chain algorithm sends data to (not fingerprints): the ring
# order the test expects (host by host), whatever the rank order.
RING_ALGOS = {"ring", "chain"}
data_peers: dict[str, set[int]] = {}
_send_piece = CollectiveOp.send_piece


def _recording(self, peer, step, *args, **kwargs):  # type: ignore[no-untyped-def]
    if self.algo in RING_ALGOS and step != FP_STEP and self.call.root in (None, 0):
        data_peers.setdefault(f"{self.name}:{self.algo}", set()).add(self.comm.ranks[peer])
    return _send_piece(self, peer, step, *args, **kwargs)


CollectiveOp.send_piece = _recording  # type: ignore[method-assign]
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
    out = {
        "sum": wide.sum(0),
        "max": wide.max(0),
        "min": wide.min(0),
        "prod": wide.prod(0),
        "avg": wide.mean(0) if a.dtype.kind == "f" else None,
    }[op]
    return np.asarray(out)


def check(x: np.ndarray, want: np.ndarray, dtype: str) -> bool:
    if dtype in ("float16", "float32", "float64"):
        tol = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
        return bool(np.allclose(x.astype(np.float64), want, rtol=tol, atol=tol * 10))
    return bool(np.array_equal(x, want.astype(x.dtype)))


def report(pg: rc.ProcessGroup, key: str, x: np.ndarray, ok: bool) -> int:
    digest = hashlib.sha1(x.tobytes()).hexdigest()[:12]
    print(f"CASE {pg.rank} {key} {int(ok)} {digest}", flush=True)
    return int(not ok)


def ops_of(dtype: str) -> list[str]:
    # integer means take the flat path (tested with the collectives); bool has no mean
    return [op for op in OPS if op != "avg" or dtype.startswith("float")]


def all_reduce_cases(pg: rc.ProcessGroup, algo: str | None, counts: list[int]) -> int:
    bad, n = 0, pg.world_size
    for dtype in DTYPES:
        for op in ops_of(dtype):
            for count in counts:
                xs = [data(r, count, dtype, op) for r in range(n)]
                x = xs[pg.rank].copy()
                pg.all_reduce(x, op, algo=algo)
                bad += report(pg, f"{dtype} {op} {count}", x, check(x, reference(xs, op), dtype))
    return bad


def reduce_scatter_cases(pg: rc.ProcessGroup, algo: str | None, counts: list[int]) -> int:
    bad, n = 0, pg.world_size
    for dtype in DTYPES:
        for op in ops_of(dtype):
            for count in counts:
                shape = (n, 3, 5) if count == -1 else (n, count)  # -1: rows of 2-d shape
                size = int(np.prod(shape))
                xs = [data(r, size, dtype, op).reshape(shape) for r in range(n)]
                x = xs[pg.rank].copy()
                got = pg.reduce_scatter(x, op=op, algo=algo)
                ok = bool(np.array_equal(x, xs[pg.rank]))  # x is not modified
                whole = pg.all_gather(got, algo="ring")
                ok = ok and check(whole, reference(xs, op), dtype)
                bad += report(pg, f"rs:{dtype} {op} {count}", whole, ok)
                if count == 7:  # the in-place form: out is x[rank]
                    x = xs[pg.rank].copy()
                    pg.reduce_scatter(x, out=x[pg.rank], op=op, algo=algo)
                    ok = check(x[pg.rank], reference(xs, op)[pg.rank], dtype)
                    bad += report(pg, f"rs-inplace:{dtype}:r{pg.rank} {op} {count}", x[pg.rank], ok)
    return bad


def all_gather_cases(pg: rc.ProcessGroup, algo: str | None, counts: list[int]) -> int:
    bad, n = 0, pg.world_size
    for dtype in DTYPES:
        for count in counts:
            shape = (3, 5) if count == -1 else (count,)
            xs = [data(r, int(np.prod(shape)), dtype, "sum").reshape(shape) for r in range(n)]
            got = pg.all_gather(xs[pg.rank], algo=algo)
            want = np.stack(xs)
            ok = got.shape == want.shape and bool(np.array_equal(got, want))
            bad += report(pg, f"ag:{dtype} - {count}", got, ok)
    return bad


def broadcast_cases(pg: rc.ProcessGroup, algo: str | None, counts: list[int]) -> int:
    bad, n = 0, pg.world_size
    for dtype in DTYPES:
        for count in counts:
            for src in range(n) if count in (1, 1000) else (0, n - 1):
                want = data(src + 100, count, dtype, "sum")
                x = want.copy() if pg.rank == src else np.zeros(count, dtype)
                pg.broadcast(x, src=src, algo=algo)
                bad += report(pg, f"bc:{dtype} src{src} {count}", x, bool(np.array_equal(x, want)))
    return bad


def barrier_cases(pg: rc.ProcessGroup, algo: str | None, rounds: int = 12) -> int:
    """No rank leaves a barrier before every rank entered it (one rank, a different one
    each round, comes late: the others must wait for it)."""
    bad, n = 0, pg.world_size
    for k in range(rounds):
        if pg.rank == k % n:
            time.sleep(0.02)  # the late rank (what is tested, not a synchronisation)
        entered = time.time()
        pg.barrier(algo=algo)
        left = time.time()
        times = pg.all_gather(np.array([entered, left]), algo="ring")
        ok = float(times[:, 0].max()) <= float(times[:, 1].min())
        bad += report(pg, f"bar:- - {k}", np.array([int(ok)]), ok)
    return bad


def main() -> None:
    pg = rc.init_process_group(timeout_s=60)
    topo = pg.topology
    m = topo.max_local_size
    print(f"TOPO {pg.rank} {topo.host_of} {topo.local_rank(pg.rank)} {topo.ring_order}", flush=True)
    bad = 0
    for name in COLLECTIVES:
        algo = {"auto": None, "env": None, "ring": FLAT[name]}.get(ALGO, ALGO)
        if name == "all_reduce":
            counts = sorted({0, 1, m - 1, m, m + 1, 2 * m + 1, 1000, 100_003} - {-1})
            bad += all_reduce_cases(pg, algo, counts)
        elif name == "reduce_scatter":  # counts per row; -1: rows of shape (3, 5)
            bad += reduce_scatter_cases(pg, algo, sorted({-1, 0, 1, m + 1, 7, 1000, 20_001}))
        elif name == "all_gather":
            bad += all_gather_cases(pg, algo, sorted({-1, 0, 1, m + 1, 7, 1000, 20_001}))
        elif name == "broadcast":
            bad += broadcast_cases(pg, algo, [0, 1, m + 1, 1000, 100_003])
        else:
            bad += barrier_cases(pg, algo)
    for name, peers in sorted(data_peers.items()):
        print(f"PEERS {pg.rank} {name} {sorted(peers)}", flush=True)
    hier = ",".join(f"{k}:{v}" for k, v in calls.items())
    print(f"DONE {pg.rank} bad={bad} hier={hier}", flush=True)
    pg.close()


if __name__ == "__main__":
    main()
