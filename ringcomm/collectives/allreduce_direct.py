"""All-reduce by direct exchange, for the smallest messages (latency: one step).

Every rank sends its whole buffer to every other rank, receives theirs, and reduces all
``n`` buffers itself in rank order, ``((x0 op x1) op x2) op ...``: the same operations on
the same bytes on every rank, so every rank ends with the same bits without an all-gather.
One step instead of recursive doubling's ``log2 n``, but ``n - 1`` buffers per rank: it
only pays below a small size (``ALL_REDUCE_DIRECT_MAX_BYTES``, measured).

Invariants: ``x`` is never sent from (a private copy is, since ``x`` is overwritten while
libzmq may still read), and written only once every piece arrived and was checked. What
depends only on the call's shape is built once per shape (``shape_plan``). A blocking call
of one-piece messages takes the engine's fast lane (:meth:`AllReduceDirect.run_now`), handed
over to the regular path on anything unusual. Copies per byte: docs/architecture.md
("Small all_reduce").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ringcomm.collectives.base import CollectiveOp, byte_view
from ringcomm.core.progress import INLINE_MAX_BYTES
from ringcomm.ops import ReduceOp, finalize, reduce_in_order, reduce_ufunc
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.transport.wire import KIND_COLL, Header

__all__ = ["AllReduceDirect"]


class _Plan(NamedTuple):
    """What every call of one shape shares (see the module docstring)."""

    spans: list[tuple[int, int]]  # byte (offset, length) of each piece
    bounds: list[tuple[int, int]]  # element [a, b) of each piece
    peers: list[int]  # whom we send to, in order: right, then around the ring
    dtype: str  # on the wire
    ufunc: Any
    silence: bool  # float dtype: overflow/invalid stay silent
    avg: bool


def _make_plan(x: np.ndarray, op: ReduceOp, chunk_bytes: int, me: int, n: int) -> _Plan:
    spans = chunk_spans(x.nbytes, chunk_bytes, x.itemsize)
    itemsize = x.itemsize
    bounds = [(off // itemsize, (off + length) // itemsize) for off, length in spans]
    # Send right, then around the ring, so no rank is everyone's first destination.
    peers = [(me + k) % n for k in range(1, n)]
    ufunc = reduce_ufunc(op, x.dtype)
    return _Plan(spans, bounds, peers, x.dtype.str, ufunc, x.dtype.kind == "f", op is ReduceOp.AVG)


class AllReduceDirect(CollectiveOp):
    name = "all_reduce"
    algo = "direct"
    gate_writes = False  # reduces only once every peer's buffer is in
    fp_messages = False

    #: run_now sent our message already (then gave up and handed us to the engine).
    _sent_early = False
    plan: _Plan
    pieces: list[memoryview | None]  # received, [peer * npieces + piece]

    def shape_plan(self) -> _Plan:
        """This call shape's plan, built by its first call and kept in the group's cache."""
        plan = self.shape_cache.plan
        if plan is None:
            x, op = self.call.x, self.call.op
            assert x is not None and op is not None
            plan = _make_plan(x, op, self.comm.chunk_bytes, self.rank, self.n)
            self.shape_cache.plan = plan
        return plan  # type: ignore[no-any-return]

    def run_now(self, deadline: float) -> bool:
        """A blocking call whose messages are one piece: the engine's fast lane
        (``Progress.exchange``: the same messages, checks and hand-over on anything unusual;
        see the docstring there), then the same reduction as ``all_received``."""
        x = self.call.x
        assert x is not None
        n = self.n
        if n == 1:
            return False
        self.plan = plan = self.shape_plan()
        if len(plan.spans) != 1:
            return False
        ranks, group, seq = self.comm.ranks, self.group_id, self.seq
        nbytes = x.nbytes
        template = self.header_template(0, 0, 1, plan.dtype, nbytes, 0)
        if nbytes < INLINE_MAX_BYTES:  # one frame for every peer, framed once
            header, payload = template.pack(seq, x.tobytes()), None
        else:  # exchange copies it as it sends (it takes no zero-copy sizes)
            header, payload = template.pack(seq), byte_view(x)
        peers = [ranks[p] for p in plan.peers]
        keys = [(g, group, KIND_COLL, seq) for g in peers]
        self._sent_early = True  # before: a hand-over starts us inside exchange
        got = self.progress.exchange(self, header, payload, nbytes, peers, keys, self.fp, deadline)
        received = self.received(got)
        if received is None:
            return False
        pieces: list[memoryview | None] = [None] * n
        self.pieces = pieces
        for p, data in zip(plan.peers, received):
            pieces[p] = data
        self.all_received()
        self.result = x
        return True

    def received(self, got: list[memoryview] | bool) -> list[memoryview] | None:
        """What the fast lane's ``Progress.exchange`` received (its answer ``got``), or
        None where the call goes the regular way: ``got`` False (nothing was sent: from
        the start) or True (handed over to the engine)."""
        if got is False:
            self._sent_early = False  # nothing was sent: the regular way, from the start
            return None
        return None if got is True else got

    def start(self) -> None:
        x = self.begin()
        if x is None:
            return
        plan = self.plan
        if not self._sent_early:
            self.send_whole(plan.peers, x.tobytes())  # one copy for all peers, never written
        for peer in plan.peers:
            self.expect(peer, 1)
        self.post_inboxes()

    def begin(self) -> np.ndarray | None:
        """The common start of the regular path: the result is ``x``; alone, finish with it
        (None); else set up the plan and the received pieces' places and return ``x``."""
        x, op = self.call.x, self.call.op
        assert x is not None and op is not None
        self.result = x
        if self.n == 1:
            finalize(op, x, 1)
            self.post_inboxes()
            return None
        self.plan = plan = self.shape_plan()
        self.pieces = [None] * (self.n * len(plan.spans))
        return x

    def send_whole(self, peers: list[int], private: bytes) -> None:
        """Send ``private`` (a copy of the buffer nobody writes) to each of ``peers`` as
        one message, cut into the plan's pieces."""
        plan = self.plan
        spans = plan.spans
        npieces = len(spans)
        if npieces == 1:
            self.send_to_each(peers, 0, private, plan.dtype, track=False)
            return
        view = memoryview(private)
        for peer in peers:
            self.will_send(peer, 1)
            for j, (off, length) in enumerate(spans):
                self.send_piece(
                    peer,
                    0,
                    j,
                    npieces,
                    len(private),
                    off,
                    view[off : off + length],
                    plan.dtype,
                    track=False,
                )

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        spans = self.plan.spans
        if len(spans) == 1 and header.npieces == 1 and len(payload) == spans[0][1]:
            self.pieces[peer] = payload  # the usual whole message (what piece_span checks)
            return
        self.piece_span(peer, header, payload, spans)
        self.pieces[peer * len(spans) + header.piece] = payload

    def all_received(self) -> None:
        if self.n > 1:
            self.reduce_all()

    def reduce_all(self) -> None:
        """Every rank's buffer is in (``pieces``, ours is ``x``): reduce them in rank
        order straight into ``x``."""
        x, op = self.call.x, self.call.op
        assert x is not None and op is not None
        n = self.n
        plan = self.plan
        me, pieces, dtype = self.rank, self.pieces, x.dtype
        # Everything arrived and fits (on_data checked each piece), so nothing can fail
        # from here: reduce straight into x. x is the left operand of the first step when
        # we are rank 0 or 1; a higher rank's own operand is read after that step has
        # overwritten x, so it reduces from a copy.
        flat = x if x.ndim == 1 else x.reshape(-1)
        mine = flat if me < 2 else flat.copy()
        self.touched = True
        frombuffer = np.frombuffer
        if len(plan.bounds) == 1:
            srcs = [mine if r == me else frombuffer(pieces[r], dtype) for r in range(n)]  # type: ignore[arg-type]
            reduce_in_order(plan.ufunc, srcs, flat, silence=plan.silence)
        else:
            npieces = len(plan.bounds)
            for j, (a, b) in enumerate(plan.bounds):
                srcs = [
                    mine[a:b] if r == me else frombuffer(pieces[r * npieces + j], dtype)  # type: ignore[arg-type]
                    for r in range(n)
                ]
                reduce_in_order(plan.ufunc, srcs, flat[a:b], silence=plan.silence)
        if plan.avg:
            finalize(op, flat, n)
