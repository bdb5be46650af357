"""``tp`` and ``3d``: the transformer over a ``dp x pp x tp`` mesh (:mod:`.mesh`).

``tp`` (Megatron-LM tensor parallelism, the ``1 x 1 x T`` mesh): every rank holds its slice
of every layer and runs the whole global batch. ``3d`` (``--dp D --pp P --tp T``): the
blocks are split into ``P`` contiguous stages run by the pipeline schedule
(:func:`~ringcomm.schedule.pipeline.stage_orders`), each stage tensor-parallel, the global
batch split by rows over the ``D`` replicas; dp gradients are summed by async all_reduces
overlapping the backward (or, with ``--zero 1|2``, a reduce_scatter, a sharded optimizer
step and an all_gather).

Invariant: the loss is divided by the global number of tokens everywhere, so the sum over
dp of the replicas' gradients is the full-batch gradient and the run reproduces
``single``. :meth:`Parallel3D.extra` reports the mesh coordinates and each axis's bytes.
Details: docs/architecture.md, section "engine/parallel.py".
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np

from ringcomm.engine.mesh import DeviceMesh
from ringcomm.engine.nn import backward_layers, forward_layers
from ringcomm.engine.optim import make_optimizer
from ringcomm.engine.params import BufferPool, init_layer, layer_views, param_shapes, to_host
from ringcomm.engine.pipeline import StageTraffic
from ringcomm.engine.strategy import Strategy, TrainConfig, state_bytes
from ringcomm.engine.tp import TPContext, unshard
from ringcomm.engine.transformer import TPLayer
from ringcomm.schedule.partition import flat_layout, shard_pieces, split_rows
from ringcomm.schedule.pipeline import BACKWARD, FORWARD, stage_orders

__all__ = ["Parallel3D", "TensorParallel", "stage_span"]


def stage_span(blocks: int, stages: int, stage: int) -> tuple[int, int]:
    """Layer indices ``[start, stop)`` of ``stage`` in ``[embedding, blocks..., final
    norm, head]``: the blocks split into contiguous runs, the embedding with stage 0, the
    norm and head with the last."""
    a, b = split_rows(blocks, stages)[stage]
    start = 0 if stage == 0 else 1 + a
    stop = blocks + 3 if stage == stages - 1 else 1 + b
    return start, stop


class Parallel3D(Strategy):
    name = "3d"
    splits_batch = False  # rows per dp replica, set below

    def mesh_shape(self, cfg: TrainConfig) -> tuple[int, int, int]:
        return cfg.dp, cfg.pp, cfg.tp

    def __init__(self, pg: Any, cfg: TrainConfig) -> None:
        super().__init__(pg, cfg)
        if cfg.model != "transformer":
            raise ValueError(f"strategy {self.name} trains the transformer (model transformer)")
        dp, pp, tp = self.mesh_shape(cfg)
        self.mesh = DeviceMesh(pg, dp=dp, pp=pp, tp=tp, as_comm=self.as_comm)
        c = self.mesh.coords
        self.stage, self.first, self.last = c["pp"], c["pp"] == 0, c["pp"] == pp - 1
        self.tpc = TPContext.of(self.mesh.tp, cfg.sequence_parallel)
        self.full_numel = super().numel  # of the unsplit model the base class built
        self.layers = cfg.build_model(self.tpc)
        self.loss = cfg.build_loss(self.tpc)
        self.loss_rank = self.mesh.rank_of(dp=0, pp=pp - 1, tp=0)
        start, stop = stage_span(cfg.depth, pp, self.stage)
        self.span = (start, stop)
        self.my_layers = list(range(start, stop))
        # Rows of this dp replica, cut into micro-batches (relative to the replica's rows).
        self.rows = split_rows(cfg.batch_size, dp)[c["dp"]]
        m = cfg.micro_batches if pp > 1 else 1
        self.micro = split_rows(self.rows[1] - self.rows[0], m)
        self.order = stage_orders(pp, m, cfg.schedule)[self.stage]
        seq = cfg.seq_len // self.tpc.size if self.tpc.sequence_parallel else cfg.seq_len
        self.act_shape = (seq, cfg.d_model)  # what one stage sends the next, per row
        # One flat buffer for the stage; with ZeRO one segment padded to a multiple of dp.
        self.zero = cfg.zero if dp > 1 else 0
        self.layout = flat_layout(
            param_shapes(self.layers)[start:stop], [(0, stop - start)], dp if self.zero else 1
        )
        xp = self.xp
        self.params = xp.zeros(self.layout.total, self.dtype)
        self.pviews = {
            start + j: layer_views(self.layout, self.params, j) for j in range(stop - start)
        }
        for i in self.my_layers:
            init_layer(self.layers, i, self.pviews[i], cfg.seed)
        size = self.layout.shard_size if self.zero else self.layout.total
        self.opt = make_optimizer(cfg.optimizer, xp, size, self.dtype, cfg.lr)
        self.pieces = shard_pieces(self.layout, c["dp"]) if self.zero else []
        self.pool: BufferPool | None = None
        if self.zero == 2:
            self.gshard = xp.zeros(self.layout.shard_size, self.dtype)
            self.pool = BufferPool(xp, self.layout.total, self.dtype)
        else:
            self.grads = xp.zeros(self.layout.total, self.dtype)
        # Gradients all-reduced over tp under sequence parallel (replicated, per shard).
        self.sp_grads = [
            (start + j, s.name)
            for j, layer in enumerate(self.layers[start:stop])
            if isinstance(layer, TPLayer)
            for s in layer.specs()
            if s.sp_reduce
        ]
        self.steps_done = 0
        # dp without ZeRO: each layer's gradients are all-reduced (async) as soon as the
        # stage's last backward action has passed the layer, overlapping the rest of it.
        self.overlap_dp = not self.zero and self.mesh.dp.size > 1
        self.last_backward = max(
            (k for k, act in enumerate(self.order) if act.kind == BACKWARD), default=-1
        )
        self.dp_works: list[Any] = []
        #: Of the last step (the first one also sets up groups lazily): the most traced
        #: bytes held right after a forward action (the caches kept for backward) and the
        #: traced peak within the schedule, above the step's start (tracemalloc only).
        self.act_held_bytes = 0
        self.act_peak_bytes = 0

    @property
    def numel(self) -> int:
        """Parameters of the whole (unsplit) model, as ``single`` reports."""
        return self.full_numel

    # -- one step ---------------------------------------------------------------------------
    def step(self, step: int) -> float | None:
        traffic = StageTraffic(self.mesh.pp, self.stage, self.xp, self.dtype)
        ids, targets = self.local_batch(step)
        if self.pool is not None:
            grads = self.pool.acquire(self.layout.total, zero=True)
        else:
            grads = self.grads
            grads[...] = 0
        start = self.span[0]
        gviews = {start + j: layer_views(self.layout, grads, j) for j in range(len(self.my_layers))}
        caches: dict[int, Any] = {}
        total = 0.0
        tracing = tracemalloc.is_tracing()
        if tracing:  # activation memory: traced bytes above the step's start
            self.act_held_bytes = 0
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
        for k, act in enumerate(self.order):
            i = act.micro
            r0, r1 = self.micro[i]
            if act.kind == FORWARD:
                x = traffic.input_of(i, ids, r0, r1, self.act_shape)
                y, layer_caches = forward_layers(
                    self.layers, self.my_layers, x, self.pviews.__getitem__
                )
                loss_cache = None
                if self.last:
                    loss, loss_cache = self.loss.forward(y, targets[r0:r1])
                    total += float(loss)
                else:
                    traffic.send_activations(i, y)
                caches[i] = (layer_caches, loss_cache)
                del x, y, layer_caches, loss_cache
                if tracing:
                    held = tracemalloc.get_traced_memory()[0] - base
                    self.act_held_bytes = max(self.act_held_bytes, held)
            else:
                assert act.kind == BACKWARD
                layer_caches, loss_cache = caches.pop(i)
                if self.last:
                    dy = self.loss.backward(loss_cache)
                else:
                    dy = traffic.recv_gradients(i, r1 - r0, self.act_shape)
                dx = backward_layers(
                    self.layers,
                    self.my_layers,
                    layer_caches,
                    dy,
                    self.pviews.__getitem__,
                    gviews.__getitem__,
                    done=self._launch_dp(grads) if k == self.last_backward else None,
                )
                if not self.first:
                    traffic.send_gradients(i, dx)
            traffic.prune()
        traffic.finish()
        if tracing:
            peak = tracemalloc.get_traced_memory()[1] - base
            self.act_peak_bytes = peak
        for w in self.dp_works:  # the dp sums are done before tp reads the buffer
            w.wait()
        self.dp_works.clear()
        if self.tpc.sequence_parallel:
            self._reduce_sp_grads(gviews)  # (sums commute: over dp, then over tp)
        self._update(grads)
        if self.pool is not None:
            self.pool.release(grads)
        self.steps_done += 1
        if not self.last:
            return None
        buf = np.array([total], dtype=np.float64)
        self.mesh.dp.all_reduce(buf)  # the replicas' partial losses
        return float(buf[0])

    def _launch_dp(self, grads: Any) -> Any:
        """The ``done`` hook of the last backward: start layer ``i``'s dp all_reduce."""
        if not self.overlap_dp:
            return None

        def done(i: int) -> None:
            slots = self.layout.layer_slots(i - self.span[0])
            if slots:
                a, b = slots[0].offset, slots[-1].offset + slots[-1].size
                self.dp_works.append(self.mesh.dp.all_reduce(grads[a:b], async_op=True))

        return done

    def _reduce_sp_grads(self, gviews: dict[int, Any]) -> None:
        """Sum over tp the gradients each rank computed from its sequence shard only."""
        views = [gviews[i][name] for i, name in self.sp_grads]
        if not views:
            return
        packed = self.xp.concatenate([v.reshape(-1) for v in views])
        self.mesh.tp.all_reduce(packed)
        off = 0
        for v in views:
            v[...] = packed[off : off + v.size].reshape(v.shape)
            off += v.size

    def _update(self, grads: Any) -> None:
        dp = self.mesh.dp
        if not self.zero:  # the dp all_reduces ran during the last backward (waited)
            if not self.overlap_dp:
                dp.all_reduce(grads)
            self.opt.step([(self.params, grads, 0)])
            return
        # ZeRO over dp: reduce-scatter the gradients, update the owned rows, gather params.
        rows = grads.reshape(dp.size, -1)
        if self.zero == 1:
            dp.reduce_scatter(rows, out=rows[dp.rank])
            g, goff = grads, "flat_offset"
        else:
            dp.reduce_scatter(rows, out=self.gshard)
            g, goff = self.gshard, "shard_offset"
        pieces = []
        for q in self.pieces:
            o = getattr(q, goff)
            param = self.params[q.flat_offset : q.flat_offset + q.size]
            pieces.append((param, g[o : o + q.size], q.shard_offset))
        self.opt.step(pieces)
        prow = self.params.reshape(dp.size, -1)
        dp.all_gather(self.xp.ascontiguousarray(prow[dp.rank]), out=prow)

    # -- the interface ------------------------------------------------------------------------
    def state_nbytes(self) -> dict[str, int]:
        grads = self.gshard if self.zero == 2 else self.grads
        return state_bytes(self.params, grads, self.opt)

    def export_params(self) -> dict[str, np.ndarray]:
        """This stage's layers, tp slices gathered into the master arrays (collective over
        the tp group); keys carry global layer indices."""
        tp, xp = self.mesh.tp, self.xp
        out = {}
        for i in self.my_layers:
            layer = self.layers[i]
            assert isinstance(layer, TPLayer)
            for spec in layer.specs():
                view = self.pviews[i][spec.name]
                if spec.dim is None or tp.size == 1:
                    out[f"{i}.{spec.name}"] = to_host(view)
                    continue
                gathered = xp.empty((tp.size, *view.shape), self.dtype)
                tp.all_gather(xp.ascontiguousarray(view), out=gathered)
                out[f"{i}.{spec.name}"] = unshard(spec, [to_host(p) for p in gathered])
        return out

    def extra(self) -> dict[str, Any]:
        steps = max(self.steps_done, 1)
        axes = self.mesh.axes()
        out: dict[str, Any] = {
            "mesh": dict(self.mesh.coords),
            "mesh_shape": dict(self.mesh.shape),
            "stage_layers": list(self.span),
            "sequence_parallel": self.tpc.sequence_parallel,
            "activation_held_bytes": self.act_held_bytes,
            "activation_peak_bytes": self.act_peak_bytes,
            "sent_bytes_per_step_by_axis": {a: g.sent_bytes / steps for a, g in axes.items()},
            "collective_bytes_per_step_by_axis": {
                a: g.payload_bytes / steps for a, g in axes.items()
            },
            "workspace_bytes_per_step_by_axis": {
                a: g.workspace_bytes() / steps for a, g in axes.items()
            },
        }
        if self.zero:
            out["zero"] = self.zero
        if self.pool is not None:
            out["work_bytes"] = self.pool.nbytes
        return out


class TensorParallel(Parallel3D):
    """``--strategy tp``: the ``1 x 1 x N`` mesh (every rank one tp slice, whole batch)."""

    name = "tp"

    def mesh_shape(self, cfg: TrainConfig) -> tuple[int, int, int]:
        return 1, 1, cfg.world_size
