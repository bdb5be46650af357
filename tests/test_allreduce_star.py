"""The star all_reduce (collectives/allreduce_star.py): through group rank 0 and back.

The correctness matrix (test_collectives.py) runs it at every world size, dtype, op and
piece count; here: the same bits as the direct exchange (same reduction order), the fast
lane taken on both sides, and a mismatch caught by rank 0 before any rank writes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

import ringcomm as rc

# The message path on one host (collectives would take the shared workspace).
pytestmark = pytest.mark.usefixtures("no_workspace")


def job_same_bits_as_direct(pg: rc.ProcessGroup) -> dict[str, Any]:
    taken = {"list": 0, "other": 0}
    original = pg.core.progress.exchange

    def exchange(*args: Any, **kwargs: Any) -> Any:
        got = original(*args, **kwargs)
        taken["list" if type(got) is list else "other"] += 1
        return got

    pg.core.progress.exchange = exchange  # type: ignore[method-assign]
    digests: dict[str, list[str]] = {"star": [], "direct": []}
    for algo in ("star", "direct"):
        for i, (dt, count, op) in enumerate(
            [
                ("float32", 2, "sum"),
                ("float16", 200, "avg"),
                ("float64", 1000, "prod"),
                ("int64", 7, "max"),
                ("bool", 33, "sum"),
                ("float32", 0, "sum"),
            ]
        ):
            rng = np.random.default_rng([7, i, pg.rank])
            x = (rng.standard_normal(count) * 3).astype(dt)
            pg.all_reduce(x, op, algo=algo)
            digests[algo].append(hashlib.sha256(x.tobytes()).hexdigest())
    return {"digests": digests, "taken": taken}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [3, 5])
def test_same_bits_as_direct_and_the_fast_lane_is_taken(world_size: int) -> None:
    results = rc.spawn(job_same_bits_as_direct, world_size, timeout_s=100)
    first = results[0]["digests"]
    for res in results:
        assert res["digests"] == first  # every rank the same bits
        assert res["taken"]["other"] == 0  # every blocking call went the fast lane
    assert first["star"] == first["direct"]  # the same bits as the direct exchange


def job_mismatch(pg: rc.ProcessGroup, deviant: int, async_op: bool) -> tuple[str, bool]:
    dtype = np.float64 if pg.rank == deviant else np.float32
    x = np.full(2, pg.rank + 1, dtype)
    before = x.copy()
    try:
        if async_op:
            pg.all_reduce(x, async_op=True, algo="star").wait(timeout_s=20)
        else:
            pg.all_reduce(x, algo="star", timeout_s=20)
    except rc.CollectiveMismatchError as exc:
        return type(exc).__name__, bool((x == before).all())
    except rc.RingcommError as exc:
        return f"{type(exc).__name__}: {exc}", bool((x == before).all())
    return "completed", bool((x == before).all())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("deviant", "async_op"), [(2, False), (0, False), (3, True)])
def test_a_mismatch_raises_everywhere_and_writes_nothing(deviant: int, async_op: bool) -> None:
    results = rc.spawn(job_mismatch, 4, (deviant, async_op), timeout_s=100)
    assert results == [("CollectiveMismatchError", True)] * 4, results
