"""Every strategy reproduces `single`: losses after each step and final parameters.

One spawned job per world size (1, 2, 3, 4) runs every case on a fresh sub-group of all
ranks, so the whole matrix costs four launches. Tolerances:

* float64: losses to 1e-10 relative, parameters to 1e-10 absolute (they are O(0.1-1)).
  The runs are not bit-identical: each rank's matrix products cover only its rows, and the
  ring adds the ranks' partial gradients in its own order, so gradients differ from the
  full-batch ones by a few ulps (~1e-16 relative); Adam then normalises elementwise, which
  keeps a relative error relative. Seen: ~1e-16 on losses, ~1e-17 on parameters.
* float32: losses to 1e-5 relative, parameters to 1e-5 absolute (ulp 6e-8; five Adam steps
  of lr 1e-3 can turn a rounding-level difference of a near-zero gradient into at most a
  few lr-sized steps' difference on that element; seen 2e-7).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import compare_to_single

import ringcomm as rc
from ringcomm.cli.train import run_training
from ringcomm.engine.strategy import TrainConfig
from ringcomm.engine.train import train_rank

BASE = {
    "steps": 5,
    "dtype": "float64",
    "in_features": 16,
    "hidden": 24,
    "depth": 2,
    "classes": 5,
    "batch_size": 26,  # uneven over 3 and 4 ranks and over 4 micro-batches
    "bucket_bytes": 2000,  # several buckets (each Linear its own), to exercise bucketing
    "export": True,
    "timeout_s": 60.0,
}
TOL = {"float64": 1e-10, "float32": 1e-5}


def _cases(n: int) -> list[TrainConfig]:
    cases = []
    for strategy in ("dp", "zero1", "zero2", "zero3"):
        cases.append(TrainConfig(strategy=strategy, world_size=n, **BASE))
    if n in (2, 3):
        for strategy in ("dp", "zero3"):
            cases.append(
                TrainConfig(
                    strategy=strategy, world_size=n, **{**BASE, "optimizer": "sgd", "lr": 0.05}
                )
            )
            cases.append(
                TrainConfig(strategy=strategy, world_size=n, **{**BASE, "dtype": "float32"})
            )
        cases.append(
            TrainConfig(strategy="zero2", world_size=n, **{**BASE, "bucket_bytes": 1 << 20})
        )
    for m in (1, 4):
        for schedule in ("gpipe", "1f1b"):
            cases.append(
                TrainConfig(
                    strategy="pipeline", world_size=n, micro_batches=m, schedule=schedule, **BASE
                )
            )
    if n == 2:
        cases.append(
            TrainConfig(
                strategy="pipeline", world_size=n, micro_batches=4, **{**BASE, "dtype": "float32"}
            )
        )
    return cases


def oracle_job(pg: Any, cases: list[TrainConfig]) -> list[dict[str, Any]]:
    """Run every case on a fresh sub-group (own tag space); return losses and parameters."""
    out = []
    for cfg in cases:
        sub = pg.new_group(range(pg.world_size))
        try:
            r = train_rank(sub, cfg)
        finally:
            sub.close()
        out.append({"losses": r["losses"], "params": r["params"], "loss_rank": r["loss_rank"]})
    return out


_SINGLE: dict[tuple, dict[str, Any]] = {}


def _single(cfg: TrainConfig) -> dict[str, Any]:
    key = (cfg.dtype, cfg.optimizer, cfg.lr)
    if key not in _SINGLE:
        ref = TrainConfig(
            strategy="single",
            world_size=1,
            **{**BASE, "dtype": cfg.dtype, "optimizer": cfg.optimizer, "lr": cfg.lr},
        )
        _SINGLE[key] = run_training(ref)[0]
    return _SINGLE[key]


def _label(cfg: TrainConfig) -> str:
    s = f"{cfg.strategy}-n{cfg.world_size}-{cfg.dtype}-{cfg.optimizer}"
    if cfg.strategy == "pipeline":
        s += f"-{cfg.schedule}-m{cfg.micro_batches}"
    return s


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_strategy_matches_single(n: int, no_child_processes: None) -> None:
    cases = _cases(n)
    per_rank = rc.spawn(oracle_job, n, args=(cases,), timeout_s=200)
    failures = []
    worst: dict[str, float] = {}
    for k, cfg in enumerate(cases):
        ref = _single(cfg)
        tol = TOL[cfg.dtype]
        results = [per_rank[r][k] for r in range(n)]
        err = compare_to_single(failures, _label(cfg), results, ref, cfg.steps, tol)
        if err is not None:
            worst[cfg.dtype] = max(worst.get(cfg.dtype, 0.0), err)
    print(f"n={n}: worst relative loss / absolute parameter error per dtype: {worst}")
    assert not failures, "\n".join(failures)


def test_oracle_parameters_move() -> None:
    """The comparison is not vacuous: five steps change the parameters well above TOL."""
    start = run_training(TrainConfig(strategy="single", **{**BASE, "steps": 0}))[0]["params"]
    end = _single(TrainConfig(**BASE))["params"]
    assert max(float(np.max(np.abs(end[k] - start[k]))) for k in start) > 1e-3
