"""``single``: one process, the whole batch, the whole model: the oracle every parallel
strategy is checked against. Deliberately plain: no buckets, no shards, no communication."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.engine.optim import make_optimizer
from ringcomm.engine.params import export_params, init_layer, layer_views, param_shapes
from ringcomm.engine.strategy import Strategy, TrainConfig, state_bytes
from ringcomm.schedule.partition import flat_layout

__all__ = ["Single"]


class Single(Strategy):
    name = "single"

    def __init__(self, pg: Any, cfg: TrainConfig) -> None:
        super().__init__(pg, cfg)
        if self.n != 1:
            raise ValueError(f"strategy single runs on one rank, not {self.n}")
        L = len(self.layers)
        self.layout = flat_layout(param_shapes(self.layers), [(0, L)], 1)
        xp = self.xp
        self.params = xp.zeros(self.layout.total, self.dtype)
        self.grads = xp.zeros(self.layout.total, self.dtype)
        self.pviews = [layer_views(self.layout, self.params, i) for i in range(L)]
        self.gviews = [layer_views(self.layout, self.grads, i) for i in range(L)]
        for i in range(L):
            init_layer(self.layers, i, self.pviews[i], cfg.seed)
        self.opt = make_optimizer(cfg.optimizer, xp, self.layout.total, self.dtype, cfg.lr)

    def step(self, step: int) -> float:
        self.grads[...] = 0
        loss = self.forward_backward(step, self.pviews.__getitem__, self.gviews.__getitem__)
        self.opt.step([(self.params, self.grads, 0)])
        return float(loss)

    def state_nbytes(self) -> dict[str, int]:
        return state_bytes(self.params, self.grads, self.opt)

    def export_params(self) -> dict[str, np.ndarray]:
        return export_params(self.layers, self.layout, self.params)
