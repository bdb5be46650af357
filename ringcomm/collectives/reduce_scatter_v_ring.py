"""Reduce-scatter into rows of different counts as a ring (``reduce_scatter_v``).

Every rank passes ``x`` of ``sum(splits)`` rows and the same ``splits``; rank ``r`` gets the
reduction of rows ``offsets[r] : offsets[r] + splits[r]`` (``splits[r]`` may be 0). The ring
of :mod:`reduce_scatter_ring` over those segments, pipelined per piece; partial results
alternate between two scratch buffers of the largest segment (by step parity).

Invariants: ``x`` is never written (``out`` may not overlap it, checked at the call); a
scratch buffer is written again only after :meth:`wait_released` saw the piece sent from
that region released (every segment is cut alike, so piece ``j`` covers the same bytes);
the fingerprint carries ``splits`` (``Call.shape == (*splits, *x.shape[1:])``), so ranks
that disagree raise ``CollectiveMismatchError`` before anything is reduced. Steps:
docs/architecture.md, section "collectives/reduce_scatter_v_ring.py".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.collectives.base import byte_view
from ringcomm.collectives.stepped import UnevenRingOp
from ringcomm.ops import finalize, reduce_out
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.schedule.partition import split_offsets
from ringcomm.schedule.ring import reduce_scatter_steps
from ringcomm.transport.wire import Header

__all__ = ["ReduceScatterVRing"]


class ReduceScatterVRing(UnevenRingOp):
    name = "reduce_scatter_v"
    algo = "ring"
    step_name = "reduce-scatter-v"

    def start(self) -> None:
        x, out, op, shape = self.call.x, self.call.out, self.call.op, self.call.shape
        assert x is not None and out is not None and op is not None and shape is not None
        n, r = self.n, self.rank
        self.result = out
        splits = shape[:n]
        row_size = int(np.prod(shape[n:], dtype=np.int64))
        offsets = split_offsets(splits)
        flat = x.reshape(-1)
        #: segment s of x, flat
        self.segs = [flat[offsets[s] * row_size : offsets[s + 1] * row_size] for s in range(n)]
        self.out_flat = out.reshape(-1)
        if n == 1:
            self.out_flat[...] = self.segs[0]
            finalize(op, self.out_flat, 1)
            self.post_inboxes()
            return
        self.itemsize = x.itemsize
        self.dtype_str = x.dtype.str
        self.seg_nbytes = [s * row_size * x.itemsize for s in splits]
        chunk = self.comm.chunk_bytes
        self.seg_spans = [chunk_spans(b, chunk, x.itemsize) for b in self.seg_nbytes]
        steps = reduce_scatter_steps(r, n, self.comm.ring_order)
        self.recv_seg = [rs for _, rs in steps]
        most = max(splits[s] for s in self.recv_seg[:-1]) * row_size if n > 2 else 0
        self.partial = [np.empty(most, x.dtype) for _ in range(2 if n > 3 else 1)]
        self.partial_u8 = [byte_view(b) for b in self.partial]
        self.trackers: dict[tuple[int, int], Any] = {}
        self.join_ring(n - 1)
        first = steps[0][0]
        self.send_message(
            self.right, 0, byte_view(self.segs[first]), self.seg_spans[first], 0, self.dtype_str
        )
        self.post_inboxes()

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        k, j = header.step, header.piece
        seg, off, length = self.uneven_piece(peer, header, payload)
        spans = self.seg_spans[seg]
        op = self.call.op
        assert op is not None
        a = off // self.itemsize
        b = a + length // self.itemsize
        self.touched = True
        last = k == self.n - 2
        if last:
            target = self.out_flat[a:b]
            reduce_out(op, self.segs[seg][a:b], np.frombuffer(payload, target.dtype), target)
            finalize(op, target, self.n)
            return
        parity = k % len(self.partial)
        # This region of the buffer was sent two steps ago: libzmq must be done with it.
        self.wait_released(self.trackers.pop((parity, j), None))
        target = self.partial[parity][a:b]
        reduce_out(op, self.segs[seg][a:b], np.frombuffer(payload, target.dtype), target)
        tracker = self.send_piece(
            self.right,
            k + 1,
            j,
            len(spans),
            self.seg_nbytes[seg],
            off,
            self.partial_u8[parity][off : off + length],
            self.dtype_str,
        )
        if tracker is not None:
            self.trackers[(parity, j)] = tracker
