"""The oracle of the elastic training tests: an elastic run's losses and final parameters
against ``single``'s for the same global batches (float64, 1e-10)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ringcomm.cli.train import run_training
from ringcomm.engine.elastic import summarize_elastic
from ringcomm.engine.strategy import TrainConfig

__all__ = ["check_against_single"]


def check_against_single(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg`` (elastic, ``export``) and ``single`` with its model, data and optimizer;
    assert that every step's loss and every surviving rank's final parameters agree (ps:
    every worker's replica; servers hold no replica). Returns the run's JSON object."""
    per_rank = run_training(cfg)
    out = summarize_elastic(cfg, per_rank)
    ref = run_training(
        dataclasses.replace(
            cfg, strategy="single", world_size=1, elastic=False, max_restarts=0, fail_at=()
        )
    )[0]
    got, want = np.array(out["losses"], float), np.array(ref["losses"])
    assert np.max(np.abs(got - want) / np.abs(want)) <= 1e-10, (got, want)
    servers = cfg.ps_servers if cfg.strategy == "ps" else 0
    holders = [r for r in per_rank if r is not None and r["slot"] >= servers]
    assert holders
    for r in holders:
        for name, value in ref["params"].items():
            np.testing.assert_allclose(r["params"][name], value, rtol=0, atol=1e-10, err_msg=name)
    return out
