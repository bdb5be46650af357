"""Broadcast along a pipelined chain, for large messages.

The chain is ``root, root+1, ..., root-1`` (``schedule.tree.chain_neighbors``). The root
sends all its pieces to the next rank at once; every other rank copies each piece into
``x`` as it arrives and sends it on from there at once, so all links carry pieces at the
same time and the time is about ``nbytes / bandwidth + (n-1) * piece latency``.

Copies per byte: send zero-copy from ``x`` (1 kernel copy), receive (1 kernel copy), one
copy frame -> ``x``. Device arrays: through the stager (``collectives.staged``); a
non-root rank sends each piece on as received (its frame). Zero-copy safety: a region of ``x`` is written once (non-root) before
it is sent and never afterwards; the root never writes ``x``.
"""

from __future__ import annotations

import numpy as np

from ringcomm.collectives.staged import PipelinedOp, emit, make_stager
from ringcomm.collectives.stepped import SpansOp
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.schedule.tree import chain_neighbors
from ringcomm.transport.wire import Header

__all__ = ["BroadcastChain"]


class BroadcastChain(SpansOp, PipelinedOp):
    name = "broadcast"
    algo = "chain"

    def start_peers(self, rank: int) -> tuple[int, ...]:
        if rank != self.call.root:
            return ()
        nxt = chain_neighbors(rank, self.n, rank, self.comm.ring_order)[1]
        return () if nxt is None else (nxt,)

    def step_text(self, step: int) -> str:
        return f"chain from rank {self.call.root}"

    def start(self) -> None:
        x, root = self.call.x, self.call.root
        assert x is not None and root is not None
        self.result = x
        self.stager = st = make_stager(self)
        if self.n == 1:
            self.post_inboxes()
            return
        self.u8 = x.reshape(-1).view(np.uint8)
        self.data = st.bytes_of(self.u8)
        self.dtype_str = x.dtype.str
        self.spans = chunk_spans(x.nbytes, self.comm.chunk_bytes, x.itemsize)
        self.prev, self.next = chain_neighbors(self.rank, self.n, root, self.comm.ring_order)
        if self.next is not None:
            self.will_send(self.next, 1)
        if self.prev is None:
            assert self.next is not None
            self.stage_message(self.next, 0, self.data, self.spans, 0, self.dtype_str)
        else:
            self.expect(self.prev, 1)
        self.post_inboxes()

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        j = header.piece
        spans = self.spans
        off, length = self.piece_span(peer, header, payload, spans)
        self.touched = True
        st = self.stager
        target = self.u8[off : off + length]
        st.copy_in(target, payload)
        if self.next is not None:
            st.forward(
                self.data[off : off + length],
                payload,
                emit,
                self,
                self.next,
                0,
                j,
                len(spans),
                self.u8.nbytes,
                off,
                self.dtype_str,
            )
        st.pump(0 if j + 1 == len(spans) else 1)
