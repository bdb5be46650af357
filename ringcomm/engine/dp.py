"""``dp``: data parallel with bucketed gradient all-reduce overlapped with backward.

Each rank runs the whole model on its rows of the global batch. Gradients live in one flat
buffer cut into buckets of about ``bucket_bytes`` (:func:`bucket_groups`, last layers
first); as soon as backward has passed a bucket's first layer, the bucket's gradients are
complete and its all-reduce (sum) starts with ``async_op=True`` while backward goes on with
the layers below. The loss is divided by the *global* batch size on every rank, so the sum
of the ranks' gradients is the full-batch gradient. Every rank then takes the same
optimizer step on the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.engine.optim import make_optimizer
from ringcomm.engine.params import export_params, init_layer, layer_views, param_shapes
from ringcomm.engine.strategy import Strategy, TrainConfig, state_bytes
from ringcomm.schedule.partition import bucket_groups, flat_layout, split_rows

__all__ = ["DataParallel", "layer_nbytes"]


def layer_nbytes(layers: Any, itemsize: int) -> list[int]:
    return [sum(int(np.prod(s)) for _, s in layer.param_shapes()) * itemsize for layer in layers]


class DataParallel(Strategy):
    name = "dp"

    def __init__(self, pg: Any, cfg: TrainConfig) -> None:
        super().__init__(pg, cfg)
        L = len(self.layers)
        buckets = bucket_groups(layer_nbytes(self.layers, self.dtype.itemsize), cfg.bucket_bytes)
        self.layout = flat_layout(param_shapes(self.layers), buckets, 1)
        # The bucket whose gradients are complete once backward has passed layer i.
        self.launch_at = {a: k for k, (a, _) in enumerate(self.layout.segment_layers)}
        xp = self.xp
        self.params = xp.zeros(self.layout.total, self.dtype)
        self.grads = self.grad_buffer(self.layout.total)
        self.pviews = [layer_views(self.layout, self.params, i) for i in range(L)]
        self.gviews = [layer_views(self.layout, self.grads, i) for i in range(L)]
        for i in range(L):
            init_layer(self.layers, i, self.pviews[i], cfg.seed)
        self.opt = make_optimizer(cfg.optimizer, xp, self.layout.total, self.dtype, cfg.lr)
        self.works: list[Any] = []
        #: Called with each bucket's all-reduce (its Work) once launched (fault injection).
        self.after_launch: Callable[[Any], None] | None = None

    def _bucket_ready(self, i: int) -> None:
        k = self.launch_at.get(i)
        if k is None:
            return
        off, size = self.layout.segments[k]
        if size and self.n > 1:
            bucket = self.as_comm(self.grads[off : off + size])
            self.works.append(self.pg.all_reduce(bucket, async_op=True))
            if self.after_launch is not None:
                self.after_launch(self.works[-1])

    def step(self, step: int) -> float:
        self.grads[...] = 0
        loss = self.forward_backward(
            step, self.pviews.__getitem__, self.gviews.__getitem__, done=self._bucket_ready
        )
        for w in self.works:
            w.wait()
        self.works.clear()
        self.opt.step([(self.params, self.grads, 0)])
        return self.global_loss(loss)

    # -- elastic training (ringcomm.engine.elastic.ElasticStrategy) -------------------
    #: Every rank's step counts when the survivors agree on one.
    votes_step = True

    @property
    def replicas(self) -> Any:
        """Every rank holds the whole state alike."""
        return self.pg

    @property
    def opt_steps(self) -> int:
        return self.opt.t

    @opt_steps.setter
    def opt_steps(self, t: int) -> None:
        self.opt.t = t

    def launches_per_step(self) -> int:
        return len(self.layout.segments)

    def regroup(self, pg: Any, step: int = 0) -> None:
        """Go on over ``pg`` (the world group after a shrink or grow; every rank calls
        it): this rank's rows of the global batch and the gradient buffer follow the new
        group; parameters and optimizer state stay (``step``: not needed)."""
        self.pg, self.rank, self.n = pg, pg.rank, pg.world_size
        self.rows = split_rows(self.cfg.batch_size, self.n)[self.rank]
        self.symmetric_bytes = 0
        self.grads = self.grad_buffer(self.layout.total)
        self.gviews = [layer_views(self.layout, self.grads, i) for i in range(len(self.layers))]
        self.works = []

    def abandon(self) -> None:
        """A step failed: let its outstanding all-reduces end (they fail too)."""
        for w in self.works:
            try:
                w.wait()
            except Exception:  # noqa: BLE001, S110 (they fail with the group; nothing to keep)
                pass
        self.works.clear()

    def finish(self) -> None:
        """After the last step: nothing to close."""

    def state_arrays(self) -> list[Any]:
        """What a rank that joins needs from a survivor: parameters, optimizer state."""
        return [self.params, *self.opt.state_arrays()]

    def state_nbytes(self) -> dict[str, int]:
        return state_bytes(self.params, self.grads, self.opt)

    def export_params(self) -> dict[str, np.ndarray]:
        return export_params(self.layers, self.layout, self.params)

    def extra(self) -> dict[str, Any]:
        return {"buckets": len(self.layout.segments)}
