"""Reduce-scatter as a ring (``x.shape[0] == n``; segment ``s`` is the row ``x[s]``).

Steps ``k = 0 .. n-2`` of ``schedule.ring.reduce_scatter_steps``: send the partial result
of row ``(r-k-1)`` right, combine row ``(r-k-2)`` from the left out of place; the last step
(row ``r``) writes ``out``. Pipelined per piece like the ring all-reduce. Device arrays go
through the stager (``collectives.staged``).

Invariants: ``x`` is never written (every combination is out of place, straight from the
received frame, so no copy of ``x`` is made); ``out`` may be ``x[r]`` (the in-place form),
any other overlap with ``x`` is refused at the call; a partial-result buffer is written
again only after :meth:`wait_released` saw libzmq release the piece sent from it. Where
the partial results live, and copies per byte: docs/architecture.md, section
"collectives/reduce_scatter_ring.py".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.collectives.staged import PipelinedOp, emit, make_stager
from ringcomm.collectives.stepped import RingOp, SpansOp
from ringcomm.device.staging import DeviceStager
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.schedule.ring import reduce_scatter_steps
from ringcomm.transport.wire import Header

__all__ = ["ReduceScatterRing"]


class ReduceScatterRing(RingOp, SpansOp, PipelinedOp):
    name = "reduce_scatter"
    algo = "ring"
    step_name = "reduce-scatter"

    def start(self) -> None:
        x, out, op = self.call.x, self.call.out, self.call.op
        assert x is not None and out is not None and op is not None
        n, r = self.n, self.rank
        self.result = out
        self.stager = st = make_stager(self)
        if n == 1:
            st.copy(out, x[0])
            st.finalize(op, out, 1)
            self.post_inboxes()
            return
        rows = x.reshape(n, -1)
        self.rows = rows
        self.row_size = rows.shape[1]
        self.itemsize = x.itemsize
        self.dtype_str = x.dtype.str
        self.row_nbytes = self.row_size * self.itemsize
        self.spans = chunk_spans(self.row_nbytes, self.comm.chunk_bytes, self.itemsize)
        steps = reduce_scatter_steps(r, n, self.comm.ring_order)
        self.recv_row = [rs for _, rs in steps]
        out_flat = out.reshape(-1)
        self.out_flat = out_flat

        # Partial results of step k < n-2 go to partial[(n-2-k) % 2]: parity 0 is `out`
        # (its last write is the final one) unless `out` is x[r], which the last step
        # still reads; parity 1 is a scratch row.
        def scratch_row() -> Any:
            if isinstance(st, DeviceStager):
                return st.backend.empty(out_flat.nbytes).view(out.dtype)
            return np.empty_like(out_flat)

        if isinstance(st, DeviceStager):
            shares = n >= 4 and st.backend.may_share_memory(out, x)
        else:
            shares = n >= 4 and bool(np.may_share_memory(out, x))
        even = scratch_row() if shares else out_flat
        odd = scratch_row() if n >= 3 else out_flat
        self.partial = [(b, st.bytes_of(b)) for b in (even, odd)]
        self.out_view = st.bytes_of(out_flat)
        self.trackers: dict[tuple[int, int], Any] = {}
        self.join_ring(n - 1)
        base = steps[0][0] * self.row_nbytes
        self.stage_message(self.right, 0, st.bytes_of(x), self.spans, base, self.dtype_str)
        self.post_inboxes()

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        k, j = header.step, header.piece
        spans = self.spans
        off, length = self.ring_piece(peer, header, payload, spans)
        op = self.call.op
        assert op is not None
        a = off // self.itemsize
        b = a + length // self.itemsize
        row = self.recv_row[k]
        last = k == self.n - 2
        buf, view = (self.out_flat, self.out_view) if last else self.partial[(self.n - 2 - k) % 2]
        # This buffer's piece j was sent at step k-1 (parity reuse): libzmq must be done.
        # (Staged: sends go from staging buffers, and the stream orders the device
        # buffer's copy before this write; no tracker is kept.)
        self.wait_released(self.trackers.pop((id(buf), j), None))
        self.touched = True
        st = self.stager
        st.reduce_out(op, self.rows[row, a:b], payload, buf[a:b])
        if last:
            st.finalize(op, buf[a:b], self.n)
        else:
            tracker = st.send(
                view[off : off + length],
                emit,
                self,
                self.right,
                k + 1,
                j,
                len(spans),
                self.row_nbytes,
                off,
                self.dtype_str,
            )
            if tracker is not None:
                self.trackers[(id(buf), j)] = tracker
        st.pump(0 if j + 1 == len(spans) else 1)
