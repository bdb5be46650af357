"""Collectives: argument checks, fingerprint mismatches, the registry and layering."""

from __future__ import annotations

import ast
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm.collectives import ALGORITHMS, choose_algorithm, get_algorithm
from ringcomm.collectives.base import Call, describe_fingerprint, fingerprint
from ringcomm.ops import ReduceOp

COLLECTIVES_DIR = Path(__file__).resolve().parents[1] / "ringcomm" / "collectives"


# --------------------------------------------------------------------------- pure parts
def test_collectives_never_import_zmq() -> None:
    for path in sorted(COLLECTIVES_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            bad = [n for n in names if "zmq" in n]
            assert not bad, f"{path.name} imports {bad}"


def test_registry_and_choice() -> None:
    assert set(ALGORITHMS) == {
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "all_to_all",
        "barrier",
    }
    for coll, table in ALGORITHMS.items():
        for name, cls in table.items():
            assert get_algorithm(coll, name) is cls
            assert (cls.name, cls.algo) == (coll, name)
    assert choose_algorithm("all_reduce", None, None, 8) == "direct"
    assert choose_algorithm("all_reduce", None, None, 8, world_size=8) == "star"
    assert choose_algorithm("all_reduce", None, None, 1024, world_size=3) == "star"
    assert choose_algorithm("all_reduce", None, None, 1025, world_size=3) == "direct"
    assert choose_algorithm("all_reduce", None, None, 8, world_size=9) == "rd"
    assert choose_algorithm("all_reduce", None, None, 8, world_size=2) == "direct"
    assert choose_algorithm("all_reduce", None, None, 256 << 10, world_size=2) == "rd"
    assert choose_algorithm("all_reduce", None, None, 64 << 20) == "ring"
    assert choose_algorithm("all_reduce", "ring", "rd", 8) == "ring"  # keyword wins
    assert choose_algorithm("all_reduce", None, "ring", 8) == "ring"  # then the env
    assert choose_algorithm("broadcast", None, "ring", 8) == "tree"  # env names another's
    assert choose_algorithm("broadcast", None, None, 64 << 20) == "chain"
    with pytest.raises(ValueError, match="unknown algo"):
        choose_algorithm("all_reduce", "chain", None, 8)
    with pytest.raises(ValueError, match="RINGCOMM_ALGO"):
        choose_algorithm("all_reduce", None, "bogus", 8)
    # A group with a shared workspace (local): shm, unless asked for another algorithm.
    for coll in ALGORITHMS:
        assert choose_algorithm(coll, None, None, 64 << 20, 4, local=True) == "shm"
        assert choose_algorithm(coll, None, "shm", 8, 4, local=True) == "shm"
    assert choose_algorithm("all_reduce", None, "ring", 8, 4, local=True) == "ring"
    assert choose_algorithm("all_reduce", "rd", None, 8, 4, local=True) == "rd"
    assert choose_algorithm("broadcast", None, "ring", 8, 4, local=True) == "shm"
    assert choose_algorithm("all_reduce", None, "shm", 8, 2) == "direct"  # no workspace
    assert choose_algorithm("all_reduce", "shm", None, 8, 1) == "ring"  # a group of one
    with pytest.raises(ValueError, match="needs a group whose ranks share one host"):
        choose_algorithm("all_reduce", "shm", None, 8, 2)


def test_fingerprint_description() -> None:
    call = Call("all_reduce", "ring", op=ReduceOp.SUM, dtype=np.dtype("float32"), shape=(4, 250))
    fp = fingerprint(call, 64)
    assert fp == ["all_reduce", "<f4", [4, 250], "sum", None, "ring", 64]
    assert (
        describe_fingerprint(fp) == "all_reduce(float32[4x250], op=sum, algo=ring, chunk_bytes=64)"
    )
    bc = fingerprint(Call("broadcast", "tree", root=2, dtype=np.dtype("int8"), shape=()), 8)
    assert describe_fingerprint(bc) == "broadcast(int8[], src=2, algo=tree, chunk_bytes=8)"
    assert "unrecognised" in describe_fingerprint({"junk": 1})


# --------------------------------------------------------------------------- argument checks
def _bad_calls(pg: rc.ProcessGroup) -> list[tuple[str, type[Exception], Any]]:
    n = pg.world_size
    f32 = np.zeros((n, 4), np.float32)
    return [
        ("non-contiguous", ValueError, lambda: pg.all_reduce(np.zeros((4, 4))[:, 0])),
        ("complex dtype", TypeError, lambda: pg.all_reduce(np.zeros(3, np.complex64))),
        ("object", TypeError, lambda: pg.all_reduce([1, 2, 3])),
        ("read-only", ValueError, lambda: pg.all_reduce(np.frombuffer(b"\0" * 8))),
        ("unknown op", ValueError, lambda: pg.all_reduce(np.zeros(3), op="mean")),
        ("avg on bool", TypeError, lambda: pg.all_reduce(np.zeros(3, bool), op="avg")),
        ("bad algo", ValueError, lambda: pg.all_reduce(np.zeros(3), algo="chain")),
        ("async not bool", TypeError, lambda: pg.all_reduce(np.zeros(3), async_op="yes")),
        ("bad timeout", ValueError, lambda: pg.all_reduce(np.zeros(3), timeout_s=0)),
        ("rs rows", ValueError, lambda: pg.reduce_scatter(np.zeros((n + 1, 4)))),
        ("rs 0-d", ValueError, lambda: pg.reduce_scatter(np.zeros(()))),
        ("rs out shape", ValueError, lambda: pg.reduce_scatter(f32, out=np.zeros(5, np.float32))),
        ("rs out dtype", TypeError, lambda: pg.reduce_scatter(f32, out=np.zeros(4, np.float64))),
        ("rs avg bool", TypeError, lambda: pg.reduce_scatter(np.zeros((n, 2), bool), op="avg")),
        ("ag out shape", ValueError, lambda: pg.all_gather(np.zeros(3), out=np.zeros((n, 4)))),
        (
            "ag out dtype",
            TypeError,
            lambda: pg.all_gather(np.zeros(3), out=np.zeros((n, 3), np.int8)),
        ),
        (
            "ag out non-contiguous",
            ValueError,
            lambda: pg.all_gather(np.zeros(3), out=np.zeros((n, 6))[:, ::2]),
        ),
        ("bcast src range", ValueError, lambda: pg.broadcast(np.zeros(3), src=n)),
        ("bcast src type", TypeError, lambda: pg.broadcast(np.zeros(3), src=0.0)),
        ("bcast algo", ValueError, lambda: pg.broadcast(np.zeros(3), algo="rd")),
        ("reduce dst", ValueError, lambda: pg.reduce(np.zeros(3), dst=-1)),
        ("reduce avg bool", TypeError, lambda: pg.reduce(np.zeros(3, bool), op="avg")),
        ("gather dst", ValueError, lambda: pg.gather(np.zeros(3), dst=n + 5)),
        ("gather out", ValueError, lambda: pg.gather(np.zeros(3), dst=pg.rank, out=np.zeros(3))),
        ("scatter src none", TypeError, lambda: pg.scatter(None, src=pg.rank)),
        ("scatter rows", ValueError, lambda: pg.scatter(np.zeros((n + 1, 2)), src=pg.rank)),
        (
            "scatter out",
            ValueError,
            lambda: pg.scatter(f32, src=pg.rank, out=np.zeros(3, np.float32)),
        ),
        ("a2a rows", ValueError, lambda: pg.all_to_all(np.zeros((n + 2, 3)))),
        ("a2a overlap", ValueError, lambda: pg.all_to_all(f32, out=f32)),
        ("barrier async", TypeError, lambda: pg.barrier(async_op=1)),
    ]


def job_argument_checks(pg: rc.ProcessGroup) -> tuple[list[str], list[float], int]:
    """Rank 0 makes bad calls: each raises at once, nothing is sent, the group still works."""
    problems = []
    if pg.rank == 0:
        before = (pg.stats()["sent_messages"], pg.core.collective_seq)
        for name, exc_type, call in _bad_calls(pg):
            try:
                call()
            except exc_type as exc:
                if f"rank {pg.rank}" not in str(exc) and name != "unknown op":
                    problems.append(f"{name}: message does not name the rank: {exc}")
            except Exception as exc:  # noqa: BLE001 (reported)
                problems.append(
                    f"{name}: {type(exc).__name__} instead of {exc_type.__name__}: {exc}"
                )
            else:
                problems.append(f"{name}: no error")
        if (pg.stats()["sent_messages"], pg.core.collective_seq) != before:
            problems.append("a rejected call sent a message or took a sequence number")
    x = np.full(3, pg.rank + 1.0)
    pg.all_reduce(x)
    return problems, x.tolist(), pg.world_size


@pytest.mark.timeout(60)
def test_argument_checks() -> None:
    results = rc.spawn(job_argument_checks, 2, timeout_s=50)
    assert results[0][0] == [], "\n".join(results[0][0])
    assert all(r[1] == [3.0, 3.0, 3.0] for r in results)


@pytest.mark.timeout(60)
def test_world_of_one_in_process() -> None:
    """A group of one (no spawn): every collective is local and exact."""
    with rc.init_process_group(0, 1) as pg:
        x = np.arange(5, dtype=np.int16)
        assert pg.all_reduce(x, "avg") is x and x.tolist() == [0, 1, 2, 3, 4]
        assert pg.reduce_scatter(np.ones((1, 3)), op="prod").tolist() == [1.0] * 3
        assert pg.all_gather(np.arange(2)).tolist() == [[0, 1]]
        assert pg.broadcast(np.ones(2)).tolist() == [1.0, 1.0]
        assert pg.reduce(np.ones(2), op="max").tolist() == [1.0, 1.0]
        assert pg.gather(np.arange(2)).tolist() == [[0, 1]]
        assert pg.scatter(np.arange(4).reshape(1, 4)).tolist() == [0, 1, 2, 3]
        assert pg.all_to_all(np.arange(3).reshape(1, 3)).tolist() == [[0, 1, 2]]
        assert pg.barrier() is None
        w = pg.all_reduce(np.ones(3), async_op=True)
        assert w.wait().tolist() == [1.0] * 3 and w.done()


# --------------------------------------------------------------------------- mismatches
def _mismatch_call(name: str, pg: rc.ProcessGroup, bad: bool) -> tuple[np.ndarray, Any]:
    """(buffer that must stay untouched, the call) for one kind of mismatch."""
    n = pg.world_size
    if name == "count":
        x = np.ones(11 if bad else 10, np.float32)
        return x, lambda g: g.all_reduce(x)
    if name == "count_ring":
        x = np.ones(5001 if bad else 5000, np.float32)
        return x, lambda g: g.all_reduce(x, algo="ring")
    if name == "ring_vs_rd":
        x = np.ones(100_000 if bad else 10, np.float32)  # different counts pick other algos
        return x, lambda g: g.all_reduce(x)
    if name == "dtype":
        x = np.ones(10, np.float64 if bad else np.float32)
        return x, lambda g: g.all_reduce(x)
    if name == "op":
        x = np.ones(10, np.int32)
        return x, lambda g: g.all_reduce(x, op="max" if bad else "sum")
    if name == "algo":
        x = np.ones(10, np.int32)
        return x, lambda g: g.all_reduce(x, algo="ring" if bad else "rd")
    if name == "collective":
        x = np.ones(10, np.int32)
        return x, (lambda g: g.broadcast(x)) if bad else (lambda g: g.all_reduce(x))
    if name == "shape":
        out = np.zeros((n, 3, 2) if bad else (n, 2, 3), np.float32)
        x = np.ones(out.shape[1:], np.float32)
        return out, lambda g: g.all_gather(x, out=out)
    if name == "rows":
        x = np.ones((n, 5 if bad else 4), np.int64)
        out = np.zeros(x.shape[1:], np.int64)
        return out, lambda g: g.reduce_scatter(x, out=out)
    if name == "chunk_bytes":
        x = np.ones(1000, np.float32)

        def call(g: rc.ProcessGroup) -> Any:
            g.chunk_bytes = 128 if bad else 64
            return g.all_reduce(x, algo="ring")

        return x, call
    if name == "scatter_dtype":
        out = np.zeros(3, np.int64 if bad else np.int32)
        full = np.ones((n, 3), np.int32)
        return out, lambda g: g.scatter(
            full if g.rank == 0 else None, src=0, out=None if g.rank == 0 else out
        )
    raise AssertionError(name)


MISMATCHES = [
    "count",
    "count_ring",
    "ring_vs_rd",
    "dtype",
    "op",
    "algo",
    "collective",
    "shape",
    "rows",
    "chunk_bytes",
    "scatter_dtype",
]


def job_mismatch(
    pg: rc.ProcessGroup, bad_rank: int
) -> tuple[list[tuple[str, str, str, bool, float]], list[float]]:
    results = []
    for name in MISMATCHES:
        sub = pg.new_group(range(pg.world_size))  # a mismatch fails this group only
        assert sub is not None
        sub.chunk_bytes = 64
        buf, call = _mismatch_call(name, sub, pg.rank == bad_rank)
        before = buf.copy()
        t0 = time.monotonic()
        try:
            call(sub)
            outcome, text = "ok", ""
        except Exception as exc:  # noqa: BLE001 (reported)
            outcome, text = type(exc).__name__, str(exc)
        elapsed = time.monotonic() - t0
        results.append((name, outcome, text, bool(np.array_equal(buf, before)), elapsed))
        pg.barrier(timeout_s=30)  # realign on the world group, which is unaffected
    y = np.ones(3)
    pg.all_reduce(y)
    return results, y.tolist()


@pytest.mark.timeout(120)
def test_mismatch_two_ranks() -> None:
    """Both ranks raise CollectiveMismatchError naming both calls, quickly (no hang), with
    their buffers untouched; the world group keeps working."""
    results = rc.spawn(job_mismatch, 2, args=(1,), timeout_s=110)
    for rank, (cases, y) in enumerate(results):
        assert y == [2.0] * 3
        for name, outcome, text, unchanged, elapsed in cases:
            where = f"rank {rank}, case {name}: {outcome}: {text}"
            # (scatter_dtype: the source hears every rank before it writes, so it raises too)
            assert outcome == "CollectiveMismatchError", where
            assert unchanged, f"{where}: buffer modified"
            assert elapsed < 10, f"{where}: took {elapsed:.1f} s"
            assert "called" in text, where
    # The detecting side names both calls, e.g. float32[10] against float32[11].
    text = {c[0]: c[2] for c in results[0][0]}
    assert "float32[10]" in text["count"] and "float32[11]" in text["count"]
    assert "float64" in text["dtype"] and "op=max" in text["op"]
    assert "broadcast" in text["collective"] and "chunk_bytes=128" in text["chunk_bytes"]


@pytest.mark.timeout(120)
def test_mismatch_three_ranks_all_fail_fast() -> None:
    """One rank of three differs: every rank fails with CollectiveMismatchError (directly
    or through the abort the detecting rank sends), none waits for its deadline; a rank
    that says its buffer is untouched has it untouched."""
    results = rc.spawn(job_mismatch, 3, args=(2,), timeout_s=110)
    for rank, (cases, y) in enumerate(results):
        assert y == [3.0] * 3
        for name, outcome, text, unchanged, elapsed in cases:
            where = f"rank {rank}, case {name}: {outcome}: {text}"
            # (scatter_dtype: every rank hears every other before it writes: all raise)
            assert outcome == "CollectiveMismatchError", where
            assert elapsed < 10, f"{where}: took {elapsed:.1f} s"
            if text.endswith(f"rank {rank}'s output buffer is untouched"):
                assert unchanged, where


def job_timeout_then_usable(pg: rc.ProcessGroup) -> tuple[str, list[float]]:
    """A collective a peer never joins times out (bounded); the world group goes on."""
    sub = pg.new_group(range(pg.world_size))
    assert sub is not None
    outcome = "ok"
    if pg.rank == 0:
        try:
            sub.all_reduce(np.ones(4), timeout_s=0.5)
        except rc.CommTimeoutError as exc:
            outcome = str(exc)
    pg.barrier()
    y = pg.all_reduce(np.ones(2))
    return outcome, y.tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workspace", [True, False])
def test_timeout_is_bounded(workspace: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The error says whom the rank waited for, and where: on the shared workspace at
    which sync, over messages how many it got."""
    if not workspace:
        monkeypatch.setenv("RINGCOMM_WORKSPACE", "0")
    results = rc.spawn(job_timeout_then_usable, 2, timeout_s=50)
    # (on the workspace a sub-group's first call sets it up: rank 1 never comes to it)
    where = "waiting for rank 1 at the setup" if workspace else "0/1 messages from rank 1"
    assert "timed out after 0.5 s" in results[0][0] and where in results[0][0], results[0][0]
    assert results[0][1] == results[1][1] == [2.0, 2.0]
