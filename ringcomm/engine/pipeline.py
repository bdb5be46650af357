"""``pipeline``: layers split into ``world_size`` stages, the batch into micro-batches.

Rank ``s`` is stage ``s``: it holds layers ``balance_stages(costs, N)[s]`` (contiguous,
balanced by cost) with their own flat buffers and optimizer, and each step runs its action
list from :func:`~ringcomm.schedule.pipeline.stage_orders` (``gpipe`` or ``1f1b``).
Activations go to ``s+1`` with tag ``2i``, activation gradients to ``s-1`` with tag
``2i+1``; the last stage computes the loss (summed, divided by the global batch size).

Invariants: sends are ``isend`` waited at the end of the step, so two stages sending to each
other never wait on each other; gradients accumulate over micro-batches in the flat
buffer; a micro-batch's activations are freed after its backward. What a step measures
(busy time, span, bubble, live micro-batches, activation memory): docs/architecture.md,
section "engine/pipeline.py".
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.engine.memory import device_used_bytes
from ringcomm.engine.nn import backward_layers, forward_layers
from ringcomm.engine.optim import make_optimizer
from ringcomm.engine.params import export_params, init_layer, layer_views, param_shapes
from ringcomm.engine.strategy import Strategy, TrainConfig, state_bytes
from ringcomm.schedule.partition import balance_stages, flat_layout, split_rows
from ringcomm.schedule.pipeline import BACKWARD, FORWARD, stage_orders

__all__ = ["Pipeline", "StageTraffic"]


class StageTraffic:
    """One pipeline stage's messages to its neighbours over ``group`` during a step:
    micro-batch ``i``'s activations go to the next stage with tag ``2i``, its activation
    gradients to the one before with tag ``2i+1``. Sends are ``isend`` left to finish
    (:meth:`prune` forgets those done); :meth:`finish` waits for the rest. ``as_comm``: the
    array a receive or send carries for one of the stage's arrays."""

    def __init__(
        self,
        group: Any,
        stage: int,
        xp: Any,
        dtype: Any,
        as_comm: Callable[[Any], Any] = lambda a: a,
    ) -> None:
        self.group, self.stage = group, stage
        self.xp, self.dtype, self.as_comm = xp, dtype, as_comm
        self.sends: list[Any] = []

    def input_of(self, i: int, batch: Any, r0: int, r1: int, shape: tuple[int, ...]) -> Any:
        """Micro-batch ``i``'s input: rows ``r0:r1`` of ``batch`` on the first stage, else
        the ``(r1 - r0, *shape)`` activations of the stage before."""
        if self.stage == 0:
            return batch[r0:r1]
        x = self.xp.empty((r1 - r0, *shape), self.dtype)
        self.group.recv(self.as_comm(x), src=self.stage - 1, tag=2 * i)
        return x

    def recv_gradients(self, i: int, rows: int, shape: tuple[int, ...]) -> Any:
        """The gradient of micro-batch ``i``'s ``(rows, *shape)`` output, from the next stage."""
        dy = self.xp.empty((rows, *shape), self.dtype)
        self.group.recv(self.as_comm(dy), src=self.stage + 1, tag=2 * i + 1)
        return dy

    def send_activations(self, i: int, y: Any) -> None:
        self.sends.append(self.group.isend(self.as_comm(y), dst=self.stage + 1, tag=2 * i))

    def send_gradients(self, i: int, dx: Any) -> None:
        self.sends.append(self.group.isend(self.as_comm(dx), dst=self.stage - 1, tag=2 * i + 1))

    def prune(self) -> None:
        self.sends = [w for w in self.sends if not w.done()]

    def finish(self) -> None:
        for w in self.sends:
            w.wait()
        self.sends.clear()


class Pipeline(Strategy):
    name = "pipeline"
    splits_batch = False  # every stage sees the whole global batch, in micro-batches

    def __init__(self, pg: Any, cfg: TrainConfig) -> None:
        super().__init__(pg, cfg)
        p, s = self.n, self.rank
        if cfg.micro_batches < 1 or cfg.micro_batches > cfg.batch_size:
            raise ValueError(
                f"--micro-batches must be in [1, batch size {cfg.batch_size}], got {cfg.micro_batches}"
            )
        self.stages = balance_stages([layer.cost() for layer in self.layers], p)
        a, b = self.stages[s]
        self.my_layers = list(range(a, b))
        self.first, self.last = s == 0, s == p - 1
        self.loss_rank = p - 1
        shapes = param_shapes(self.layers)
        self.layout = flat_layout(shapes[a:b], [(0, b - a)], 1)  # local layer j is global a+j
        xp = self.xp
        self.params = xp.zeros(self.layout.total, self.dtype)
        self.grads = xp.zeros(self.layout.total, self.dtype)
        self.pviews = {a + j: layer_views(self.layout, self.params, j) for j in range(b - a)}
        self.gviews = {a + j: layer_views(self.layout, self.grads, j) for j in range(b - a)}
        for i in self.my_layers:
            init_layer(self.layers, i, self.pviews[i], cfg.seed)
        self.opt = make_optimizer(cfg.optimizer, xp, self.layout.total, self.dtype, cfg.lr)
        self.order = stage_orders(p, cfg.micro_batches, cfg.schedule)[s]
        self.micro = split_rows(cfg.batch_size, cfg.micro_batches)
        # Per-sample shapes of what this stage receives and sends (a >= 1 when it receives).
        self.in_shape = cfg.activation_shape(self.layers, a - 1) if a > 0 else ()
        self.out_shape = cfg.activation_shape(self.layers, b - 1)
        self.busy_s: list[float] = []
        self.span_s: list[float] = []
        self.max_live = 0
        self.act_peak_bytes: list[int] = []
        #: GPU: a probe of the device bytes in use (the activation peak is sampled).
        self.used_bytes = device_used_bytes(xp)

    def step(self, step: int) -> float | None:
        pg = self.pg
        x_all, labels_all = self.local_batch(step)
        self.grads[...] = 0
        caches: dict[int, Any] = {}
        traffic = StageTraffic(pg, self.rank, self.xp, self.dtype, self.as_comm)
        total_loss = 0.0
        busy = 0.0
        tracing = tracemalloc.is_tracing()
        if tracing:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
        elif self.used_bytes is not None:  # GPU: live bytes sampled after every action
            base = live_peak = self.used_bytes()
        if pg is not None and self.n > 1:
            pg.barrier()
        t_start = time.perf_counter()
        for act in self.order:
            i = act.micro
            r0, r1 = self.micro[i]
            if act.kind == FORWARD:
                x = traffic.input_of(i, x_all, r0, r1, self.in_shape)
                self.sync()
                t0 = time.perf_counter()
                y, layer_caches = forward_layers(
                    self.layers, self.my_layers, x, self.pviews.__getitem__
                )
                loss_cache = None
                if self.last:
                    loss, loss_cache = self.loss.forward(y, labels_all[r0:r1])
                    total_loss += float(loss)
                self.sync()
                busy += time.perf_counter() - t0
                if not self.last:
                    traffic.send_activations(i, y)
                caches[i] = (layer_caches, loss_cache)
                self.max_live = max(self.max_live, len(caches))
            else:
                assert act.kind == BACKWARD
                layer_caches, loss_cache = caches.pop(i)
                if self.last:
                    self.sync()
                    t0 = time.perf_counter()
                    dy = self.loss.backward(loss_cache)
                else:
                    dy = traffic.recv_gradients(i, r1 - r0, self.out_shape)
                    self.sync()
                    t0 = time.perf_counter()
                dx = backward_layers(
                    self.layers,
                    self.my_layers,
                    layer_caches,
                    dy,
                    self.pviews.__getitem__,
                    self.gviews.__getitem__,
                )
                self.sync()
                busy += time.perf_counter() - t0
                del layer_caches, loss_cache, dy
                if not self.first:
                    traffic.send_gradients(i, dx)
                del dx
            traffic.prune()
            if not tracing and self.used_bytes is not None:
                live_peak = max(live_peak, self.used_bytes())
        traffic.finish()
        self.span_s.append(time.perf_counter() - t_start)
        self.busy_s.append(busy)
        if tracing:
            self.act_peak_bytes.append(tracemalloc.get_traced_memory()[1] - base)
        elif self.used_bytes is not None:
            self.act_peak_bytes.append(live_peak - base)
        self.opt.step([(self.params, self.grads, 0)])
        return total_loss if self.last else None

    def state_nbytes(self) -> dict[str, int]:
        return state_bytes(self.params, self.grads, self.opt)

    def export_params(self) -> dict[str, np.ndarray]:
        """This stage's layers only (keys carry global layer indices)."""
        a = self.my_layers[0]
        local = export_params(
            self.layers[a:], self.layout, self.params, only=range(len(self.my_layers))
        )
        out = {}
        for key, v in local.items():
            j, name = key.split(".", 1)
            out[f"{int(j) + a}.{name}"] = v
        return out

    def extra(self) -> dict[str, Any]:
        return {
            "stage_layers": list(self.stages[self.rank]),
            "schedule": self.cfg.schedule,
            "micro_batches": self.cfg.micro_batches,
            "busy_s": self.busy_s,
            "span_s": self.span_s,
            "max_live_micro_batches": self.max_live,
            "activation_peak_bytes": self.act_peak_bytes,
        }
