"""All-gather of rows of different counts as a ring (``all_gather_v``).

Rank ``s`` contributes ``sizes[s]`` rows (0 included); ``out`` holds every rank's rows in
rank order, ``out.shape == (sum(sizes), *x.shape[1:])``, segment ``s`` where
``schedule.partition.split_offsets`` puts it. The ring of :mod:`all_gather_ring` over
those segments, each cut into ``chunk_bytes`` pieces of its own.

Invariants: an empty segment still travels as one empty piece (every step has a message,
so every inbox knows what to expect); the fingerprint carries every rank's size
(``Call.shape == (*sizes, *x.shape[1:])``), so ranks that disagree on the sizes or the row
shape raise ``CollectiveMismatchError`` before anything is written; ``x`` is never written
(sent from a private copy if it overlaps a segment we receive into); every other region
of ``out`` is written once, before it is sent on. Steps: docs/architecture.md, section
"collectives/all_gather_v_ring.py".
"""

from __future__ import annotations

import numpy as np

from ringcomm.collectives.base import byte_view
from ringcomm.collectives.stepped import UnevenRingOp
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.schedule.partition import split_offsets
from ringcomm.schedule.ring import all_gather_steps
from ringcomm.transport.wire import Header

__all__ = ["AllGatherVRing"]


class AllGatherVRing(UnevenRingOp):
    name = "all_gather_v"
    algo = "ring"
    step_name = "all-gather-v"

    def start(self) -> None:
        x, out, shape = self.call.x, self.call.out, self.call.shape
        assert x is not None and out is not None and shape is not None
        n, r = self.n, self.rank
        self.result = out
        sizes = shape[:n]
        row_nbytes = x.itemsize * int(np.prod(shape[n:], dtype=np.int64))
        offsets = split_offsets(sizes)
        self.seg_base = [o * row_nbytes for o in offsets]  # byte offset of segment s
        self.seg_nbytes = [s * row_nbytes for s in sizes]
        self.out_u8 = out.reshape(-1).view(np.uint8)
        self.data = byte_view(out)
        self.own = self.out_u8[self.seg_base[r] : self.seg_base[r] + self.seg_nbytes[r]]
        src = x.reshape(-1).view(np.uint8)
        if n == 1:
            self.own[...] = src
            self.post_inboxes()
            return
        src_at = src.__array_interface__["data"][0]
        if np.may_share_memory(x, out) and src_at != self.own.__array_interface__["data"][0]:
            src = src.copy()  # x overlaps segments we receive into: send from a private copy
        self.src = src
        chunk = self.comm.chunk_bytes
        self.seg_spans = [chunk_spans(b, chunk, x.itemsize) for b in self.seg_nbytes]
        self.dtype_str = x.dtype.str
        self.recv_seg = [rs for _, rs in all_gather_steps(r, n, self.comm.ring_order)]
        self.join_ring(n - 1)
        # Step 0 goes out from x itself; our segment of out is filled once the left
        # neighbour's first piece proved its call matches ours.
        self.send_message(self.right, 0, byte_view(src), self.seg_spans[r], 0, self.dtype_str)
        self.post_inboxes()

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        k, j = header.step, header.piece
        seg, off, length = self.uneven_piece(peer, header, payload)
        spans = self.seg_spans[seg]
        if not self.touched:
            self.touched = True
            self.own[...] = self.src
        at = self.seg_base[seg] + off
        if length:
            self.out_u8[at : at + length] = np.frombuffer(payload, np.uint8)
        if k < self.n - 2:  # send it on, zero-copy from out
            self.send_piece(
                self.right,
                k + 1,
                j,
                len(spans),
                self.seg_nbytes[seg],
                off,
                self.data[at : at + length],
                self.dtype_str,
            )
