"""Reduce to ``dst`` up a binomial tree (``schedule.tree``, rooted at ``dst``).

Each rank combines its children's contributions in increasing-subtree order, ``local (op)
incoming``, then sends the result to its parent; pipelined per piece (piece ``j`` goes up
once every child's piece ``j`` is in; an early piece waits as its frame). ``dst`` reduces
in place into ``x`` and finalizes AVG; an inner rank combines into a scratch buffer.

Invariants: one fixed bracketing of the inputs in the order of ranks relative to ``dst``,
the same bits on every run; no rank but ``dst`` writes its ``x``; a region is sent only
after its last write and never written again (zero-copy safe). Buffers and copies per
byte: docs/architecture.md, section "collectives/reduce_tree.py".
"""

from __future__ import annotations

import numpy as np

from ringcomm.collectives.base import CollectiveOp, byte_view
from ringcomm.ops import finalize, reduce_into, reduce_out
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.schedule.tree import binomial_children, binomial_parent
from ringcomm.transport.wire import Header

__all__ = ["ReduceTree"]


class ReduceTree(CollectiveOp):
    name = "reduce"
    algo = "tree"

    def start_peers(self, rank: int) -> tuple[int, ...]:
        # A leaf sends its x to its parent at once; inner ranks wait for their children.
        root = self.call.root
        assert root is not None  # checked at the boundary: reduce always has a root
        parent = binomial_parent(rank, self.n, root)
        leaf = not binomial_children(rank, self.n, root)
        return (parent,) if parent is not None and leaf else ()

    def start(self) -> None:
        x, op, root = self.call.x, self.call.op, self.call.root
        assert x is not None and op is not None and root is not None
        self.result = x
        if self.n == 1:
            finalize(op, x, 1)
            self.post_inboxes()
            return
        self.x_flat = x.reshape(-1)
        self.dtype = x.dtype
        self.dtype_str = x.dtype.str
        self.itemsize = x.itemsize
        self.spans = chunk_spans(x.nbytes, self.comm.chunk_bytes, x.itemsize)
        self.parent = binomial_parent(self.rank, self.n, root)
        self.order = list(reversed(binomial_children(self.rank, self.n, root)))
        self.child_index = {c: i for i, c in enumerate(self.order)}
        if self.parent is None or not self.order:
            self.acc = self.x_flat  # dst: in place; leaf: sends x as it is
        else:
            self.acc = np.empty_like(self.x_flat)
        self.acc_data = byte_view(self.acc)
        self.next_child = [0] * len(self.spans)  # per piece: how many children are in
        self.early: dict[tuple[int, int], memoryview] = {}
        for child in self.order:
            self.expect(child, 1)
        if self.parent is not None:
            self.will_send(self.parent, 1)
            if not self.order:
                self.send_message(self.parent, 0, self.acc_data, self.spans, 0, self.dtype_str)
        self.post_inboxes()

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        j = header.piece
        spans = self.spans
        self.piece_span(peer, header, payload, spans)
        self.early[(self.child_index[peer], j)] = payload
        self._advance(j)

    def _advance(self, j: int) -> None:
        op = self.call.op
        assert op is not None
        off, length = self.spans[j]
        a = off // self.itemsize
        b = a + length // self.itemsize
        while self.next_child[j] < len(self.order):
            c = self.next_child[j]
            frame = self.early.pop((c, j), None)
            if frame is None:
                return
            incoming = np.frombuffer(frame, self.dtype)
            self.touched = True
            if c == 0 and self.acc is not self.x_flat:
                reduce_out(op, self.x_flat[a:b], incoming, self.acc[a:b])
            else:
                reduce_into(op, self.acc[a:b], incoming)
            self.next_child[j] = c + 1
        if self.parent is None:
            finalize(op, self.acc[a:b], self.n)
        else:
            self.send_piece(
                self.parent,
                0,
                j,
                len(self.spans),
                len(self.acc_data),
                off,
                self.acc_data[off : off + length],
                self.dtype_str,
            )
