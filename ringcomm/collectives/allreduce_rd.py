"""All-reduce by recursive doubling, for small messages (latency: ``log2 n`` exchanges).

The plan is ``schedule.rd.rd_allreduce_plan`` (MPICH's scheme with the non-power-of-two
pre- and post-step); each ``chunk_bytes`` piece runs it on its own (the reduction is
elementwise), one inbox per partner (a directed pair exchanges one message per call at most).

Invariants: the lower rank's operand is always on the left (``RdStep.incoming_first``), so
every rank evaluates the same bracketing and ends with the same bits; AVG is finalized after
the last reducing step, before a rank that sat out copies the result; nothing is reduced
into a region of ``x`` while libzmq may still read a piece sent from it (large exchange
pieces go from a private copy, else :meth:`wait_released` waits for the tracker).
Pipelining, copies per byte and the zero-copy argument: docs/architecture.md, section
"collectives/allreduce_rd.py".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.collectives.base import byte_view
from ringcomm.collectives.stepped import SpansOp
from ringcomm.core.progress import ZERO_COPY_MIN_BYTES
from ringcomm.ops import finalize, reduce_into
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.schedule.rd import rd_allreduce_plan
from ringcomm.transport.wire import Header

__all__ = ["AllReduceRd"]

#: Exchange pieces that the transport would send zero-copy are sent from a private copy
#: (one memcpy) instead: waiting for libzmq to release a zero-copy piece before we may
#: reduce into it costs more (measured: 64 KiB W=2 went from ~130 us to ~330 us). Below
#: it the transport copies anyway.
PRIVATE_COPY_MIN_BYTES = ZERO_COPY_MIN_BYTES

_RECEIVING = ("recv_reduce", "exchange", "recv_result")
_REDUCING = ("recv_reduce", "exchange")


class AllReduceRd(SpansOp):
    name = "all_reduce"
    algo = "rd"

    def start_peers(self, rank: int) -> tuple[int, ...]:
        # Every piece runs its plan at start up to the first receive: a first step that
        # sends (or exchanges) goes out at once.
        plan = rd_allreduce_plan(rank, self.n)
        return (plan[0].peer,) if plan and plan[0].kind in ("send", "exchange") else ()

    def waiting_on(self, inboxes: list[tuple[int, Any]]) -> tuple[int, Any]:
        return min(inboxes, key=lambda item: self.step_of_peer.get(item[0], 0))

    def message_step(self, peer: int, k: int) -> int:
        return self.step_of_peer.get(peer, 0)

    def step_text(self, step: int) -> str:
        st = self.plan[step]
        what = st.kind.replace("_", " ")
        return f"recursive doubling step {step + 1}/{len(self.plan)} ({what} with rank {st.peer})"

    def start(self) -> None:
        x, op = self.call.x, self.call.op
        assert x is not None and op is not None
        self.result = x
        plan = rd_allreduce_plan(self.rank, self.n)
        self.plan = plan
        reducing = [i for i, st in enumerate(plan) if st.kind in _REDUCING]
        # Finalize after the last reducing step; a world of one finalizes at once; a rank
        # that sat out receives finalized bytes.
        self.finalize_after = reducing[-1] if reducing else (-1 if not plan else None)
        self.flat = x.reshape(-1)
        self.data = byte_view(self.flat)
        self.dtype = x.dtype
        self.dtype_str = x.dtype.str
        self.itemsize = x.itemsize
        self.spans = chunk_spans(x.nbytes, self.comm.chunk_bytes, x.itemsize)
        npieces = len(self.spans)
        self.step_of_peer: dict[int, int] = {}
        for i, st in enumerate(plan):
            if st.kind in _RECEIVING:
                self.expect(st.peer, 1)
                self.step_of_peer[st.peer] = i
            else:
                self.will_send(st.peer, 1)
            if st.kind == "exchange":
                self.will_send(st.peer, 1)
        self.pos = [0] * npieces  # next plan step of each piece
        self.sent = [-1] * npieces  # last plan step whose send of the piece is queued
        self.early: dict[tuple[int, int], memoryview] = {}  # (step, piece) -> frame
        self.trackers: dict[tuple[int, int], Any] = {}
        if self.finalize_after == -1:
            finalize(op, x, self.n)
        for j in range(npieces):
            self._advance(j)
        self.post_inboxes()

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        j = header.piece
        spans = self.spans
        self.piece_span(peer, header, payload, spans)
        i = self.step_of_peer[peer]
        self.early[(i, j)] = payload
        if self.pos[j] == i:
            self._advance(j)

    def _advance(self, j: int) -> None:
        """Carry piece ``j`` through its plan as far as the frames received allow."""
        plan = self.plan
        off, length = self.spans[j]
        while self.pos[j] < len(plan):
            i = self.pos[j]
            st = plan[i]
            if st.kind in ("send", "exchange", "send_result") and self.sent[j] < i:
                view = self.data[off : off + length]
                private = st.kind == "exchange" and length >= PRIVATE_COPY_MIN_BYTES
                tracker = self.send_piece(
                    st.peer,
                    i,
                    j,
                    len(self.spans),
                    len(self.data),
                    off,
                    bytes(view) if private else view,
                    self.dtype_str,
                    track=not private,
                )
                self.sent[j] = i
                if tracker is not None and st.kind == "exchange" and not private:
                    self.trackers[(i, j)] = tracker
            if st.kind in ("send", "send_result"):
                self.pos[j] = i + 1
                continue
            frame = self.early.pop((i, j), None)
            if frame is None:
                return  # wait for the partner's piece
            a = off // self.itemsize
            target = self.flat[a : a + length // self.itemsize]
            incoming = np.frombuffer(frame, self.dtype)
            self.touched = True
            if st.kind == "recv_result":
                target[...] = incoming
            else:
                # Our piece of this exchange must be out of libzmq's hands before we write.
                self.wait_released(self.trackers.pop((i, j), None))
                op = self.call.op
                assert op is not None
                reduce_into(op, target, incoming, incoming_first=st.incoming_first)
                if i == self.finalize_after:
                    finalize(op, target, self.n)
            self.pos[j] = i + 1
