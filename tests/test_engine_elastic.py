"""Elastic data parallel (``ringcomm train --strategy dp --elastic``, ringcomm.engine.elastic):
a rank killed (SIGKILL, fault injection ``fail_at``) at a step; the survivors undo the step,
shrink, re-split the same global batch and go on; with ``max_restarts`` the slot comes back
and the batch is split over all again. The losses and final parameters equal ``single``'s
for the same global batches (float64, 1e-10), before, during and after the failure."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from ringcomm.engine.cli import run_training
from ringcomm.engine.elastic import summarize_elastic
from ringcomm.engine.strategy import TrainConfig

BASE: dict[str, Any] = {"steps": 6, "dtype": "float64", "in_features": 12, "hidden": 16,
                        "depth": 2, "classes": 4, "batch_size": 24, "bucket_bytes": 1500,
                        "export": True, "timeout_s": 90.0}  # fmt: skip


def _single() -> dict[str, Any]:
    return run_training(TrainConfig(strategy="single", **BASE))[0]


def _check(cfg: TrainConfig) -> dict[str, Any]:
    per_rank = run_training(cfg)
    out = summarize_elastic(cfg, per_rank)
    ref = _single()
    got, want = np.array(out["losses"], float), np.array(ref["losses"])
    assert np.max(np.abs(got - want) / np.abs(want)) <= 1e-10, (got, want)
    for r in per_rank:
        if r is None:
            continue
        for name, value in ref["params"].items():
            np.testing.assert_allclose(r["params"][name], value, rtol=0, atol=1e-10, err_msg=name)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world", "slot", "step"), [(4, 2, 3), (3, 0, 1)])
def test_survivors_go_on_with_the_whole_global_batch(world: int, slot: int, step: int) -> None:
    cfg = TrainConfig(strategy="dp", world_size=world, elastic=True, fail_at=((slot, step),), **BASE)
    out = _check(cfg)
    assert [(c["step"], c["event"], c["slots"]) for c in out["membership"]] == [
        (step, "shrink", [s for s in range(world) if s != slot])]  # fmt: skip
    assert out["lost_slots"] == [slot]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world", "slot", "step"), [(4, 0, 2), (4, 3, 4)])
def test_a_restarted_rank_rejoins_and_the_batch_is_split_over_all_again(
    world: int, slot: int, step: int
) -> None:
    cfg = TrainConfig(strategy="dp", world_size=world, elastic=True, max_restarts=1,
                      fail_at=((slot, step),), **BASE)  # fmt: skip
    out = _check(cfg)
    others = [s for s in range(world) if s != slot]
    assert [(c["step"], c["event"], c["slots"]) for c in out["membership"]] == [
        (step, "shrink", others), (step, "grow", list(range(world)))]  # fmt: skip
    assert out["lost_slots"] == [] and out["final_slots"] == list(range(world))
    rows = {r["rank"]: r for r in out["per_rank"]}
    assert rows[slot]["rejoined"] and not any(rows[s]["rejoined"] for s in others)


@pytest.mark.parametrize("extra", [
    ["--strategy", "zero1", "--elastic"],
    ["--strategy", "dp", "--fail-at", "1:2"],
    ["--strategy", "dp", "--elastic", "--fail-at", "0:1,1:1"],
    ["--strategy", "dp", "--elastic", "--fail-at", "1:99"],
    ["--strategy", "dp", "--elastic", "--fail-at", "one"],
])  # fmt: skip
def test_bad_elastic_options_exit_2(extra: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "ringcomm", "train", "-n", "2", "--steps", "3",
                          *extra], check=False, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "error:" in out.stderr
