"""All-reduce through one rank, for the smallest messages on more ranks than cores.

Every rank but group rank 0 sends its buffer to rank 0; rank 0 reduces all ``n`` buffers
in rank order, ``((x0 op x1) op x2) op ...`` (the same operations as the direct exchange,
so the same bits), and sends the result back to each. Two hops instead of the direct
exchange's one, but ``2(n - 1)`` messages instead of ``n(n - 1)``: where ranks outnumber
cores, each message costs a process wake-up and some Python on a shared core, and that,
not the hop count, sets the time (measured: benchmarks/results/local_lane.md, 8 bytes at
W=4 on two cores). Rank 0 handles ``2(n - 1)`` messages, so it only pays for a few ranks
and small sizes (``ALL_REDUCE_STAR_*`` in the registry).

Agreement before writing: rank 0 reduces only once every rank's message is in and its
fingerprint checked, and a rank writes ``x`` only from rank 0's result, which rank 0
sends only after that check; a mismatch anywhere makes rank 0 abort every rank instead.
So no rank writes on a mismatched call, without fingerprint messages between the others.

Copies per byte: the senders' private copy of ``x`` (the inline payload below 4 KiB), one
transport copy per message, rank 0's reduction straight into ``x`` and one private copy of
the result for its replies, and one copy from rank 0's message into ``x`` elsewhere. A
blocking call below the inline size takes the engine's fast lane (``Engine.exchange``,
with rank 0 replying from inside it), handed over to the regular path (``start``) on
anything unusual, as in the direct exchange.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..ops import ReduceOp, finalize, reduce_in_order, reduce_ufunc
from ..schedule.chunks import chunk_spans
from ..transport.wire import INLINE_MAX_BYTES, KIND_COLL, Header
from .base import CollectiveOp

__all__ = ["AllReduceStar"]

ROOT = 0  # group rank that reduces


class _Plan(NamedTuple):
    """What every call of one shape shares."""

    spans: list[tuple[int, int]]  # byte (offset, length) of each piece
    bounds: list[tuple[int, int]]  # element [a, b) of each piece
    dtype: str  # on the wire
    ufunc: Any
    silence: bool  # float dtype: overflow/invalid stay silent
    avg: bool


def _make_plan(x: np.ndarray, op: ReduceOp, chunk_bytes: int) -> _Plan:
    spans = chunk_spans(x.nbytes, chunk_bytes, x.itemsize)
    itemsize = x.itemsize
    bounds = [(off // itemsize, (off + length) // itemsize) for off, length in spans]
    ufunc = reduce_ufunc(op, x.dtype)
    return _Plan(spans, bounds, x.dtype.str, ufunc, x.dtype.kind == "f", op is ReduceOp.AVG)


class AllReduceStar(CollectiveOp):
    name = "all_reduce"
    algo = "star"
    gate_writes = False  # agreement comes through rank 0 (module docstring)
    fp_messages = False

    #: run_now sent our message already (then gave up and handed us to the engine).
    _sent_early = False
    plan: _Plan
    pieces: list[memoryview | None]  # received, [peer * npieces + piece]

    def _plan(self) -> _Plan:
        plan = self.shape_cache.plan
        if plan is None:
            x, op = self.call.x, self.call.op
            assert x is not None and op is not None
            plan = _make_plan(x, op, self.comm.chunk_bytes)
            self.shape_cache.plan = plan
        return plan  # type: ignore[no-any-return]

    # -- the fast lane -----------------------------------------------------------------
    def run_now(self, deadline: float) -> bool:
        """A blocking call below the inline size: ``Engine.exchange`` (rank 0 collects
        and replies inside it; the others send and collect the reply)."""
        x = self.call.x
        assert x is not None
        n = self.n
        nbytes = x.nbytes
        if n == 1 or nbytes >= INLINE_MAX_BYTES:
            return False
        self.plan = plan = self._plan()
        if len(plan.spans) != 1:
            return False
        ranks, group, seq = self.comm.ranks, self.group_id, self.seq
        template = self._template(0, 0, 1, plan.dtype, nbytes, 0)
        self._sent_early = True  # before: a hand-over starts us inside exchange
        if self.rank == ROOT:
            others = [ranks[p] for p in range(1, n)]
            keys = [(g, group, KIND_COLL, seq) for g in others]

            def reply(got: list[memoryview]) -> bytes:
                self.pieces = [None, *got]
                self._reduce()
                return template.pack(seq, x.tobytes())

            result = self.engine.exchange(
                self, b"", None, nbytes, [], keys, self.fp, deadline, reply=(reply, others)
            )
        else:
            root = ranks[ROOT]
            header = template.pack(seq, x.tobytes())
            key = (root, group, KIND_COLL, seq)
            result = self.engine.exchange(
                self, header, None, nbytes, [root], [key], self.fp, deadline
            )
            if type(result) is list:
                self.touched = True
                flat = x if x.ndim == 1 else x.reshape(-1)
                np.copyto(flat, np.frombuffer(result[0], x.dtype))
        if result is False:
            self._sent_early = False  # nothing was sent: the regular way, from the start
            return False
        if result is True:
            return False  # handed over to the engine
        self.result = x
        return True

    # -- the regular path --------------------------------------------------------------
    def start(self) -> None:
        x, op = self.call.x, self.call.op
        assert x is not None and op is not None
        self.result = x
        n = self.n
        if n == 1:
            finalize(op, x, 1)
            self.post_inboxes()
            return
        self.plan = plan = self._plan()
        self.pieces = [None] * (n * len(plan.spans))
        if self.rank == ROOT:
            for peer in range(1, n):
                self.expect(peer, 1)
        else:
            if not self._sent_early:
                self._send_all(ROOT, x.tobytes())
            self.expect(ROOT, 1)
        self.post_inboxes()

    def _send_all(self, peer: int, private: bytes) -> None:
        """Send ``private`` (a copy nobody writes) to group rank ``peer`` as one message."""
        spans = self.plan.spans
        npieces = len(spans)
        self.will_send(peer, 1)
        if npieces == 1:
            self.send_piece(peer, 0, 0, 1, len(private), 0, private, self.plan.dtype, track=False)
            return
        view = memoryview(private)
        for j, (off, length) in enumerate(spans):
            self.send_piece(
                peer, 0, j, npieces, len(private), off, view[off : off + length],
                self.plan.dtype, track=False,
            )  # fmt: skip

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        spans = self.plan.spans
        if len(spans) == 1 and header.npieces == 1 and len(payload) == spans[0][1]:
            self.pieces[peer] = payload
            return
        self.piece_span(peer, header, payload, spans)
        self.pieces[peer * len(spans) + header.piece] = payload

    def all_received(self) -> None:
        x = self.call.x
        assert x is not None
        n = self.n
        if n == 1:
            return
        if self.rank == ROOT:
            self._reduce()
            private = x.tobytes()
            for peer in range(1, n):
                self._send_all(peer, private)
            return
        # Rank 0's result, checked piece by piece by on_data: copy it into x.
        plan, pieces, dtype = self.plan, self.pieces, x.dtype
        flat = x if x.ndim == 1 else x.reshape(-1)
        self.touched = True
        for j, (a, b) in enumerate(plan.bounds):
            flat[a:b] = np.frombuffer(pieces[j], dtype)  # type: ignore[arg-type]

    def _reduce(self) -> None:
        """Rank 0: every buffer is in (``pieces``); reduce in rank order into ``x``."""
        x, op = self.call.x, self.call.op
        assert x is not None and op is not None
        plan, pieces, dtype, n = self.plan, self.pieces, x.dtype, self.n
        flat = x if x.ndim == 1 else x.reshape(-1)
        self.touched = True
        frombuffer = np.frombuffer
        npieces = len(plan.bounds)
        for j, (a, b) in enumerate(plan.bounds):
            srcs = [flat[a:b]] + [
                frombuffer(pieces[r * npieces + j], dtype)  # type: ignore[arg-type]
                for r in range(1, n)
            ]
            reduce_in_order(plan.ufunc, srcs, flat[a:b], silence=plan.silence)
        if plan.avg:
            finalize(op, flat, n)
