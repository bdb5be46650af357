"""ZeRO stages 1, 2 and 3 (Rajbhandari et al., 2020) over a ProcessGroup.

All three are data parallel and partition the flat parameter space alike
(:func:`~ringcomm.schedule.partition.flat_layout`): segments padded to a multiple of ``N``
elements, viewed as ``(N, piece)`` rows; rank ``r`` owns row ``r`` of every segment
(:func:`~ringcomm.schedule.partition.shard_pieces`). ``zero1``: full parameters and
gradients, buckets reduce-scattered then parameters all-gathered; ``zero2``: no full
gradient buffer (at most two bucket buffers in flight); ``zero3``: only the parameter
shard, each layer all-gathered before its forward and backward and dropped after.

Invariant: the optimizer is elementwise, so updating the owned rows gives exactly the
single-process update of those elements. Per stage in full: docs/architecture.md, section
"engine/zero.py".
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from ringcomm.engine.dp import layer_nbytes
from ringcomm.engine.nn import backward_layers, forward_layers
from ringcomm.engine.optim import make_optimizer
from ringcomm.engine.params import BufferPool, export_params, init_layer, layer_views, param_shapes
from ringcomm.engine.strategy import Strategy, TrainConfig, state_bytes
from ringcomm.schedule.partition import bucket_groups, flat_layout, shard_pieces

__all__ = ["Zero1", "Zero2", "Zero3"]

#: Reduce-scatters of dropped gradient buffers allowed in flight (zero2, zero3).
MAX_GRAD_BUFFERS_IN_FLIGHT = 2


class _GradsInFlight:
    """Gradient reduce-scatters started and not yet waited for, oldest first: at most
    ``limit`` (None: no limit) at a time; a buffer of ``pool``'s goes back to it once its
    reduce-scatter is done."""

    def __init__(self, pool: BufferPool | None = None, limit: int | None = None) -> None:
        self.pool = pool
        self.limit = limit
        self.works: deque[tuple[Any, Any]] = deque()

    def reduce_scatter(self, pg: Any, rows: Any, out: Any, buf: Any = None) -> None:
        """Start the reduce-scatter of ``rows`` (a view of ``buf``, or of no pool's buffer:
        None) into ``out`` over ``pg``, after waiting for the oldest ones while ``limit``
        are in flight."""
        while self.limit is not None and len(self.works) >= self.limit:
            self.retire()
        self.works.append((pg.reduce_scatter(rows, out=out, async_op=True), buf))

    def retire(self) -> None:
        """Wait for the oldest one; its buffer goes back to the pool."""
        work, buf = self.works.popleft()
        work.wait()
        if buf is not None:
            assert self.pool is not None
            self.pool.release(buf)

    def drain(self) -> None:
        """Wait for all of them."""
        while self.works:
            self.retire()


class _BucketedZero(Strategy):
    """Shared by zero1 and zero2: full parameters, bucket segments, sharded optimizer."""

    def __init__(self, pg: Any, cfg: TrainConfig) -> None:
        super().__init__(pg, cfg)
        L = len(self.layers)
        buckets = bucket_groups(layer_nbytes(self.layers, self.dtype.itemsize), cfg.bucket_bytes)
        self.layout = flat_layout(param_shapes(self.layers), buckets, self.n)
        self.pieces = shard_pieces(self.layout, self.rank)
        self.launch_at = {a: k for k, (a, _) in enumerate(self.layout.segment_layers)}
        self.segment_of = [self.layout.segment_of(i) for i in range(L)]
        xp = self.xp
        self.params = xp.zeros(self.layout.total, self.dtype)
        self.pviews = [layer_views(self.layout, self.params, i) for i in range(L)]
        for i in range(L):
            init_layer(self.layers, i, self.pviews[i], cfg.seed)
        self.opt = make_optimizer(cfg.optimizer, xp, self.layout.shard_size, self.dtype, cfg.lr)
        self.in_flight = _GradsInFlight()  # zero1: rows of the full gradient buffer, no limit

    def _rows(self, buf: Any, k: int) -> Any:
        off, size = self.layout.segments[k]
        return buf[off : off + size].reshape(self.n, -1)

    def _all_gather_params(self) -> None:
        works = []
        for k, (_, size) in enumerate(self.layout.segments):
            if size:
                rows = self.as_comm(self._rows(self.params, k))
                works.append(self.pg.all_gather(rows[self.rank], out=rows, async_op=True))
        for w in works:
            w.wait()

    def _run(self, step: int, grads_of: Any, ready: Any) -> Any:
        loss = self.forward_backward(step, self.pviews.__getitem__, grads_of, done=ready)
        self.in_flight.drain()
        return loss

    def _update(self, grads: Any, sharded: bool) -> None:
        """Optimizer step on the owned rows: parameters from the full buffer, gradients from
        the full buffer (zero1) or the gradient shard (zero2)."""
        pieces = []
        for q in self.pieces:
            g = q.shard_offset if sharded else q.flat_offset
            param = self.params[q.flat_offset : q.flat_offset + q.size]
            pieces.append((param, grads[g : g + q.size], q.shard_offset))
        self.opt.step(pieces)

    def export_params(self) -> dict[str, np.ndarray]:
        return export_params(self.layers, self.layout, self.params)

    def extra(self) -> dict[str, Any]:
        return {"buckets": len(self.layout.segments)}


class Zero1(_BucketedZero):
    name = "zero1"

    def __init__(self, pg: Any, cfg: TrainConfig) -> None:
        super().__init__(pg, cfg)
        self.grads = self.grad_buffer(self.layout.total)
        self.gviews = [layer_views(self.layout, self.grads, i) for i in range(len(self.layers))]

    def _bucket_ready(self, i: int) -> None:
        k = self.launch_at.get(i)
        if k is None or not self.layout.segments[k][1]:
            return
        rows = self.as_comm(self._rows(self.grads, k))
        self.in_flight.reduce_scatter(self.pg, rows, rows[self.rank])

    def step(self, step: int) -> float:
        self.grads[...] = 0
        loss = self._run(step, self.gviews.__getitem__, self._bucket_ready)
        self._update(self.grads, sharded=False)
        self._all_gather_params()
        return self.global_loss(loss)

    def state_nbytes(self) -> dict[str, int]:
        return state_bytes(self.params, self.grads, self.opt)


class Zero2(_BucketedZero):
    name = "zero2"

    def __init__(self, pg: Any, cfg: TrainConfig) -> None:
        super().__init__(pg, cfg)
        self.gshard = self.xp.zeros(self.layout.shard_size, self.dtype)
        self.live: dict[int, Any] = {}  # segment -> its gradient buffer, during backward
        biggest = max((size for _, size in self.layout.segments), default=0)
        self.pool = BufferPool(self.xp, biggest, self.dtype)
        self.in_flight = _GradsInFlight(self.pool, MAX_GRAD_BUFFERS_IN_FLIGHT)

    def _grads_of(self, i: int) -> dict[str, Any]:
        k = self.segment_of[i]
        buf = self.live.get(k)
        if buf is None:
            buf = self.live[k] = self.pool.acquire(self.layout.segments[k][1], zero=True)
        return layer_views(self.layout, buf, i, base=self.layout.segments[k][0])

    def _bucket_ready(self, i: int) -> None:
        k = self.launch_at.get(i)
        if k is None:
            return
        buf = self.live.pop(k, None)
        if buf is None:
            return
        if not buf.size:
            self.pool.release(buf)
            return
        q = self.pieces[k]
        out = self.gshard[q.shard_offset : q.shard_offset + q.size]
        self.in_flight.reduce_scatter(
            self.pg, self.as_comm(buf.reshape(self.n, -1)), self.as_comm(out), buf
        )

    def step(self, step: int) -> float:
        loss = self._run(step, self._grads_of, self._bucket_ready)
        self._update(self.gshard, sharded=True)
        self._all_gather_params()
        return self.global_loss(loss)

    def state_nbytes(self) -> dict[str, int]:
        return state_bytes(self.params, self.gshard, self.opt)

    def extra(self) -> dict[str, Any]:
        return {"buckets": len(self.layout.segments), "work_bytes": self.pool.nbytes}


class Zero3(Strategy):
    name = "zero3"

    def __init__(self, pg: Any, cfg: TrainConfig) -> None:
        super().__init__(pg, cfg)
        L = len(self.layers)
        self.layout = flat_layout(param_shapes(self.layers), [(i, i + 1) for i in range(L)], self.n)
        self.pieces = shard_pieces(self.layout, self.rank)  # segment k is layer k
        self.with_params = [i for i in range(L) if self.layout.segments[i][1]]
        self.position = {layer: pos for pos, layer in enumerate(self.with_params)}
        xp = self.xp
        self.pshard = xp.zeros(self.layout.shard_size, self.dtype)
        self.gshard = xp.zeros(self.layout.shard_size, self.dtype)
        for i in self.with_params:  # each layer built whole, then only the own row kept
            off, size = self.layout.segments[i]
            full = xp.zeros(size, self.dtype)
            init_layer(self.layers, i, layer_views(self.layout, full, i, base=off), cfg.seed)
            self._own(self.pshard, i)[...] = full.reshape(self.n, -1)[self.rank]
            del full
        self.opt = make_optimizer(cfg.optimizer, xp, self.layout.shard_size, self.dtype, cfg.lr)
        biggest = max((size for _, size in self.layout.segments), default=0)
        self.param_pool = BufferPool(xp, biggest, self.dtype)  # gathered layers
        self.grad_pool = BufferPool(xp, biggest, self.dtype)  # layer gradients in flight
        self.gathered: dict[int, tuple[Any, Any]] = {}  # layer -> (work, full buffer)
        self.grads_in_flight = _GradsInFlight(self.grad_pool, MAX_GRAD_BUFFERS_IN_FLIGHT)
        self.peak_gathered = 0

    def _own(self, shard: Any, i: int) -> Any:
        q = self.pieces[i]
        return shard[q.shard_offset : q.shard_offset + q.size]

    def _gather(self, i: int) -> None:
        if i in self.gathered:
            return
        buf = self.param_pool.acquire(self.layout.segments[i][1])
        work = self.pg.all_gather(
            self.as_comm(self._own(self.pshard, i)),
            out=self.as_comm(buf.reshape(self.n, -1)),
            async_op=True,
        )
        self.gathered[i] = (work, buf)
        self.peak_gathered = max(self.peak_gathered, len(self.gathered))

    def _params(self, i: int, direction: int) -> dict[str, Any]:
        if i not in self.position:
            return {}
        self._gather(i)
        work, buf = self.gathered[i]
        work.wait()
        # Prefetch the next layer with parameters in this direction.
        pos = self.position[i] + direction
        if 0 <= pos < len(self.with_params):
            self._gather(self.with_params[pos])
        return layer_views(self.layout, buf, i, base=self.layout.segments[i][0])

    def _drop(self, i: int) -> None:
        entry = self.gathered.pop(i, None)
        if entry is not None:
            entry[0].wait()  # (done already, unless it was prefetched and never used)
            self.param_pool.release(entry[1])

    def _grads_of(self, i: int) -> dict[str, Any]:
        if i not in self.position:
            return {}
        off, size = self.layout.segments[i]
        self.gbuf = self.grad_pool.acquire(size, zero=True)
        return layer_views(self.layout, self.gbuf, i, base=off)

    def _backward_done(self, i: int) -> None:
        self._drop(i)
        if i not in self.position:
            return
        buf, self.gbuf = self.gbuf, None
        self.grads_in_flight.reduce_scatter(
            self.pg,
            self.as_comm(buf.reshape(self.n, -1)),
            self.as_comm(self._own(self.gshard, i)),
            buf,
        )

    def step(self, step: int) -> float:
        x, labels = self.local_batch(step)
        idx = range(len(self.layers))
        logits, caches = forward_layers(
            self.layers, idx, x, lambda i: self._params(i, +1), done=self._drop
        )
        loss, cache = self.loss.forward(logits, labels)
        backward_layers(
            self.layers,
            idx,
            caches,
            self.loss.backward(cache),
            lambda i: self._params(i, -1),
            self._grads_of,
            done=self._backward_done,
        )
        self.grads_in_flight.drain()
        assert not self.gathered, (
            f"rank {self.rank}: zero3 left gathered layers {list(self.gathered)}"
        )
        self.opt.step([(self.pshard, self.gshard, 0)])
        return self.global_loss(loss)

    def state_nbytes(self) -> dict[str, int]:
        return state_bytes(self.pshard, self.gshard, self.opt)

    def export_params(self) -> dict[str, np.ndarray]:
        """All-gathers every layer (collective: every rank must call it)."""
        full = self.xp.zeros(self.layout.total, self.dtype)
        for i in self.with_params:
            off, size = self.layout.segments[i]
            self.pg.all_gather(
                self.as_comm(self._own(self.pshard, i)),
                out=self.as_comm(full[off : off + size].reshape(self.n, -1)),
            )
        return export_params(self.layers, self.layout, full)

    def extra(self) -> dict[str, Any]:
        return {
            "max_gathered_layers": self.peak_gathered,
            "work_bytes": self.param_pool.nbytes + self.grad_pool.nbytes,
        }
