"""Uneven collectives (``all_gather_v``, ``reduce_scatter_v``, ``all_to_all_v``) against
the NumPy oracle, on real process groups; mismatches and bad arguments over the in-memory
transport.

As tests/test_collectives.py: one spawned job per world size runs many cases; inputs are
rank-seeded (``make_input``), so every rank rebuilds every other rank's rows and checks its
own result exactly (the data make every reduction exact in every dtype); all_gather_v's
result must be the same bytes on every rank. ``pg.chunk_bytes = 16`` forces many pieces per
segment. Row counts include 0 on some ranks (and on all), one rank holding everything, and
row shapes (), (3,), (2, 2).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from conftest import assert_same_results
from memory_world import memory_world, run_ranks
from test_collectives import DTYPES, _op_for, make_input

import ringcomm as rc
from ringcomm.ops import reference_reduce

pytestmark = pytest.mark.usefixtures("no_child_processes")

Case = tuple[Any, ...]  # (collective, dtype name, op, pattern, row shape, variant)
PATTERNS = ["ramp", "holes", "zeros", "one", "big"]
ROWS = [(), (3,), (2, 2)]
VARIANTS = {
    "all_gather_v": ["sizes", "none", "out", "async"],
    "reduce_scatter_v": ["plain", "out", "async"],
    "all_to_all_v": ["plain", "out", "async"],
}


def counts(pattern: str, n: int, salt: int) -> list[int]:
    """Row counts per rank (all_gather_v sizes, reduce_scatter_v splits)."""
    if pattern == "ramp":
        return [r + 1 for r in range(n)]
    if pattern == "holes":  # every other rank has none
        return [0 if (r + salt) % 2 else 2 * r + 3 for r in range(n)]
    if pattern == "zeros":
        return [0] * n
    if pattern == "one":  # one rank has everything
        return [37 if r == salt % n else 0 for r in range(n)]
    return [200 + 17 * r for r in range(n)]  # big: many pieces at 16-byte chunks


def split_matrix(pattern: str, n: int, salt: int) -> list[list[int]]:
    """``m[i][j]``: rows rank i sends rank j (all_to_all_v)."""
    if pattern == "zeros":
        return [[0] * n for _ in range(n)]
    if pattern == "one":
        return [[5 if j == salt % n else 0 for j in range(n)] for _ in range(n)]
    if pattern == "big":
        return [[60 + 7 * i + 3 * j for j in range(n)] for i in range(n)]
    m = 4 if pattern == "ramp" else 3
    return [[(3 * i + 5 * j + salt) % m for j in range(n)] for i in range(n)]


def cases_for(n: int) -> list[Case]:
    """Every dtype at n = 3; a couple of dtypes elsewhere (the same on every rank)."""
    dtypes = DTYPES if n == 3 else [DTYPES[(n * 5) % 12], DTYPES[(n * 5 + 7) % 12]]
    out: list[Case] = []
    i = 0
    for coll, variants in VARIANTS.items():
        for dt in dtypes:
            for pattern in PATTERNS:
                op = _op_for(dt, i) if coll == "reduce_scatter_v" else None
                out.append((coll, dt.name, op, pattern, ROWS[i % 3], variants[i % len(variants)]))
                i += 1
    return out


def run_case(pg: rc.ProcessGroup, cid: int, case: Case) -> tuple[Any, Any, bool]:
    """(result, expected, identical on every rank)."""
    coll, dtn, op, pattern, row, variant = case
    n, me = pg.world_size, pg.rank
    dt = np.dtype(dtn)

    def inp(r: int, rows: int) -> np.ndarray:
        return make_input(cid, r, dt, (rows, *row), op)

    def finish(res: Any) -> Any:
        return res.wait() if variant == "async" else res

    is_async = variant == "async"
    if coll == "all_gather_v":
        sizes = counts(pattern, n, cid)
        x = inp(me, sizes[me])
        exp = np.concatenate([inp(r, sizes[r]) for r in range(n)])
        if variant == "none":
            res = pg.all_gather_v(x)
        elif variant == "out":
            out = np.zeros(exp.shape, dt)
            res = pg.all_gather_v(x, sizes, out=out)
            assert res is out
        else:
            res = finish(pg.all_gather_v(x, sizes, async_op=is_async))
        return res, exp, True
    if coll == "reduce_scatter_v":
        splits = counts(pattern, n, cid)
        total = sum(splits)
        full = reference_reduce(op, [inp(r, total) for r in range(n)])
        a = sum(splits[:me])
        x = inp(me, total)
        keep = x.copy()
        if variant == "out":
            out = np.zeros((splits[me], *row), dt)
            res = pg.reduce_scatter_v(x, splits, out=out, op=op)
            assert res is out
        else:
            res = finish(pg.reduce_scatter_v(x, splits, op=op, async_op=is_async))
        assert np.array_equal(x, keep), "reduce_scatter_v wrote its input"
        return res, full[a : a + splits[me]], False
    m = split_matrix(pattern, n, cid)
    ins, outs = m[me], [m[j][me] for j in range(n)]
    x = inp(me, sum(ins))
    # rows rank j sent us: its rows from sum(m[j][:me]) on
    exp = np.concatenate(
        [inp(j, sum(m[j]))[sum(m[j][:me]) : sum(m[j][: me + 1])] for j in range(n)]
    )
    if variant == "out":
        out = np.zeros(exp.shape, dt)
        res = pg.all_to_all_v(x, ins, outs, out=out)
        assert res is out
    else:
        res = finish(pg.all_to_all_v(x, ins, outs, async_op=is_async))
    return res, exp, False


def digest(a: np.ndarray) -> str:
    return hashlib.sha1(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest()


def job_matrix(pg: rc.ProcessGroup, chunk_bytes: int) -> tuple[list[str], dict[int, str | None]]:
    pg.chunk_bytes = chunk_bytes
    pg.timeout_s = 60.0
    failures: list[str] = []
    digests: dict[int, str | None] = {}
    for cid, case in enumerate(cases_for(pg.world_size)):
        try:
            res, exp, identical = run_case(pg, cid, case)
        except Exception as exc:  # noqa: BLE001 (the group may be failed now: report, stop)
            failures.append(f"rank {pg.rank}: {case}: {type(exc).__name__}: {exc}")
            break
        if not isinstance(res, np.ndarray) or res.dtype != exp.dtype or res.shape != exp.shape:
            failures.append(
                f"rank {pg.rank}: {case}: got {res!r:.80}, expected {exp.dtype}{exp.shape}"
            )
        elif not np.array_equal(res, exp):
            failures.append(f"rank {pg.rank}: {case}: values differ from the oracle")
        if identical:
            digests[cid] = digest(res)
    return failures, digests


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_matrix(world_size: int) -> None:
    """Every uneven collective x patterns (0 rows on some ranks, all, one rank with all) x
    row shapes x variants (sizes exchanged, out=, async), exact; every dtype at W=3."""
    results = rc.spawn(job_matrix, world_size, args=(16,), timeout_s=220)
    assert_same_results(results)


def job_large(pg: rc.ProcessGroup) -> list[str]:
    """Megabytes per rank, default pieces (4 MiB) and small ones (64 KiB); rank 1 none."""
    n, me = pg.world_size, pg.rank
    bad = []
    # mixed with the group's other collectives (on one host: its shared workspace)
    a = np.full(1000, me + 1.0)
    w = pg.all_reduce(a, async_op=True)
    mid = pg.all_gather_v(np.full(me, me, np.int16), async_op=True)
    b = np.full(10, 1, np.int64)
    pg.all_reduce(b)
    w.wait()
    if not (np.all(a == n * (n + 1) / 2) and np.all(b == n)):
        bad.append("all_reduce around all_gather_v")
    if not np.array_equal(mid.wait(), np.repeat(np.arange(n), np.arange(n)).astype(np.int16)):
        bad.append("all_gather_v between all_reduces")
    for chunk in (pg.chunk_bytes, 64 * 1024):
        pg.chunk_bytes = chunk
        rows = [0 if r == 1 else (1 << 20) + r for r in range(n)]  # float32 rows of 4 B
        x = np.arange(rows[me], dtype=np.float32) + me
        got = pg.all_gather_v(x)
        exp = np.concatenate([np.arange(rows[r], dtype=np.float32) + r for r in range(n)])
        if not np.array_equal(got, exp):
            bad.append(f"all_gather_v chunk {chunk}")
        y = np.ones((sum(rows), 2), np.int32) * (me + 1)
        part = pg.reduce_scatter_v(y, rows)
        if part.shape != (rows[me], 2) or not np.all(part == n * (n + 1) // 2):
            bad.append(f"reduce_scatter_v chunk {chunk}")
        send = [rows[j] // 4 for j in range(n)]  # rank me sends rank j rows[j] // 4 rows
        z = np.full((sum(send), 3), me, np.int64)
        got = pg.all_to_all_v(z, send, [send[me]] * n)
        if not np.array_equal(got, np.repeat(np.arange(n), send[me])[:, None].repeat(3, 1)):
            bad.append(f"all_to_all_v chunk {chunk}")
    return bad


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [3, 4])
def test_large(world_size: int) -> None:
    """At W=4 reduce_scatter_v reuses its partial buffers (zero-copy pieces in flight)."""
    assert rc.spawn(job_large, world_size, timeout_s=150) == [[]] * world_size


# -- mismatches between ranks (memory transport) -----------------------------------------
def test_mismatched_sizes_raise_on_every_rank() -> None:
    """Ranks that disagree on sizes/splits raise CollectiveMismatchError (all of them,
    all_to_all_v's ranks outside the pair that disagrees too) without writing ``out``; the
    group is unusable after a mismatch, so one group each."""

    def gather_v(pg: rc.ProcessGroup) -> Any:
        sizes = [1, 2, 3] if pg.rank != 2 else [1, 2, 4]
        x = np.ones((sizes[pg.rank], 2))
        out = np.full((sum(sizes), 2), -1.0)
        with pytest.raises(rc.CollectiveMismatchError, match="all_gather_v"):
            pg.all_gather_v(x, sizes, out=out)
        return bool(np.all(out == -1.0))

    def scatter_v(pg: rc.ProcessGroup) -> Any:
        splits = [2, 2, 2] if pg.rank != 0 else [1, 2, 3]
        out = np.full((splits[pg.rank],), -1, np.int64)
        with pytest.raises(rc.CollectiveMismatchError, match="reduce_scatter_v"):
            pg.reduce_scatter_v(np.ones(6, np.int64), splits, out=out)
        return bool(np.all(out == -1))

    def to_all_v(pg: rc.ProcessGroup) -> Any:
        # rank 0 sends rank 1 two rows; rank 1 expects three from it. Every rank raises,
        # rank 2 too (it is not in the pair), and no rank's out is written (issue 29).
        m = [[1, 2, 1], [1, 1, 1], [1, 1, 1]]
        ins = m[pg.rank]
        outs = [m[j][pg.rank] for j in range(3)]
        if pg.rank == 1:
            outs[0] = 3
        x = np.ones(sum(ins), np.float32)
        out = np.full(sum(outs), -1.0, np.float32)
        with pytest.raises(rc.CollectiveMismatchError, match="rank 0 sends 2 rows to rank 1"):
            pg.all_to_all_v(x, ins, outs, out=out)
        return bool(np.all(out == -1.0))

    for fn in (gather_v, scatter_v, to_all_v):
        with memory_world(3, chunk_bytes=8) as groups:
            assert run_ranks(groups, fn, timeout_s=30) == [True] * 3, fn.__name__


def test_row_shapes_must_match() -> None:
    def body(pg: rc.ProcessGroup) -> Any:
        x = np.ones((2, 3 if pg.rank else 4))
        with pytest.raises(rc.CollectiveMismatchError):
            pg.all_gather_v(x)

    with memory_world(2) as groups:
        run_ranks(groups, body, timeout_s=30)


def test_bad_arguments_fail_before_sending() -> None:
    with memory_world(2) as groups:
        pg = groups[0]
        before = pg.stats()["sent_messages"]
        x = np.ones((3, 2))
        bad: list[tuple[Any, type[Exception], str]] = [
            (lambda: pg.all_gather_v(x, [2, 1]), ValueError, r"sizes\[0\] is 2 but x has 3 rows"),
            (lambda: pg.all_gather_v(x, [3]), ValueError, "one count per rank"),
            (lambda: pg.all_gather_v(x, [3, -1]), ValueError, ">= 0"),
            (lambda: pg.all_gather_v(x, [3, 1.0]), TypeError, "must hold ints"),
            (lambda: pg.all_gather_v(x, "31"), TypeError, "sequence"),
            (lambda: pg.all_gather_v(np.array(1.0), [1, 1]), ValueError, "0-d"),
            (lambda: pg.all_gather_v(x, [3, 1], out=np.ones((3, 2))), ValueError, "out has shape"),
            (lambda: pg.reduce_scatter_v(x, [1, 1]), ValueError, "add up to 2 rows but x has 3"),
            (lambda: pg.reduce_scatter_v(x, [1, 2], op="nope"), ValueError, "op"),
            (lambda: pg.reduce_scatter_v(x, [1, 2], out=x[:1]), ValueError, "overlap"),
            (lambda: pg.all_to_all_v(x, [1, 2], [2, 2]), ValueError, "sends itself"),
            (lambda: pg.all_to_all_v(x, [1, 1], [1, 2]), ValueError, "add up to 2 rows"),
            (lambda: pg.all_to_all_v(x, [1, 2], [1, 2], out=x), ValueError, "overlap"),
        ]
        for fn, exc, text in bad:
            with pytest.raises(exc, match=text) as info:
                fn()
            assert "rank 0" in str(info.value), str(info.value)
        assert pg.stats()["sent_messages"] == before, "a rejected call sent something"


def test_registry() -> None:
    from ringcomm.collectives import (
        ALGORITHMS,
        UNEVEN_ALGORITHMS,
        choose_algorithm,
        get_algorithm,
    )
    from ringcomm.schedule.partition import split_offsets

    for coll, table in UNEVEN_ALGORITHMS.items():
        assert coll not in ALGORITHMS
        for name, cls in table.items():
            assert get_algorithm(coll, name) is cls and (cls.name, cls.algo) == (coll, name)
        # no workspace algorithm: RINGCOMM_ALGO=shm or another collective's name picks the default
        assert choose_algorithm(coll, None, "shm", 8, 4) == next(iter(table))
        assert choose_algorithm(coll, None, "rd", 8, 4) == next(iter(table))
    assert split_offsets([2, 0, 3]) == [0, 2, 2, 5] and split_offsets([]) == [0]
    with pytest.raises(ValueError):
        split_offsets([1, -1])


def test_device_arrays_through_the_stand_in() -> None:
    """Device arrays (the host stand-in for CuPy) go through whole-buffer staging."""
    from ringcomm.device.standin import StandinArray

    sizes = [2, 0, 3]

    def body(pg: rc.ProcessGroup) -> Any:
        r = pg.rank
        a = pg.all_gather_v(StandinArray(np.full((sizes[r], 2), r, np.float32)), sizes)
        b = pg.reduce_scatter_v(StandinArray(np.ones((5, 2), np.int32) * (r + 1)), sizes)
        c = pg.all_to_all_v(StandinArray(np.full(3, r, np.int64)), [1, 1, 1], [1, 1, 1])
        assert all(type(v) is StandinArray for v in (a, b, c))
        return a.get(), b.get(), c.get()

    with memory_world(3, chunk_bytes=16) as groups:
        results = run_ranks(groups, body, timeout_s=30)
    exp = np.concatenate([np.full((s, 2), r, np.float32) for r, s in enumerate(sizes)])
    for r, (a, b, c) in enumerate(results):
        assert np.array_equal(a, exp)
        assert np.array_equal(b, np.full((sizes[r], 2), 6, np.int32))
        assert np.array_equal(c, np.arange(3))
