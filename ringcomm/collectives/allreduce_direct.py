"""All-reduce by direct exchange, for the smallest messages (latency: one step).

Every rank sends its whole buffer to every other rank, receives theirs, and reduces all
``n`` buffers itself in rank order, ``((x0 op x1) op x2) op ...``: the same operations on
the same bytes on every rank, so every rank ends with the same bits without an all-gather.

One step instead of recursive doubling's ``log2 n``: on a loaded host each step costs a
round of process wake-ups, so for a few bytes one step of ``n - 1`` small messages beats
``log2 n`` steps of one (measured: benchmarks/results/collectives_switch.md). It moves
``n - 1`` buffers per rank, so it only pays below a small size (``ALL_REDUCE_DIRECT_MAX_BYTES``
in the registry).

Copies per byte: one private copy of ``x`` at start (sent to every peer; we overwrite ``x``
at the end, possibly before libzmq is done reading, so we never send from ``x`` itself), the
transport's copy per peer (inline in the header below 4 KiB), one frame per peer, and the
rank-order reduction into a scratch buffer that is copied into ``x`` at the end (so a
mismatch or a failure mid-way leaves ``x`` untouched).
"""

from __future__ import annotations

import numpy as np

from ..ops import finalize, reduce_into
from ..schedule.chunks import chunk_spans
from ..transport.wire import Header
from .base import CollectiveOp, byte_view

__all__ = ["AllReduceDirect"]


class AllReduceDirect(CollectiveOp):
    name = "all_reduce"
    algo = "direct"

    def start(self) -> None:
        x, op = self.call.x, self.call.op
        assert x is not None and op is not None
        self.result = x
        n, me = self.n, self.rank
        if n == 1:
            finalize(op, x, 1)
            self.post_inboxes()
            return
        self.spans = chunk_spans(x.nbytes, self.comm.chunk_bytes, x.itemsize)
        npieces = len(self.spans)
        self.pieces: list[list[memoryview | None]] = [[None] * npieces for _ in range(n)]
        private = memoryview(bytes(byte_view(x)))  # one copy for all peers, never written
        dtype = x.dtype.str
        # Send right, then around the ring, so no rank is everyone's first destination.
        for k in range(1, n):
            peer = (me + k) % n
            self.will_send(peer, 1)
            for j, (off, length) in enumerate(self.spans):
                self.send_piece(
                    peer, 0, j, npieces, x.nbytes, off, private[off : off + length], dtype,
                    track=False,
                )
            self.expect(peer, 1)
        self.post_inboxes()

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        j = header.piece
        spans = self.spans
        self.piece_span(peer, header, payload, spans)
        self.pieces[peer][j] = payload

    def all_received(self) -> None:
        x, op = self.call.x, self.call.op
        assert x is not None and op is not None
        if self.n == 1:
            return
        flat = x.reshape(-1)
        acc = np.empty_like(flat)
        itemsize = x.itemsize
        for r in range(self.n):
            for j, (off, length) in enumerate(self.spans):
                a, b = off // itemsize, (off + length) // itemsize
                if r == self.rank:
                    src = flat[a:b]
                else:
                    piece = self.pieces[r][j]
                    assert piece is not None
                    src = np.frombuffer(piece, x.dtype)
                if r == 0:
                    acc[a:b] = src
                else:
                    reduce_into(op, acc[a:b], src)  # lower ranks' result on the left
        finalize(op, acc, self.n)
        self.touched = True
        flat[...] = acc
