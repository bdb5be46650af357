"""All-gather as a ring (``out.shape == (n, *x.shape)``; segment ``s`` is the row ``out[s]``).

Steps ``k = 0 .. n-2`` of ``schedule.ring.all_gather_steps``: send row ``(r-k)`` right (our
own at ``k = 0``), receive row ``(r-k-1)`` from the left into ``out``; pipelined per piece,
a received piece is copied into ``out`` and sent on from there at once. Device arrays go
through the stager (``collectives.staged``): a received piece is sent on as its frame.

Invariants: ``x`` is never written (sent from a private copy if it overlaps a row of
``out`` other than ``out[r]``); our own row is copied into ``out[r]`` only once the first
piece from the left showed that its call matches ours (a mismatch leaves ``out``
untouched); every other region of ``out`` is written exactly once, before it is sent;
``settle()`` waits for libzmq to release the sent pieces. Steps and copies per byte:
docs/architecture.md, section "collectives/all_gather_ring.py".
"""

from __future__ import annotations

import numpy as np

from ringcomm.collectives.staged import PipelinedOp, emit, make_stager
from ringcomm.collectives.stepped import RingOp, SpansOp
from ringcomm.device.staging import DeviceStager
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.schedule.ring import all_gather_steps
from ringcomm.transport.wire import Header

__all__ = ["AllGatherRing"]


class AllGatherRing(RingOp, SpansOp, PipelinedOp):
    name = "all_gather"
    algo = "ring"
    step_name = "all-gather"

    def start(self) -> None:
        x, out = self.call.x, self.call.out
        assert x is not None and out is not None
        n, r = self.n, self.rank
        self.result = out
        self.stager = st = make_stager(self)
        out_rows = out.reshape(n, -1)
        own = out_rows[r]
        self.own_row = own
        if n == 1:
            st.copy(own, x.reshape(-1))
            self.post_inboxes()
            return
        src = x.reshape(-1)
        if isinstance(st, DeviceStager):
            overlaps = st.backend.may_share_memory(x, out) and not st.backend.same_memory(src, own)
        else:
            overlaps = np.may_share_memory(x, out) and not (
                src.__array_interface__["data"][0] == own.__array_interface__["data"][0]
                and src.nbytes == own.nbytes
            )  # (x exactly out[r] is the in-place form: nothing is received into it)
        if overlaps:
            # x overlaps rows we receive into: send from a private copy instead.
            if isinstance(st, DeviceStager):
                src = st.backend.empty(x.nbytes).view(x.dtype)
                st.copy(src, x.reshape(-1))
            else:
                src = src.copy()
        self.src = src
        self.out_u8 = out_rows.view(np.uint8)  # (n, row_nbytes)
        self.data = st.bytes_of(out)
        self.row_nbytes = x.nbytes
        self.dtype_str = x.dtype.str
        self.spans = chunk_spans(x.nbytes, self.comm.chunk_bytes, x.itemsize)
        self.recv_row = [rs for _, rs in all_gather_steps(r, n, self.comm.ring_order)]
        self.join_ring(n - 1)
        # Step 0 goes out from x itself; out[r] is filled once the left neighbour's first
        # piece proved its call matches ours (out stays untouched on a mismatch).
        self.stage_message(self.right, 0, st.bytes_of(src), self.spans, 0, self.dtype_str)
        self.post_inboxes()

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        k, j = header.step, header.piece
        spans = self.spans
        off, length = self.ring_piece(peer, header, payload, spans)
        row = self.recv_row[k]
        st = self.stager
        if not self.touched:
            self.touched = True
            st.copy(self.own_row, self.src)
        target = self.out_u8[row, off : off + length]
        st.copy_in(target, payload)
        if k < self.n - 2:
            base = row * self.row_nbytes
            st.forward(
                self.data[base + off : base + off + length],
                payload,
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
        st.pump(0 if j + 1 == len(spans) else 1)
