"""Broadcast down a binomial tree, for small messages (``ceil(log2 n)`` rounds).

``schedule.tree``: the root sends to its children, largest subtree first; every other rank
receives from its parent and forwards to its own children. Pieces are forwarded as they
arrive (each piece goes to every child in the same order), so a multi-piece message is
pipelined down the tree too.

Copies per byte: as the chain (one copy frame -> ``x`` per non-root rank; sends go
zero-copy when large). Zero-copy safety: a region of ``x`` is written once, before it is
sent, and never afterwards; the root never writes ``x``.
"""

from __future__ import annotations

import numpy as np

from ringcomm.collectives.base import byte_view
from ringcomm.collectives.stepped import SpansOp
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.schedule.tree import binomial_children, binomial_parent
from ringcomm.transport.wire import Header

__all__ = ["BroadcastTree"]


class BroadcastTree(SpansOp):
    name = "broadcast"
    algo = "tree"

    def start_peers(self, rank: int) -> tuple[int, ...]:
        root = self.call.root
        return tuple(binomial_children(rank, self.n, root)) if rank == root else ()

    def step_text(self, step: int) -> str:
        return f"tree from rank {self.call.root}"

    def start(self) -> None:
        x, root = self.call.x, self.call.root
        assert x is not None and root is not None
        self.result = x
        if self.n == 1:
            self.post_inboxes()
            return
        self.u8 = x.reshape(-1).view(np.uint8)
        self.data = byte_view(self.u8)
        self.dtype_str = x.dtype.str
        self.spans = chunk_spans(x.nbytes, self.comm.chunk_bytes, x.itemsize)
        self.parent = binomial_parent(self.rank, self.n, root)
        self.children = binomial_children(self.rank, self.n, root)
        for child in self.children:
            self.will_send(child, 1)
        if self.parent is None:
            for j in range(len(self.spans)):
                self._forward(j)
        else:
            self.expect(self.parent, 1)
        self.post_inboxes()

    def _forward(self, j: int) -> None:
        off, length = self.spans[j]
        piece = self.data[off : off + length]
        for child in self.children:
            self.send_piece(child, 0, j, len(self.spans), len(self.u8), off, piece, self.dtype_str)

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        off, length = self.piece_span(peer, header, payload, self.spans)
        self.touched = True
        self.u8[off : off + length] = np.frombuffer(payload, np.uint8)
        self._forward(header.piece)
