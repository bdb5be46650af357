"""Elastic data parallel (``ringcomm train --strategy dp --elastic``, ringcomm.engine.elastic):
a rank killed (SIGKILL, fault injection ``fail_at``) at a step; the survivors undo the step,
shrink, re-split the same global batch and go on; with ``max_restarts`` the slot comes back
and the batch is split over all again. The losses and final parameters equal ``single``'s
for the same global batches (float64, 1e-10), before, during and after the failure."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from elastic_oracle import check_against_single

from ringcomm.engine.strategy import TrainConfig

BASE: dict[str, Any] = {
    "steps": 6,
    "dtype": "float64",
    "in_features": 12,
    "hidden": 16,
    "depth": 2,
    "classes": 4,
    "batch_size": 24,
    "bucket_bytes": 1500,
    "export": True,
    "timeout_s": 90.0,
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world", "slot", "step"), [(4, 2, 3), (3, 0, 1)])
def test_survivors_go_on_with_the_whole_global_batch(world: int, slot: int, step: int) -> None:
    cfg = TrainConfig(
        strategy="dp", world_size=world, elastic=True, fail_at=((slot, step),), **BASE
    )
    out = check_against_single(cfg)
    assert [(c["step"], c["event"], c["slots"]) for c in out["membership"]] == [
        (step, "shrink", [s for s in range(world) if s != slot])
    ]
    assert out["lost_slots"] == [slot]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("bucket", [0, 2, 3])  # of 4 buckets: the first, one, the last
def test_a_rank_killed_mid_step_leaves_no_half_applied_step(bucket: int) -> None:
    # Slot 1 dies once its bucket-th gradient all-reduce of step 3 is done everywhere:
    # the survivors hold partly reduced gradients (or, after the last bucket, may have
    # applied the update); each undoes what it did, and they agree on the step to redo.
    world, slot, step = 4, 1, 3
    cfg = TrainConfig(
        strategy="dp", world_size=world, elastic=True, fail_at=((slot, step, bucket),), **BASE
    )
    out = check_against_single(cfg)
    assert len(out["membership"]) == 1 and out["lost_slots"] == [slot], out["membership"]
    change = out["membership"][0]
    assert change["event"] == "shrink" and change["slots"] == [0, 2, 3]
    assert change["step"] in (step, step + 1), change  # + 1: the last bucket completed it


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world", "slot", "step"), [(4, 0, 2), (4, 3, 4)])
def test_a_restarted_rank_rejoins_and_the_batch_is_split_over_all_again(
    world: int, slot: int, step: int
) -> None:
    cfg = TrainConfig(
        strategy="dp",
        world_size=world,
        elastic=True,
        max_restarts=1,
        fail_at=((slot, step),),
        **BASE,
    )
    out = check_against_single(cfg)
    others = [s for s in range(world) if s != slot]
    assert [(c["step"], c["event"], c["slots"]) for c in out["membership"]] == [
        (step, "shrink", others),
        (step, "grow", list(range(world))),
    ]
    assert out["lost_slots"] == [] and out["final_slots"] == list(range(world))
    rows = {r["rank"]: r for r in out["per_rank"]}
    assert rows[slot]["rejoined"] and not any(rows[s]["rejoined"] for s in others)


@pytest.mark.parametrize(
    "extra",
    [
        ["--strategy", "zero1", "--elastic"],
        ["--strategy", "dp", "--fail-at", "1:2"],
        ["--strategy", "dp", "--elastic", "--fail-at", "0:1,1:1"],
        ["--strategy", "dp", "--elastic", "--fail-at", "1:99"],
        ["--strategy", "dp", "--elastic", "--fail-at", "one"],
        ["--strategy", "dp", "--elastic", "--fail-at", "1:2:x"],
        ["--strategy", "dp", "--elastic", "--fail-at", "1:2:0:4"],
    ],
)
def test_bad_elastic_options_exit_2(extra: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ringcomm", "train", "-n", "2", "--steps", "3", *extra],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "error:" in out.stderr


def _agree_body(pg: Any) -> dict[str, Any]:
    # Rank 0 completed step 4 (its update applied) before it saw the failure; ranks 1, 2
    # did not: all take step 4 again, rank 0 from the snapshot before it.
    from ringcomm.engine.dp import DataParallel
    from ringcomm.engine.elastic import agree_step, snapshot

    strat = DataParallel(pg, TrainConfig(strategy="dp", world_size=3, **BASE))
    before = snapshot(strat)
    if pg.rank == 0:
        strat.params += 1.0  # "step 4 applied"
        strat.opt.t += 1
    got = agree_step(pg, strat, 5 if pg.rank == 0 else 4, before)
    return {
        "step": got,
        "same": bool((strat.params == before[0][0]).all()),
        "t": strat.opt.t,
        "t0": before[1],
    }


@pytest.mark.timeout(120)
def test_survivors_a_step_apart_agree_on_the_earlier_step() -> None:
    import ringcomm as rc

    out = rc.spawn(_agree_body, 3)
    assert [o["step"] for o in out] == [4, 4, 4]
    assert all(o["same"] and o["t"] == o["t0"] for o in out), out
