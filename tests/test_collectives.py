"""Collectives against the NumPy oracle (``ops.reference_reduce``), on real process groups.

Each spawned job runs many cases in one group (the start of a job costs far more than a
case). Inputs are rank-seeded (``make_input(case, rank, ...)``), so every rank can rebuild
every other rank's input and check its own result in place; the job returns failures and
a digest of each result, and the parent asserts there are no failures and that results
meant to be identical (all_reduce, all_gather, broadcast) are identical byte for byte on
every rank. Data are chosen so that every result is exact in every dtype (integers wrap
exactly in any order; floats hold small integers, so sums and products are exact), so the
comparison with the oracle is exact too; a separate case checks random floats with a
tolerance (and identical bits across ranks).

``pg.chunk_bytes = 64`` in most jobs, to force many pieces per message.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import Any

import numpy as np
import pytest
from conftest import assert_same_results

import ringcomm as rc
from ringcomm.collectives import reference
from ringcomm.ops import reference_reduce

DTYPES = [
    np.dtype(n)
    for n in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
]
OPS = ["sum", "avg", "max", "min", "prod"]
CALL_TIMEOUT_S = 60.0

Case = tuple[Any, ...]  # (collective, algo, dtype name, op, count, root, variant)


# --------------------------------------------------------------------------- inputs
def make_input(
    case: int, rank: int, dtype: np.dtype[Any], shape: tuple[int, ...], op: str | None
) -> np.ndarray:
    """Rank-seeded input whose reductions are exact in every dtype."""
    rng = np.random.default_rng([case, rank])
    size = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "b":
        # Mostly False for or-like ops, mostly True for and-like ones: both outcomes occur.
        a = rng.random(size) < (0.8 if op in ("min", "prod") else 0.2)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)  # wraps
    elif op == "prod":
        a = rng.choice(np.array([-2, -1, 1, 2]), size).astype(dtype)
    else:
        a = rng.integers(-8, 9, size).astype(dtype)
    return a.astype(dtype).reshape(shape)


def _op_for(dtype: np.dtype[Any], i: int) -> str:
    op = OPS[i % len(OPS)]
    return "max" if (op == "avg" and dtype.kind == "b") else op


def _shape_for(count: int, i: int) -> tuple[int, ...]:
    if count == 1000 and i % 2:
        return (10, 100)
    if count == 1 and i % 3 == 0:
        return ()
    return (count,)


def matrix_cases(world_size: int, full: bool = False) -> list[Case]:
    """The cases one job runs at ``world_size`` (deterministic: parent and ranks agree)."""
    n = world_size
    counts = sorted({0, 1, max(n - 1, 0), n + 1, 1000})
    cases: list[Case] = []
    i = 0
    for algo in ("ring", "rd", "direct", "star", "shm"):
        for count in counts:
            for dt in DTYPES:  # every dtype, ops rotating
                cases.append(("all_reduce", algo, dt.name, _op_for(dt, i), count, None, i))
                i += 1
    if full:  # every dtype x every op, every algorithm
        for dt, op, algo in itertools.product(DTYPES, OPS, ("ring", "rd", "direct", "star", "shm")):
            if op == "avg" and dt.kind == "b":
                continue
            for count in (n + 1, 1000):
                cases.append(("all_reduce", algo, dt.name, op, count, None, i))
                i += 1
        for dt, op in itertools.product(DTYPES, OPS):
            if not (op == "avg" and dt.kind == "b"):
                cases.append(("reduce_scatter", "ring", dt.name, op, 7, None, i))
                cases.append(("reduce", "tree", dt.name, op, 9, i % n, i))
                i += 1
    for row in (0, 1, 3, 125):
        for dt in DTYPES[i % 3 :: 3]:
            cases.append(("reduce_scatter", "ring", dt.name, _op_for(dt, i), row, None, i))
            i += 1
    for count in counts:
        for dt in DTYPES[i % 4 :: 4]:
            cases.append(("all_gather", "ring", dt.name, None, count, None, i))
            i += 1
    for root in range(n):
        for algo in ("tree", "chain"):
            dt = DTYPES[i % len(DTYPES)]
            cases.append(("broadcast", algo, dt.name, None, (13, 1000, 0)[i % 3], root, i))
            i += 1
        dt = DTYPES[i % len(DTYPES)]
        cases.append(
            ("reduce", "tree", dt.name, _op_for(dt, i), (0, 1, n + 1, 1000)[i % 4], root, i)
        )
        i += 1
        dt = DTYPES[i % len(DTYPES)]
        cases.append(("gather", "direct", dt.name, None, (1, 300, 0)[i % 3], root, i))
        i += 1
        for variant in ("none", "x", "out"):
            dt = DTYPES[i % len(DTYPES)]
            cases.append(("scatter", "direct", dt.name, None, (3, 125, 0)[i % 3], root, variant))
            i += 1
    for row in (0, 1, 5, 125):
        dt = DTYPES[i % len(DTYPES)]
        cases.append(("all_to_all", "direct", dt.name, None, row, None, i))
        i += 1
    cases.append(("barrier", "dissemination", "uint8", None, 0, None, i))
    return cases


# --------------------------------------------------------------------------- running a case
def run_case(
    pg: rc.ProcessGroup, cid: int, case: Case, ranks: list[int] | None = None
) -> tuple[Any, Any, bool]:
    """Run ``case`` on ``pg``; return (result, expected, same_on_every_rank).

    ``ranks``: the global ranks of ``pg``'s members (seeds use them, so sub-groups see
    different data); defaults to ``range(world_size)``.
    """
    coll, algo, dtname, op, count, root, variant = case
    dt = np.dtype(dtname)
    n, me = pg.world_size, pg.rank
    seeds = list(range(n)) if ranks is None else ranks
    t = CALL_TIMEOUT_S

    def inp(r: int, shape: tuple[int, ...]) -> np.ndarray:
        return make_input(cid, seeds[r], dt, shape, op)

    if coll == "all_reduce":
        shape = _shape_for(count, variant)
        x = inp(me, shape)
        res = pg.all_reduce(x, op, algo=algo, timeout_s=t)
        assert res is x
        return res, reference_reduce(op, [inp(r, shape) for r in range(n)]), True
    if coll == "reduce_scatter":
        x = inp(me, (n, count))
        out = np.empty(count, dt) if variant % 2 else None
        res = pg.reduce_scatter(x, out=out, op=op, timeout_s=t)
        assert out is None or res is out
        assert np.array_equal(x, inp(me, (n, count))), "reduce_scatter modified its input"
        return res, reference_reduce(op, [inp(r, (n, count)) for r in range(n)])[me], False
    if coll == "all_gather":
        x = inp(me, (count,))
        out = np.empty((n, count), dt) if variant % 2 else None
        res = pg.all_gather(x, out=out, timeout_s=t)
        assert out is None or res is out
        return res, np.stack([inp(r, (count,)) for r in range(n)]), True
    if coll == "broadcast":
        x = inp(me, (count,)) if me == root else np.zeros(count, dt)
        res = pg.broadcast(x, src=root, algo=algo, timeout_s=t)
        return res, inp(root, (count,)), True
    if coll == "reduce":
        x = inp(me, (count,))
        res = pg.reduce(x, dst=root, op=op, timeout_s=t)
        if me != root:
            return res, inp(me, (count,)), False  # others' x is left as it was
        return res, reference_reduce(op, [inp(r, (count,)) for r in range(n)]), False
    if coll == "gather":
        res = pg.gather(inp(me, (count,)), dst=root, timeout_s=t)
        if me != root:
            return res, None, False
        return res, np.stack([inp(r, (count,)) for r in range(n)]), False
    if coll == "scatter":
        full = inp(root, (n, count))
        if me == root:
            res = pg.scatter(full, src=root, timeout_s=t)
        elif variant == "none":
            res = pg.scatter(None, src=root, timeout_s=t)
        elif variant == "x":
            res = pg.scatter(np.zeros((n, count), dt), src=root, timeout_s=t)
        else:
            out = np.zeros(count, dt)
            res = pg.scatter(None, src=root, out=out, timeout_s=t)
            assert res is out
        return res, full[me], False
    if coll == "all_to_all":
        x = inp(me, (n, count))
        res = pg.all_to_all(x, timeout_s=t)
        return res, np.stack([inp(r, (n, count))[me] for r in range(n)]), False
    if coll == "barrier":
        return pg.barrier(timeout_s=t), None, True
    raise AssertionError(f"unknown case {case}")


def _digest(a: Any) -> str | None:
    if a is None:
        return None
    return hashlib.sha1(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest()


def _compare(case: Case, res: Any, exp: Any) -> str | None:
    if exp is None:
        return None if res is None else f"{case}: expected None, got {type(res).__name__}"
    if not isinstance(res, np.ndarray):
        return f"{case}: expected an array, got {type(res).__name__}"
    if res.dtype != exp.dtype or res.shape != exp.shape:
        return f"{case}: got {res.dtype}{res.shape}, expected {exp.dtype}{exp.shape}"
    if not np.array_equal(res, exp):
        bad = np.flatnonzero(res.reshape(-1) != exp.reshape(-1))[:5]
        return (
            f"{case}: {len(np.flatnonzero(res.reshape(-1) != exp.reshape(-1)))} elements "
            f"differ, e.g. at {bad.tolist()}: got {res.reshape(-1)[bad].tolist()}, "
            f"expected {exp.reshape(-1)[bad].tolist()}"
        )
    return None


def run_cases(
    pg: rc.ProcessGroup, cases: list[Case], ranks: list[int] | None = None, first_id: int = 0
) -> tuple[list[str], dict[int, str | None]]:
    """Run every case; return (failures, {case id: digest} for cases identical on all ranks)."""
    failures: list[str] = []
    digests: dict[int, str | None] = {}
    for cid, case in enumerate(cases, start=first_id):
        try:
            res, exp, identical = run_case(pg, cid, case, ranks)
        except Exception as exc:  # noqa: BLE001 (the group is now failed: report, stop)
            failures.append(f"rank {pg.rank}: {case}: {type(exc).__name__}: {exc}")
            break
        problem = _compare(case, res, exp)
        if problem:
            failures.append(f"rank {pg.rank}: {problem}")
        if identical:
            digests[cid] = _digest(res)
    return failures, digests


def job_matrix(
    pg: rc.ProcessGroup, chunk_bytes: int, full: bool
) -> tuple[list[str], dict[int, str | None]]:
    pg.chunk_bytes = chunk_bytes
    return run_cases(pg, matrix_cases(pg.world_size, full))


# --------------------------------------------------------------------------- tests
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
def test_matrix(world_size: int) -> None:
    """Every collective, every all_reduce algorithm, every dtype, ops rotating, counts
    {0, 1, n-1, n+1, 1000}, every root; at n = 3 and 5 also every dtype x every op."""
    full = world_size in (3, 5)
    results = rc.spawn(job_matrix, world_size, args=(64, full), timeout_s=280)
    assert_same_results(results)


def job_random_floats(pg: rc.ProcessGroup) -> tuple[list[str], list[str]]:
    """Random (inexact) floats: close to the oracle, and the same bits on every rank."""
    pg.chunk_bytes = 256
    failures, digests = [], []
    for i, (dt, algo, count) in enumerate(
        itertools.product(
            ("float16", "float32", "float64"), ("ring", "rd", "direct", "star", "shm"), (7, 1000)
        )
    ):

        def inp(r: int, i: int = i, count: int = count, dt: str = dt) -> np.ndarray:
            return np.random.default_rng([99, i, r]).standard_normal(count).astype(dt)

        for op in ("sum", "avg", "max", "prod"):
            x = inp(pg.rank)
            pg.all_reduce(x, op, algo=algo)
            exp = reference_reduce(op, [inp(r) for r in range(pg.world_size)])
            tol = 1e-2 if dt == "float16" else 1e-5
            if not np.allclose(x, exp, rtol=tol, atol=tol):
                failures.append(f"{dt} {algo} {count} {op}: not close to the oracle")
            digests.append(_digest(x))
        # The naive reference implementation agrees too.
        x = inp(pg.rank)
        naive = reference.naive_all_reduce(pg, x, "sum")
        pg.all_reduce(x, "sum", algo=algo)
        if not np.allclose(x, naive, rtol=1e-2, atol=1e-2):
            failures.append(f"{dt} {algo} {count}: differs from the naive reference")
    return failures, digests


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [3, 4])
def test_random_floats_close_and_bit_identical(world_size: int) -> None:
    results = rc.spawn(job_random_floats, world_size, timeout_s=110)
    assert not [f for fails, _ in results for f in fails]
    assert all(d == results[0][1] for _, d in results), "ranks differ in some bits"


def job_naive_reference(pg: rc.ProcessGroup) -> list[str]:
    """The naive reference implementations agree with the real ones (integers: exact)."""
    pg.chunk_bytes = 64
    failures = []
    n = pg.world_size
    x = make_input(5, pg.rank, np.dtype("int32"), (n, 11), "sum")
    if not np.array_equal(pg.reduce_scatter(x), reference.naive_reduce_scatter(pg, x)):
        failures.append("reduce_scatter")
    if not np.array_equal(pg.all_gather(x[0]), reference.naive_all_gather(pg, x[0])):
        failures.append("all_gather")
    b = x[1].copy()
    if not np.array_equal(pg.broadcast(b, src=n - 1), reference.naive_broadcast(pg, x[1], n - 1)):
        failures.append("broadcast")
    y = x[2].copy()
    if not np.array_equal(pg.all_reduce(y, "max"), reference.naive_all_reduce(pg, x[2], "max")):
        failures.append("all_reduce")
    return failures


@pytest.mark.timeout(60)
def test_naive_reference_agrees() -> None:
    assert rc.spawn(job_naive_reference, 3, timeout_s=50) == [[], [], []]


# --------------------------------------------------------------------------- large
def job_large(pg: rc.ProcessGroup) -> tuple[list[str], dict[int, str | None]]:
    count = (1 << 20) + 3
    cases: list[Case] = [
        ("all_reduce", "ring", "float32", "sum", count, None, 0),
        ("all_reduce", "ring", "int64", "avg", count, None, 0),
        ("all_reduce", "rd", "float32", "max", count, None, 0),
        ("all_gather", "ring", "float32", None, count, None, 1),
        ("reduce_scatter", "ring", "int32", "sum", count // pg.world_size, None, 1),
        ("broadcast", "chain", "float64", None, count, 1, 0),
        ("broadcast", "tree", "uint8", None, count, 2, 0),
        ("reduce", "tree", "float32", "sum", count, 1, 0),
        ("all_to_all", "direct", "float32", None, count // pg.world_size, None, 0),
    ]
    failures: list[str] = []
    digests: dict[int, str | None] = {}
    for chunk in (1 << 20, 256 << 10):  # the default, and many pieces of zero-copy size
        pg.chunk_bytes = chunk
        f, d = run_cases(pg, cases, first_id=len(digests))
        failures += f
        digests.update(d)
    return failures, digests


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [3, 4])
def test_large(world_size: int) -> None:
    """2**20 + 3 elements (uneven, pieces of zero-copy size) through every algorithm."""
    assert_same_results(rc.spawn(job_large, world_size, timeout_s=280))


def job_zero_copy(pg: rc.ProcessGroup) -> tuple[list[str], dict[int, str | None]]:
    """Every piece zero-copy (the transport's threshold lowered in this process): checks
    that no algorithm writes a region libzmq may still be reading (the ring's causality
    argument, reduce_scatter's buffer reuse, rd's exchange wait)."""
    import ringcomm.transport.zmq_transport as zt  # the test may; collectives may not

    zt.ZERO_COPY_MIN_BYTES = 4096  # pieces below wire.INLINE_MAX_BYTES still go inline
    pg.chunk_bytes = 8192
    n = pg.world_size
    cases: list[Case] = []
    for i, dt in enumerate(("float64", "int32", "uint8", "float16")):
        op = OPS[i % len(OPS)]
        cases += [
            ("all_reduce", "ring", dt, op, 20_000 + i, None, i),
            ("all_reduce", "rd", dt, op, 20_000 + i, None, i),
            ("all_reduce", "direct", dt, op, 20_000 + i, None, i),
            ("all_reduce", "star", dt, op, 20_000 + i, None, i),
            ("reduce_scatter", "ring", dt, op, 5_000 + i, None, i),
            ("all_gather", "ring", dt, None, 20_000 + i, None, i),
            ("broadcast", "chain", dt, None, 20_000, i % n, i),
            ("broadcast", "tree", dt, None, 20_000, (i + 1) % n, i),
            ("reduce", "tree", dt, op, 20_000, (i + 2) % n, i),
            ("all_to_all", "direct", dt, None, 5_000, None, i),
        ]
    failures: list[str] = []
    digests: dict[int, str | None] = {}
    for rep in range(3):
        f, d = run_cases(pg, cases, first_id=rep * len(cases))
        failures += f
        digests.update(d)
    return failures, digests


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [4, 5])
def test_zero_copy_safety(world_size: int) -> None:
    assert_same_results(rc.spawn(job_zero_copy, world_size, timeout_s=180))


# --------------------------------------------------------------------------- sub-groups
SUBGROUPS = ([1, 3, 4], [4, 0], [2], [0, 1, 2, 3, 4])


def job_subgroups(pg: rc.ProcessGroup) -> tuple[list[str], dict[str, dict[int, str | None]]]:
    pg.chunk_bytes = 64
    groups = [pg.new_group(ranks) for ranks in SUBGROUPS]
    failures: list[str] = []
    digests: dict[str, dict[int, str | None]] = {}
    world = [("all_reduce", "ring", "int32", "sum", 17, None, 0)]
    for round_ in range(2):
        for gi, (sub, ranks) in enumerate(zip(groups, SUBGROUPS)):
            if sub is not None:
                assert sub.world_size == len(ranks) and sub.ranks == tuple(ranks)
                cases = [
                    c
                    for c in matrix_cases(sub.world_size)
                    if c[0] != "all_reduce" or c[4] in (1, sub.world_size + 1, 1000)
                ]
                f, d = run_cases(sub, cases, ranks=ranks, first_id=1000 * gi)
                failures += f
                digests[f"group {gi}"] = d
            # A world collective between sub-group ones (every rank calls it).
            f, _ = run_cases(pg, world, first_id=round_)
            failures += f
    return failures, digests


@pytest.mark.timeout(300)
def test_subgroups() -> None:
    """Sub-groups (members in a different order than global ranks, a singleton, the
    whole world again) run every collective, interleaved with world collectives."""
    results = rc.spawn(job_subgroups, 5, timeout_s=200)
    failures = [f for fails, _ in results for f in fails]
    assert not failures, "\n".join(failures[:30])
    for gi, ranks in enumerate(SUBGROUPS):
        per_rank = [results[r][1][f"group {gi}"] for r in ranks]
        assert all(d == per_rank[0] for d in per_rank), f"sub-group {ranks}: ranks differ"


# --------------------------------------------------------------------------- async
def job_async(pg: rc.ProcessGroup) -> list[str]:
    """Several outstanding async collectives: complete in order, with correct values."""
    pg.chunk_bytes = 512
    n, me = pg.world_size, pg.rank
    failures = []
    specs = [(3, "rd"), (100_000, "ring"), (10, "ring"), (50_000, "rd"), (1, None), (70_000, None)]
    inputs = [
        make_input(700 + i, me, np.dtype("int64"), (c,), "sum") for i, (c, _) in enumerate(specs)
    ]
    works = [pg.all_reduce(x, async_op=True, algo=a) for x, (_, a) in zip(inputs, specs)]
    rs_in = make_input(800, me, np.dtype("float32"), (n, 999), "sum")
    works.append(pg.reduce_scatter(rs_in, op="max", async_op=True))
    ag_in = make_input(801, me, np.dtype("uint16"), (4000,), None)
    works.append(pg.all_gather(ag_in, async_op=True))
    bc = make_input(802, me, np.dtype("int8"), (5000,), None)
    works.append(pg.broadcast(bc, src=n - 1, async_op=True))
    # Work on the side, then watch them complete: never out of order.
    # (A look at one Work may drive progress and finish several: what is checked is that
    # whenever one is seen done, every earlier one is done too.)
    seen: set[int] = set()
    deadline = time.monotonic() + 60
    while len(seen) < len(works) and time.monotonic() < deadline:
        for i, w in enumerate(works):
            if i not in seen and w.done():
                seen.add(i)
                early = [j for j in range(i) if not works[j].done()]
                if early:
                    failures.append(f"work {i} done before works {early}")
        _ = np.sort(np.random.default_rng(me).random(20_000))  # "compute"
    if len(seen) != len(works):
        failures.append(f"only works {sorted(seen)} completed")
    for i, (w, (c, _)) in enumerate(zip(works[: len(specs)], specs)):
        res = w.wait()
        exp = reference_reduce(
            "sum", [make_input(700 + i, r, np.dtype("int64"), (c,), "sum") for r in range(n)]
        )
        if res is not inputs[i] or not np.array_equal(res, exp):
            failures.append(f"async all_reduce {i} wrong")
    exp_rs = reference_reduce(
        "max", [make_input(800, r, np.dtype("float32"), (n, 999), "sum") for r in range(n)]
    )[me]
    if not np.array_equal(works[len(specs)].wait(), exp_rs):
        failures.append("async reduce_scatter wrong")
    exp_ag = np.stack([make_input(801, r, np.dtype("uint16"), (4000,), None) for r in range(n)])
    if not np.array_equal(works[len(specs) + 1].wait(), exp_ag):
        failures.append("async all_gather wrong")
    if not np.array_equal(
        works[-1].wait(), make_input(802, n - 1, np.dtype("int8"), (5000,), None)
    ):
        failures.append("async broadcast wrong")
    # A blocking collective after async ones queues behind them.
    ws = [pg.all_reduce(np.full(7, me, np.int32), async_op=True) for _ in range(3)]
    y = pg.all_reduce(np.ones(3, np.int32))
    if not all(w.done() for w in ws) or y.tolist() != [n] * 3:
        failures.append("blocking call did not run after the queued async ones")
    if any(w.wait().tolist() != [n * (n - 1) // 2] * 7 for w in ws):
        failures.append("queued async values wrong")
    return failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_async_overlap(world_size: int) -> None:
    results = rc.spawn(job_async, world_size, timeout_s=110)
    assert results == [[]] * world_size


# --------------------------------------------------------------------------- algorithm choice
def job_algo_env(pg: rc.ProcessGroup) -> tuple[str | None, list[int]]:
    """Messages sent per 8-byte all_reduce tell the algorithm: W=2 shm 0 (the shared
    workspace), direct 1, rd 1, ring 2 (no fingerprint message: at W=2 each rank's first
    message goes to the other anyway; collectives.base: agreement before any write)."""
    sent = []
    for algo in (None, "rd", "ring"):
        before = pg.stats()["sent_messages"]
        pg.all_reduce(np.ones(2, np.float32), algo=algo)
        sent.append(pg.stats()["sent_messages"] - before)
    return pg.config.algo, sent


@pytest.mark.timeout(60)
def test_algo_keyword_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rc.spawn(job_algo_env, 2, timeout_s=50) == [(None, [0, 1, 2])] * 2
    monkeypatch.setenv("RINGCOMM_ALGO", "ring")
    assert rc.spawn(job_algo_env, 2, timeout_s=50) == [("ring", [2, 1, 2])] * 2
    monkeypatch.setenv("RINGCOMM_ALGO", "shm")
    assert rc.spawn(job_algo_env, 2, timeout_s=50) == [("shm", [0, 1, 2])] * 2
    monkeypatch.delenv("RINGCOMM_ALGO")
    monkeypatch.setenv("RINGCOMM_WORKSPACE", "0")  # no workspace: by size, direct
    assert rc.spawn(job_algo_env, 2, timeout_s=50) == [(None, [1, 1, 2])] * 2
