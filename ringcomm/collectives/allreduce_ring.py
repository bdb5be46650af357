"""All-reduce as a ring: reduce-scatter then all-gather, pipelined piece by piece.

The buffer is cut into ``n`` segments (``schedule.ring``; uneven and empty segments are
fine); over ``2(n-1)`` steps every rank sends right and receives left, and each step's
segment is cut into ``chunk_bytes`` pieces that move on to the next step one by one (as
NCCL does). The left neighbour's whole stream goes to one inbox. Device arrays go through
the stager (``collectives.staged``).

Invariants: only the owner of segment ``s`` (rank ``s``) computes its final value (AVG is
finalized there, before all-gather); every other rank copies those bytes, so every rank
ends with the same bits. ``x`` is never written while libzmq may still read a piece sent
from it, and ``settle()`` completes the op only once libzmq released every piece. The step
table, copies per byte and the zero-copy argument: docs/architecture.md, section
"collectives/allreduce_ring.py".
"""

from __future__ import annotations

from ringcomm.collectives.staged import PipelinedOp, emit, make_stager
from ringcomm.collectives.stepped import RingOp
from ringcomm.errors import CollectiveMismatchError
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.schedule.ring import (
    all_gather_steps,
    reduce_scatter_steps,
    segment_bounds,
)
from ringcomm.transport.wire import Header

__all__ = ["AllReduceRing"]


class AllReduceRing(RingOp, PipelinedOp):
    name = "all_reduce"
    algo = "ring"

    def step_text(self, step: int) -> str:
        steps = self.n - 1
        if step < steps:
            return f"reduce-scatter step {step + 1}/{steps}"
        return f"all-gather step {step - steps + 1}/{steps}"

    def message_pieces(self, step: int) -> int | None:
        return len(self.seg_spans[self.recv_seg[step]]) if step <= self.last_step else None

    def start(self) -> None:
        x = self.call.x
        op = self.call.op
        assert x is not None and op is not None
        n, r = self.n, self.rank
        self.result = x
        self.stager = st = make_stager(self)
        if n == 1:
            st.finalize(op, x, 1)
            self.post_inboxes()
            return
        self.flat = x.reshape(-1)
        self.data = st.bytes_of(self.flat)
        self.dtype = x.dtype
        self.dtype_str = x.dtype.str
        itemsize = x.itemsize
        bounds = segment_bounds(x.size, n)
        self.seg_first = [a for a, _ in bounds]  # first element of each segment
        self.seg_spans = [
            chunk_spans((b - a) * itemsize, self.comm.chunk_bytes, itemsize) for a, b in bounds
        ]
        self.seg_nbytes = [(b - a) * itemsize for a, b in bounds]
        self.itemsize = itemsize
        # Segment received at each global step: reduce-scatter steps, then all-gather steps.
        self.recv_seg = [rs for _, rs in reduce_scatter_steps(r, n, self.comm.ring_order)] + [
            ag for _, ag in all_gather_steps(r, n, self.comm.ring_order)
        ]
        self.last_step = 2 * (n - 1) - 1
        self.join_ring(2 * (n - 1))
        # Step 0: send our own data of segment r-1 to the right, all pieces now.
        seg = reduce_scatter_steps(r, n, self.comm.ring_order)[0][0]
        base = self.seg_first[seg] * itemsize
        self.stage_message(self.right, 0, self.data, self.seg_spans[seg], base, self.dtype_str)
        self.post_inboxes()

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        t = header.step
        j = header.piece
        if t > self.last_step:
            raise CollectiveMismatchError(f"rank {self.rank}: {self.desc}: unexpected step {t}")
        seg = self.recv_seg[t]
        spans = self.seg_spans[seg]
        off, length = self.piece_span(peer, header, payload, spans, f"segment {seg}")
        start = self.seg_first[seg] + off // self.itemsize
        stop = start + length // self.itemsize
        target = self.flat[start:stop]
        st = self.stager
        self.touched = True
        if t < self.last_step:
            # Piece j goes on as step t+1 (the same segment, the same span), from here.
            base = self.seg_first[seg] * self.itemsize
            src = self.data[base + off : base + off + length]
            args = (
                self,
                self.right,
                t + 1,
                j,
                len(spans),
                self.seg_nbytes[seg],
                off,
                self.dtype_str,
            )
        if t < self.n - 1:
            # Reduce-scatter: reduce the left neighbour's partial sum in, from its frame.
            op = self.call.op
            assert op is not None
            st.reduce_into(op, target, payload)
            if t == self.n - 2:  # our owned segment is complete: only we finalize it
                st.finalize(op, target, self.n)
            if t < self.last_step:
                st.send(src, emit, *args)
        else:
            # All-gather: the owner's final bytes.
            st.copy_in(target, payload)
            if t < self.last_step:
                st.forward(src, payload, emit, *args)
        # Staged: keep the newest piece queued (its copy runs while we receive the next),
        # unless it ends a message.
        st.pump(0 if j + 1 == len(spans) else 1)
