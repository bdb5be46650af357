"""One outcome per collective (issue 29): once a rank failed collective #k of a group, every
other rank's call #k fails too, with the first failure's type and reason.

Ranks 0 and 1 time out in an all_reduce that rank 2 joins only after they failed (they
tell it through the store, not the group). Rank 2's call could complete from what they
left in the workspace or had sent: it must raise their CommTimeoutError instead, on the
shared workspace and over sockets, and every later call of the group fails everywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ringcomm as rc


def job_late_rank(pg: rc.ProcessGroup, size: int, algo: str | None) -> dict[str, Any]:
    store = pg.core.state.store
    assert store is not None
    x = np.full(size, pg.rank + 1.0)
    out: dict[str, Any] = {}
    if pg.rank < 2:
        try:
            pg.all_reduce(x, timeout_s=1.5, algo=algo)
            out["first"] = "success"
        except rc.RingcommError as exc:
            out["first"] = f"{type(exc).__name__}: {exc}"
        store.set(f"failed/{pg.rank}", b"1")  # outside the group: it is failed here
    else:
        store.wait(["failed/0", "failed/1"], timeout_s=60)
        try:
            pg.all_reduce(x, timeout_s=30, algo=algo)
            out["first"] = "success"
        except rc.RingcommError as exc:
            out["first"] = f"{type(exc).__name__}: {exc}"
    out["untouched"] = bool((x == pg.rank + 1.0).all())
    try:
        pg.barrier(timeout_s=5)
        out["later"] = "success"
    except rc.RingcommError as exc:
        out["later"] = type(exc).__name__
    store.set(f"done/{pg.rank}", b"1")
    store.wait([f"done/{r}" for r in range(3)], timeout_s=60)  # nobody leaves early
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", ["workspace", "sockets", "sockets-direct"])
@pytest.mark.parametrize("size", [2, 40_000])
def test_a_late_rank_fails_the_call_its_peers_failed(
    path: str, size: int, monkeypatch: pytest.MonkeyPatch, no_child_processes: None
) -> None:
    """``sockets-direct``: every rank sends its input to every other at once, so the late
    rank has all it needs from what its peers sent before they failed."""
    if path != "workspace":
        monkeypatch.setenv("RINGCOMM_WORKSPACE", "0")
    algo = "direct" if path == "sockets-direct" else None
    results = rc.spawn(job_late_rank, 3, args=(size, algo), timeout_s=150)
    for r, res in enumerate(results):
        assert res["first"].startswith("CommTimeoutError"), (r, res)
        assert res["later"] != "success", (r, res)
    late = results[2]["first"]
    assert "failed collective #1 of this group" in late, late
    assert "timed out" in late and "rank 2" in late, late  # the first failure's reason
    assert results[0]["untouched"] and results[1]["untouched"]
    if path == "workspace":
        assert results[2]["untouched"]  # failed before anything was reduced into x


def job_splits_disagree(pg: rc.ProcessGroup, trials: int) -> list[tuple[str, bool]]:
    """Each trial in a fresh sub-group: one rank's output_splits[j] is one more than what
    rank j sends it; pieces of 64 bytes, so every message has several."""
    n, me = pg.world_size, pg.rank
    rng = np.random.default_rng(7)  # the same on every rank
    seen = []
    for _ in range(trials):
        m = rng.integers(0, 4, size=(n, n))
        who = int(rng.integers(0, n))
        peer = (who + 1 + int(rng.integers(0, n - 1))) % n  # another rank
        sub = pg.new_group(list(range(n)))
        assert sub is not None
        sub.chunk_bytes = 64
        ins = [int(v) for v in m[me]]
        outs = [int(m[j][me]) for j in range(n)]
        if me == who:
            outs[peer] += 1
        x = np.arange(sum(ins) * 3, dtype=np.float64).reshape(-1, 3)
        out = np.full((sum(outs), 3), -1.0)
        try:
            sub.all_to_all_v(x, ins, outs, out=out, timeout_s=30)
            kind = "success"
        except rc.RingcommError as exc:
            kind = type(exc).__name__
        seen.append((kind, bool((out == -1.0).all())))
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [3, 4])
def test_all_to_all_v_splits_that_disagree_leave_every_out_untouched(
    world_size: int, no_child_processes: None
) -> None:
    results = rc.spawn(job_splits_disagree, world_size, args=(6,), timeout_s=150)
    for r, seen in enumerate(results):
        for t, (kind, untouched) in enumerate(seen):
            assert kind == "CollectiveMismatchError", (r, t, kind)
            assert untouched, f"rank {r}, trial {t}: out written before the mismatch raised"
