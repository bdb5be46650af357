"""What every collective algorithm shares: the call, its fingerprint, inboxes and sends.

An algorithm is a :class:`CollectiveOp` (a progress-engine :class:`~ringcomm.core.progress.Op`)
built from two frozen descriptions, the same for every algorithm:
``AlgorithmClass(comm: Comm, call: Call, *, async_op: bool = False)``. :class:`Comm` is the
group as the algorithm sees it (engine, ranks, this collective's sequence number, piece size,
time limit, serial queue); :class:`Call` the checked arguments.

Invariants: one collective's stream from one peer is its own ordered channel (matched on
``(src, group, KIND_COLL, seq)``, consumed by one :class:`Inbox`); every piece carries the
sender's call :func:`fingerprint`, and a mismatch fails every rank of the call with the user
buffers untouched (gated ops hold pieces until every peer was heard from); a zero-copy piece's
memory is not written before libzmq released it, and an op completes only then. The protocol
in full: docs/architecture.md ("Collective messages").
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ringcomm.core.progress import Op, Progress, SerialQueue, Stream
from ringcomm.errors import CollectiveMismatchError, CommTimeoutError, RingcommError
from ringcomm.ops import ReduceOp
from ringcomm.transport.wire import KIND_COLL, Header, HeaderTemplate, pack_header

__all__ = [
    "ABORT",
    "FP_STEP",
    "Call",
    "CollectiveOp",
    "Comm",
    "ShapeCache",
    "byte_view",
    "describe_fingerprint",
    "fingerprint",
]

#: First field of an abort message's fingerprint.
ABORT = "!abort"
#: Longest abort reason put on the wire.
_ABORT_TEXT_MAX = 2000
#: ``step`` of a fingerprint message (module docstring): never a real algorithm step.
FP_STEP = 0xFFFFFFFF
#: ``CollectiveOp._held`` when nothing is held: shared and never appended to (pieces are
#: held only while ``_fp_missing``, which post_inboxes sets with a list of the op's own).
_NOTHING_HELD: list[tuple[int, Header, memoryview]] = []


# Comm and Call are immutable NamedTuples rather than frozen dataclasses: one of each is
# built per call, and a frozen dataclass costs about a microsecond to build.
class Comm(NamedTuple):
    """The group, as one collective call sees it.

    ``plans``: the group's cache of per-call-shape state (:class:`ShapeCache`); None: no cache.
    ``ring_order``: the order the ring algorithms visit the ranks (host by host, see
    ``schedule.ring``); None: rank order.
    """

    progress: Progress
    rank: int
    world_size: int
    group_id: int
    ranks: tuple[int, ...]  # group rank -> global rank
    seq: int
    chunk_bytes: int
    timeout_s: float
    serial: SerialQueue | None = None
    plans: dict[Any, ShapeCache] | None = None
    ring_order: tuple[int, ...] | None = None


class Call(NamedTuple):
    """A checked collective call. Fields a collective does not use are None.

    ``shape``/``dtype``: the shape and dtype of ``x`` (for ``scatter`` on a rank that
    passed ``x=None``, None: they come from the source's message). ``chunk_bytes``: this
    call's piece size when the cost model chose one (None: the group's). ``nbytes``: the
    bytes the flight recorder counts for the call (``x.nbytes``; None: dtype times shape).
    """

    name: str
    algo: str
    x: np.ndarray | None = None
    out: np.ndarray | None = None
    op: ReduceOp | None = None
    root: int | None = None
    dtype: np.dtype[Any] | None = None
    shape: tuple[int, ...] | None = None
    chunk_bytes: int | None = None
    nbytes: int | None = None


#: Most call shapes a group keeps state for (the cache is emptied when it is full).
MAX_SHAPES = 256
#: Most header templates kept per call shape (messages cut into more pieces than this
#: pack the rest of their headers afresh: the payload dwarfs the header there).
MAX_TEMPLATES = 64


class ShapeCache:
    """What every call of one shape in one group shares, built by its first call.

    A call's shape is its algorithm, dtype, shape, op, root and ``chunk_bytes`` (the
    group's rank, size and id are fixed); state that depends on nothing else is the same
    for every such call: the fingerprint, the headers of its pieces (all but the sequence
    number, :class:`HeaderTemplate`) and the algorithm's own ``plan`` (spans, peers, ...;
    None until an algorithm sets it). Never modified once built, except that ``plan`` is
    set and templates are added by the first calls. Ops read ``self.shape_cache``.
    """

    __slots__ = ("fp", "fp_peers", "plan", "templates")

    def __init__(self, fp: list[Any]) -> None:
        self.fp = fp
        self.plan: Any = None
        #: (peers we send a fingerprint message to, peers we get one from); None: not yet.
        self.fp_peers: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.templates: dict[tuple[int, int, int, str, int, int], HeaderTemplate] = {}


# Which keyword names the root in messages about each collective.
_ROOT_NAMES = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}


def fingerprint(call: Call, chunk_bytes: int | None) -> list[Any]:
    """``[name, dtype, shape, op, root, algo, chunk_bytes]`` as it goes on the wire.

    ``chunk_bytes`` is part of it because the pipelined algorithms forward a piece as soon
    as it arrives, which needs both sides to cut messages alike. A list (msgpack gives
    lists back), so a received one compares equal with ``==``. None fields on the receiving
    side are wildcards (scatter onto ``x=None``).
    """
    return [
        call.name,
        None if call.dtype is None else call.dtype.str,
        None if call.shape is None else list(call.shape),
        None if call.op is None else call.op.value,
        call.root,
        call.algo,
        chunk_bytes,
    ]


def describe_fingerprint(fp: Any) -> str:
    """``all_reduce(float32[4x250], op=sum, algo=ring, chunk_bytes=64)``, for messages."""
    if not isinstance(fp, (list, tuple)) or len(fp) != 7 or not isinstance(fp[0], str):
        return f"an unrecognised message (fingerprint {fp!r:.200})"
    name, dtype, shape, op, root, algo, chunk = fp
    parts = []
    if dtype is not None or shape is not None:
        try:
            dname = "?" if dtype is None else np.dtype(dtype).name
        except TypeError:
            dname = repr(dtype)
        dims = "?" if shape is None else "x".join(map(str, shape))
        parts.append(f"{dname}[{dims}]")
    if op is not None:
        parts.append(f"op={op}")
    if root is not None:
        parts.append(f"{_ROOT_NAMES.get(name, 'root')}={root}")
    parts.append(f"algo={algo}")
    if chunk is not None:
        parts.append(f"chunk_bytes={chunk}")
    return f"{name}({', '.join(parts)})"


def byte_view(a: np.ndarray) -> memoryview:
    """A flat byte memoryview of a contiguous array (what pieces are sliced from)."""
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


class Inbox:
    """The receiver for one peer's stream of one collective (posted once, see module doc).

    Pieces reach ``op.on_data`` only after their fingerprint matched. Once the op is
    finished with an error the inbox is detached (``op`` None): it keeps counting the
    peer's pieces of the expected messages, so it unposts itself at the stream's end, and
    after a foreign fingerprint (a mismatching call or an abort) it is *sealed*: it swallows
    every further piece with its key (only this collective's stream ever uses that key).
    """

    __slots__ = ("expected", "fp", "got", "key", "last", "op", "peer", "sealed")

    def __init__(self, op: CollectiveOp, peer: int, key: tuple[int, int, int, int], expected: int):
        self.op: CollectiveOp | None = op
        self.peer = peer
        self.key = key
        self.fp = op.fp
        self.expected = expected
        self.got = 0
        self.sealed = False
        self.last: Header | None = None  # the last piece taken (for the progress map)

    @property
    def complete(self) -> bool:
        return self.got >= self.expected

    def on_piece(self, header: Header, payload: memoryview) -> bool:
        op = self.op
        fp = header.fp
        if self.sealed:
            return False
        self.last = header
        if fp != self.fp and (op is None or not op.accepts(self, fp)):
            self.sealed = True
            if op is not None:
                op.on_foreign(self.peer, fp)
            return False
        if op is not None:
            if op._fp_missing:  # not every peer heard from yet: hold the piece back
                op.heard_from(self.peer, header)
                op = self.op  # releasing held pieces may have failed the op
                if op is not None and header.step != FP_STEP:
                    if op._fp_missing:
                        op._held.append((self.peer, header, payload))
                    else:
                        op.deliver(self.peer, header, payload)
            elif header.step != FP_STEP:
                try:
                    op.on_data(self.peer, header, payload)
                except Exception as exc:  # noqa: BLE001 (a late error: fail the op, not the rank)
                    op.fail_from(exc)
        if header.piece + 1 == header.npieces:
            self.got += 1
            if self.got >= self.expected:
                op = self.op  # again: on_data may have failed the op (which detaches us)
                if op is not None:
                    op._open_inboxes -= 1  # CollectiveOp.inbox_done, inlined
                    op._maybe_complete()
                return True
        return False


class CollectiveOp(Op):
    """Base of every collective algorithm (see the module docstring)."""

    #: The public collective this implements (``"all_reduce"``) and the algorithm name.
    name: ClassVar[str] = ""
    algo: ClassVar[str] = ""
    #: Hold pieces back until every peer has been heard from (module docstring).
    gate_writes: ClassVar[bool] = True
    #: Send a fingerprint message to every peer at start (needed unless every rank
    #: hears from every peer at start anyway).
    fp_messages: ClassVar[bool] = True
    #: The algorithm says which step and piece a message is (``step_text`` and friends):
    #: the progress map names them; otherwise it counts messages per peer.
    maps_steps: ClassVar[bool] = False

    def __init__(self, comm: Comm, call: Call, *, async_op: bool = False) -> None:
        super().__init__(comm.progress, async_op=async_op)
        self.comm = comm
        self.call = call
        self.serial = comm.serial
        self.group_id = comm.group_id  # Progress.fail_pending matches on it
        self.rank = comm.rank
        self.n = comm.world_size
        self.seq = comm.seq
        self.collective = (comm.group_id, comm.seq, comm.ranks)  # its failure is told
        chunk = self.fingerprint_chunk_bytes()
        plans = comm.plans
        if plans is None:
            self.shape_cache = ShapeCache(fingerprint(call, chunk))
        else:
            key = (
                type(self),
                call.name,
                call.algo,
                call.dtype,
                call.shape,
                call.op,
                call.root,
                comm.chunk_bytes,
                chunk,
            )
            cached = plans.get(key)
            if cached is None:
                if len(plans) >= MAX_SHAPES:
                    plans.clear()
                cached = plans[key] = ShapeCache(fingerprint(call, chunk))
            self.shape_cache = cached
        self.fp = self.shape_cache.fp
        self._me_global = comm.ranks[comm.rank]
        self._inboxes: dict[int, Inbox] = {}
        self._open_inboxes = 0
        self._out_left: dict[int, int] = {}
        self._unsent = 0  # messages declared with will_send and not fully queued yet
        # Group ranks this op sent a two-frame message (over zmq); its later one-frame
        # messages to them must not take the same-host lane (they could overtake).
        #: This call's messages: the transport keeps their order to each peer.
        self.stream = Stream()
        self._posted = False
        self.touched = False  # set by algorithms when they first write a user buffer
        self._fp_missing = 0  # peers not heard from yet (gate_writes)
        # The gate's state is created by post_inboxes, only when the op gates its writes
        # (not per call of the 8-byte fast lane): until then, nothing is held and no peer
        # is missing.
        self._fp_heard: set[int] | None = None
        self._held: list[tuple[int, Header, memoryview]] = _NOTHING_HELD

    # -- description -------------------------------------------------------------------
    def fingerprint_chunk_bytes(self) -> int | None:
        """chunk_bytes as it matters to the message layout (None: it does not)."""
        return self.comm.chunk_bytes

    def describe(self) -> str:
        return f"{describe_fingerprint(self.fp)} (collective #{self.seq} of group {self.group_id})"

    def progress_note(self) -> str:
        """Where inside the algorithm this rank is (built only when asked), e.g.
        'reduce-scatter step 5/7, piece 12/16, waiting on recv from rank 2'."""
        if not self.started:
            return "queued behind an earlier collective of this group"
        waiting = [(p, ib) for p, ib in sorted(self._inboxes.items()) if not ib.complete]
        if not waiting:
            return "everything received; waiting for the transport to release sent buffers"
        if not self.maps_steps:
            return "received " + ", ".join(
                f"{ib.got}/{ib.expected} messages from rank {p}" for p, ib in waiting
            )
        fp_from = self.shape_cache.fp_peers[1] if self.shape_cache.fp_peers else ()
        data = [(p, ib) for p, ib in waiting if ib.expected > (p in fp_from)]
        peer, ib = self.waiting_on(data) if data else waiting[0]
        h = ib.last
        npieces: int | None
        if h is not None and h.step != FP_STEP and h.piece + 1 < h.npieces:
            step, piece, npieces = h.step, h.piece + 1, h.npieces  # inside a message
        elif data:
            k = max(0, ib.got - (peer in fp_from))  # data messages complete so far
            step, piece = self.message_step(peer, k), 0
            npieces = self.message_pieces(step)
        else:
            step = -1
        if step < 0:
            text = f"waiting on the fingerprint message of rank {peer}"
        else:
            where = self.step_text(step)
            text = (
                (f"{where}, " if where else "")
                + f"piece {piece + 1}"
                + (f"/{npieces}" if npieces else "")
                + f", waiting on recv from rank {peer}"
            )
        if self._fp_missing:
            heard = self._fp_heard or ()
            missing = [p for p in sorted(self._inboxes) if p not in heard]
            text += f"; writes held until ranks {missing} are heard from"
        return text

    def where(self) -> str:
        """'op #1042 all_reduce(float32[4194304]) reduce-scatter step 5/7, piece 12/16,
        waiting on recv from rank 2' (the progress map's line for this rank)."""
        call = self.call
        if call.dtype is None or call.shape is None:
            what = f"{call.name}()"  # barrier; scatter onto x=None
        else:
            what = f"{call.name}({call.dtype.name}[{int(np.prod(call.shape, dtype=np.int64))}])"
        return f"op #{self.seq} {what} {self.progress_note()}"

    # Hooks for the progress map (algorithms override what they can say better).
    def waiting_on(self, inboxes: list[tuple[int, Inbox]]) -> tuple[int, Inbox]:
        """Which of the incomplete data streams ``(peer, inbox)`` the op waits on first."""
        return inboxes[0]

    def message_step(self, peer: int, k: int) -> int:
        """The algorithm step of the ``k``-th data message from group rank ``peer``."""
        return k

    def step_text(self, step: int) -> str:
        """'reduce-scatter step 5/7' for the progress map ('' for one-step algorithms)."""
        return f"step {step + 1}"

    def message_pieces(self, step: int) -> int | None:
        """How many pieces the message of ``step`` has (None: not known here)."""
        return None

    # -- setup (in start) --------------------------------------------------------------
    def expect(self, peer: int, messages: int) -> None:
        """Receive ``messages`` messages from group rank ``peer`` in this collective."""
        if messages <= 0:
            return
        key = (self.comm.ranks[peer], self.group_id, KIND_COLL, self.seq)
        self._inboxes[peer] = Inbox(self, peer, key, messages)
        self._open_inboxes += 1

    def will_send(self, peer: int, messages: int) -> None:
        """Declare ``messages`` messages to ``peer`` (so a failure can abort that stream)."""
        self._out_left[peer] = self._out_left.get(peer, 0) + messages
        self._unsent += messages

    def post_inboxes(self) -> None:
        """Post every inbox. Call after the first sends: queued pieces are fed right away
        and may trigger later steps' sends, which must follow the first ones on the wire.

        Sends the fingerprint messages first and sets up the write gate (module
        docstring)."""
        if self.n > 1 and self.gate_writes:
            if self.fp_messages:
                cache = self.shape_cache
                fp_peers = cache.fp_peers
                if fp_peers is None:
                    fp_peers = cache.fp_peers = self._fp_peers()
                to, frm = fp_peers
                if to:
                    self.send_to_each(list(to), FP_STEP, b"", "|u1", track=False)
                for p in frm:
                    inbox = self._inboxes.get(p)
                    if inbox is None:
                        self.expect(p, 1)
                    else:
                        inbox.expected += 1
            self._fp_missing = len(self._inboxes)
            self._fp_heard = set()
            self._held = []
        post = self.progress.post
        for inbox in list(self._inboxes.values()):
            post(inbox.key, inbox)
        self._posted = True
        if self._open_inboxes <= 0:  # else an inbox completes us later
            self._maybe_complete()

    def start_peers(self, rank: int) -> tuple[int, ...]:
        """Group ranks to which group rank ``rank`` sends a message of this call at its
        start, unconditionally, before it hears from anyone (data carries the call's
        fingerprint: those peers need no fingerprint message from ``rank``). A pure
        function of the call shape, ``rank`` and the group size; every rank evaluates it
        for every peer, so it must give the same answer everywhere. Default: none."""
        return ()

    def _fp_peers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(peers to send a fingerprint message to, peers to expect one from)."""
        me, n = self.rank, self.n
        mine = self.start_peers(me)
        to = tuple(p for p in range(n) if p != me and p not in mine)
        frm = tuple(p for p in range(n) if p != me and me not in self.start_peers(p))
        return to, frm

    # -- sending -----------------------------------------------------------------------
    def send_piece(
        self,
        peer: int,
        step: int,
        piece: int,
        npieces: int,
        msg_nbytes: int,
        offset: int,
        payload: Any,
        dtype: str,
        *,
        track: bool = True,
        shape: tuple[int, ...] | None = None,
    ) -> Any:
        """Queue one piece to group rank ``peer``; return its tracker (None if copied).

        ``track=False``: ``payload`` is a private copy nobody writes, so the op need not
        wait for libzmq to release it before it completes. ``shape``: put in the header
        (collective pieces carry none otherwise; all_to_all_v says there what it expects
        back from ``peer``); such headers are not cached.
        """
        if shape is None:
            template = self.header_template(step, piece, npieces, dtype, msg_nbytes, offset)
        else:
            template = self._new_template(step, piece, npieces, dtype, msg_nbytes, offset, shape)
        nbytes = len(payload)
        tracker = self.progress.send(
            self.comm.ranks[peer], self.stream, template.pack(self.seq), payload, nbytes
        )
        if track and tracker is not None:
            self.add_tracker(tracker)
        if piece + 1 == npieces:
            self._out_left[peer] -= 1
            self._unsent -= 1
        return tracker

    def send_to_each(
        self, peers: list[int], step: int, payload: bytes, dtype: str, *, track: bool = True
    ) -> None:
        """Queue the same one-piece message (``payload``, step ``step``) to each of ``peers``.

        The header is the same for every peer, so it is packed once. Everything is queued
        here and now, so these messages need no :meth:`will_send`. ``track``: as in
        :meth:`send_piece`.
        """
        nbytes = len(payload)
        header = self.header_template(step, 0, 1, dtype, nbytes, 0).pack(self.seq)
        send, ranks, stream = self.progress.send, self.comm.ranks, self.stream
        for peer in peers:
            tracker = send(ranks[peer], stream, header, payload, nbytes)
            if track and tracker is not None:
                self.add_tracker(tracker)

    def _new_template(
        self,
        step: int,
        piece: int,
        npieces: int,
        dtype: str,
        msg_nbytes: int,
        offset: int,
        shape: Any,
    ) -> HeaderTemplate:
        """A piece's header of this call (sequence number left to :meth:`HeaderTemplate.pack`)."""
        header = Header(
            KIND_COLL,
            self._me_global,
            self.group_id,
            0,
            step,
            piece,
            npieces,
            dtype,
            msg_nbytes,
            offset,
            shape,
            self.fp,
        )
        return HeaderTemplate(header)

    def header_template(
        self, step: int, piece: int, npieces: int, dtype: str, msg_nbytes: int, offset: int
    ) -> HeaderTemplate:
        """This call shape's header of a piece, but for the sequence number (cached)."""
        key = (step, piece, npieces, dtype, msg_nbytes, offset)
        templates = self.shape_cache.templates
        template = templates.get(key)
        if template is None:
            template = self._new_template(step, piece, npieces, dtype, msg_nbytes, offset, None)
            if len(templates) < MAX_TEMPLATES:
                templates[key] = template
        return template

    def send_message(
        self,
        peer: int,
        step: int,
        data: memoryview,
        spans: list[tuple[int, int]],
        base: int,
        dtype: str,
    ) -> None:
        """Queue a whole message: ``data[base + off : base + off + length]`` per span."""
        n = len(spans)
        total = sum(length for _, length in spans)
        for j, (off, length) in enumerate(spans):
            self.send_piece(
                peer, step, j, n, total, off, data[base + off : base + off + length], dtype
            )

    def wait_released(self, tracker: Any) -> None:
        """Block until libzmq let go of a zero-copy piece (before we overwrite its memory).

        Only libzmq's I/O thread (and pyzmq's gc thread) can finish this, and they never
        wait on us, so waiting here under the driver lock cannot deadlock; it is bounded
        by the call's deadline all the same, and by the engine's failure detection.
        """
        if tracker is None or tracker.done:
            return
        progress = self.progress
        deadline = time.monotonic() + self.comm.timeout_s
        while not tracker.done:
            # libzmq keeps a message for a dead peer (waiting for a reconnection), so
            # liveness is watched here too: a failure ends the wait.
            if progress.failure is not None:
                raise progress.failed_error(self.desc)
            now = time.monotonic()
            progress.check_health_if_due(now, drain=False)
            if now > deadline:
                raise CommTimeoutError(
                    f"rank {self.rank}: {self.desc}: the transport did not release a sent "
                    f"piece within {self.comm.timeout_s:g} s"
                )
            time.sleep(0.00005)

    # -- receiving (called by inboxes) -------------------------------------------------
    def piece_span(
        self,
        peer: int,
        header: Header,
        payload: memoryview,
        spans: list[tuple[int, int]],
        what: str = "the buffer",
    ) -> tuple[int, int]:
        """``(offset, length)`` of the arriving piece in ``spans``, checked against it.

        A piece count or length that does not match our own cut of the message means the
        sender's call differs from ours: CollectiveMismatchError, before any byte is used.
        """
        j = header.piece
        if header.npieces != len(spans) or len(payload) != spans[j][1]:
            raise CollectiveMismatchError(
                f"rank {self.rank}: {self.desc}: step {header.step} piece "
                f"{j}/{header.npieces} of {len(payload)} bytes from rank {peer} does not "
                f"fit {what}"
            )
        return spans[j]

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        """A piece from group rank ``peer`` whose fingerprint matched."""
        raise NotImplementedError

    def heard_from(self, peer: int, header: Header | None = None) -> None:
        """A matching message (``header``: its piece) came from ``peer``; open the gate
        once all peers have."""
        heard = self._fp_heard
        assert heard is not None  # set with _fp_missing (post_inboxes)
        if peer in heard:
            return
        heard.add(peer)
        if header is not None:
            try:
                self.first_heard(peer, header)
            except Exception as exc:  # noqa: BLE001 (a disagreement: fail the op, nothing written)
                self.fail_from(exc)
                return
        self._fp_missing -= 1
        if self._fp_missing:
            return
        try:
            self.gate_opens()
        except Exception as exc:  # noqa: BLE001 (a disagreement found: fail the op, nothing written)
            self.fail_from(exc)
            return
        held, self._held = self._held, _NOTHING_HELD
        for p, header, payload in held:  # in arrival order
            if self.done:
                return
            self.deliver(p, header, payload)

    def first_heard(self, peer: int, header: Header) -> None:
        """Hook (gated ops): the first matching piece from ``peer``, before the gate opens."""

    def gate_opens(self) -> None:
        """Hook (gated ops): every peer heard from, nothing delivered yet; raising here
        fails the call with every user buffer untouched."""

    def deliver(self, peer: int, header: Header, payload: memoryview) -> None:
        """``on_data``, failing the op (not the rank) on an error."""
        try:
            self.on_data(peer, header, payload)
        except Exception as exc:  # noqa: BLE001 (a late error: fail the op, not the rank)
            self.fail_from(exc)

    def accepts(self, inbox: Inbox, fp: Any) -> bool:
        """Whether a fingerprint that differs from ours is acceptable (wildcards)."""
        return False

    def inbox_done(self) -> None:
        self._open_inboxes -= 1
        self._maybe_complete()

    def all_received(self) -> None:
        """Hook: every inbox is complete (before settle)."""

    def _maybe_complete(self) -> None:
        if self.done or not self._posted or self._open_inboxes > 0:
            return
        if self._unsent:  # every algorithm sends its last piece before its last receive
            unsent = {p: k for p, k in self._out_left.items() if k}
            self.fail_from(
                RingcommError(
                    f"rank {self.rank}: {self.desc}: internal error: everything received "
                    f"but messages still unsent {unsent}"
                )
            )
            return
        self.all_received()
        if not self.done:
            self.settle()

    # -- failure -----------------------------------------------------------------------
    def on_foreign(self, peer: int, fp: Any) -> None:
        """A piece with another call's fingerprint (or an abort) arrived from ``peer``."""
        state = "partly written before the mismatch was seen" if self.touched else "untouched"
        if isinstance(fp, list) and len(fp) == 4 and fp[0] == ABORT:
            _, origin, kind, text = fp
            text = str(text)[:_ABORT_TEXT_MAX]  # it came off the wire
            cls = CollectiveMismatchError if kind == "mismatch" else RingcommError
            err = cls(
                f"rank {self.rank}: {self.desc}: aborted by rank {origin} (via rank {peer}): "
                f"{text} -- rank {self.rank}'s output buffer is {state}"
            )
            # Pass the original story on (not a nested one); the aborting peer knows.
            self.fail(err, skip_peer=peer, abort=(origin, kind, text))
            return
        err = CollectiveMismatchError(
            f"rank {self.rank}: collective mismatch in collective #{self.seq} of group "
            f"{self.group_id}: this rank called {describe_fingerprint(self.fp)} but "
            f"peer rank {peer} called {describe_fingerprint(fp)}; rank {self.rank}'s "
            f"output buffer is {state}"
        )
        # No skip: the mismatching peer may not know (it may be waiting in another call).
        self.fail(err)

    def fail_from(self, exc: BaseException) -> None:
        if isinstance(exc, RingcommError):
            self.fail(exc)
            return
        err = RingcommError(f"rank {self.rank}: {self.desc} failed: {exc!r}")
        err.__cause__ = exc
        self.fail(err)

    def fail(
        self,
        err: BaseException,
        skip_peer: int | None = None,
        abort: tuple[Any, Any, Any] | None = None,
    ) -> None:
        """Finish with ``err``; send an abort to every other rank (but ``skip_peer``).

        ``abort``: ``(origin rank, kind, text)`` of an abort we received and pass on.
        """
        if self.done:
            return
        self._held = _NOTHING_HELD
        for inbox in self._inboxes.values():
            inbox.op = None
        # Every other rank, not only this algorithm's partners: a rank that called
        # something else may be waiting on anyone (see the module docstring).
        peers = set(range(self.n)) - {self.rank, skip_peer}
        if abort is None:
            kind = "mismatch" if isinstance(err, CollectiveMismatchError) else "error"
            abort = (self.rank, kind, str(err)[:_ABORT_TEXT_MAX])
        fp = [ABORT, *abort]
        for peer in sorted(peers):
            header = Header(
                KIND_COLL, self._me_global, self.group_id, self.seq, 0, 0, 1, "|u1", 0, 0, None, fp
            )
            try:
                self.progress.send(self.comm.ranks[peer], self.stream, pack_header(header), b"", 0)
            except RingcommError:
                pass  # best effort: the peer's deadline still bounds its wait
        self.finish(err)

    def release(self) -> None:
        """Break the op <-> inbox cycle and drop held pieces (the op is finished).

        Inboxes still posted (after a failure) keep swallowing their streams, detached.
        """
        super().release()
        for inbox in self._inboxes.values():
            inbox.op = None
        self._held = _NOTHING_HELD

    def on_timeout(self, error: RingcommError) -> bool:
        # Detach: pieces still in flight are swallowed by the inboxes, never written.
        for inbox in self._inboxes.values():
            inbox.op = None
        return False

    def start(self) -> None:
        raise NotImplementedError

    def run_now(self, deadline: float) -> bool:
        """Fast lane of a blocking call: carry it out at once on the calling thread.

        True: done, ``result`` set (the op never entered the engine's queues). False: run
        it the regular way: submit it unless it is ``started`` already (a fast lane that
        gave up midway hands it over to the engine, started), then wait for it until
        ``deadline`` (a ``time.monotonic()`` instant). The default has no fast lane.
        """
        return False
