"""The progress engine: matching, dispatch and who drives the sockets.

Design (measured, see benchmarks/results/README.md "progress design"): the thread that
waits drives. A blocking call takes the driver lock and polls the receive socket itself,
so a small message costs no thread hand-off (8 B round trip over ipc:// measured 39 us
driven by the caller vs 63 us handed to a progress thread and back). A progress thread
runs only while asynchronous work (``isend``/``irecv``/``async_op=True``) is pending, so
that such work moves while the caller computes; a caller that finds the lock taken waits
on its operation's event and the thread completes it. A driver that leaves (its operation
done) hands the engine over at once: it wakes one waiting thread, which drives next
(:meth:`Progress._hand_over`); the waiters' 5 ms sleep slice is only a backstop.

Operations are small state machines (:class:`Op`): ``start()`` queues the first sends and
posts receivers; receivers are fed pieces in arrival order by :meth:`Progress.dispatch`, so a
piece is copied or reduced as soon as it arrives while later pieces are still on the wire.
Everything below runs under the driver lock except :meth:`Progress.submit`,
:meth:`Progress.wait` and :meth:`Progress.exchange`, which take it themselves.

Fast lane (:meth:`Progress.exchange`): a blocking one-step exchange of one-piece messages
(the small all_reduce) skips ops' bookkeeping while nothing else needs the engine: it sends,
takes its peers' messages off the socket (dispatching everyone else's) and hands the call
over to its regular op on anything unusual. Per call, the Python around two zmq calls is
what a small message costs; measured: 8 B all_reduce W=4 ~360 -> ~210 us, W=2 ~85 -> ~55 us.

Liveness and failure (:meth:`Progress._check_health`, at most every ``HEALTH_CHECK_S``, from
the driving thread's rounds, never per message): the transport reports connections that
dropped (a peer killed, crashed, or silent past the heartbeat timeout). A peer that said
goodbye (``close()`` sends one to everyone) is not a failure; one whose connection dropped
without it is declared failed after ``SUSPECT_GRACE_S`` (its goodbye may still be in
flight). A failure is final for the engine: every unfinished operation of every group
fails with :class:`PeerFailedError` naming the peer and where the operation was, every
later one fails at submission, and the news goes to every other peer as a control
message, so ranks that never talk to the dead one fail as promptly.

Control messages (``KIND_CTRL``, group 0; never matched to receivers, handled at dispatch):
goodbye, peer-failed, and the progress query and its answer: a rank whose operation times
out asks every peer where it is and puts the answers in its error ("progress map").

One outcome per collective: a collective that fails on a rank (a timeout, a mismatch)
makes it send an abort to the group's other ranks (:meth:`Progress.collective_failed`);
they fail that collective and every later one of the group with the first failure's
type and reason (:meth:`Progress.aborted`), including a late rank whose call could
still complete from what was in flight: it looks for aborts before it returns.

Bounded buffering: messages that arrive before their receive is posted wait in an
unexpected queue, capped per sending peer (``max_unexpected_messages``/``_bytes``); a peer
over the cap fails the engine with :class:`QueueLimitError` instead of exhausting memory.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from ringcomm.core.lifecycle import DEPART_ERROR, DEPART_EXIT
from ringcomm.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    GroupClosedError,
    PeerFailedError,
    QueueLimitError,
    RingcommError,
)
from ringcomm.transport.base import (
    EVENT_DISCONNECTED,
    EVENT_HANDSHAKE_OK,
    INLINE_MAX_BYTES,
    ZERO_COPY_MIN_BYTES,
    Completion,
    Stream,
    Transport,
)
from ringcomm.transport.wire import (
    KIND_CTRL,
    KIND_P2P,
    Header,
    WireError,
    pack_header,
    unpack_header,
)

__all__ = [
    "DEPART_CLOSE",
    "DEPART_ERROR",
    "DEPART_EXIT",
    "HEALTH_CHECK_S",
    "INLINE_MAX_BYTES",
    "POLL_SLICE_S",
    "QUERY_WAIT_S",
    "SUSPECT_GRACE_S",
    "WAIT_SLICE_S",
    "ZERO_COPY_MIN_BYTES",
    "AnyReceiver",
    "Op",
    "Progress",
    "Receiver",
    "SerialQueue",
    "Stream",
]

log = logging.getLogger("ringcomm")

#: How often a driving thread looks at connection events (a time check per round).
HEALTH_CHECK_S = 0.05
#: How long a peer whose connection dropped has for its goodbye to arrive.
SUSPECT_GRACE_S = 0.3
#: How long a timed-out operation waits for its peers' answers to "where are you?".
QUERY_WAIT_S = 0.25
#: Defaults of the per-peer cap on buffered unexpected messages.
MAX_UNEXPECTED_MESSAGES = 65536
MAX_UNEXPECTED_BYTES = 1 << 30
#: Shortest wait for goodbyes to be written out at close (even with no linger).
GOODBYE_MIN_S = 0.5
#: Longest a rank going down waits for its farewells to be written out (to a peer that
#: is gone already, libzmq would hold one until then).
FAREWELL_S = 0.25
#: Longest text a rank puts in a control message.
_CTRL_TEXT_MAX = 2000

# Control messages: their tag says what they are (module docstring).
#: Goodbye; its fingerprint says how the sender leaves: None (``close()``), or
#: ``[DEPART_EXIT, ""]`` (its process ended without closing), ``[DEPART_ERROR, why]``
#: (it goes down: an uncaught exception, ``abort()``, a signal).
CTRL_BYE = 1
CTRL_PEER_FAILED = 2
CTRL_QUERY = 3
CTRL_STATE = 4
#: A collective of a group failed at the sender: ``[group id, seq, error type, text, the
#: global rank a PeerFailedError names (-1: none)]``.
CTRL_ABORT = 5
#: The error a peer's abort is raised as, by the name it gives (others: PeerFailedError).
_ABORT_ERRORS: dict[str, type[RingcommError]] = {
    cls.__name__: cls for cls in (CommTimeoutError, CollectiveMismatchError, QueueLimitError)
}

#: How a rank leaves (:meth:`Progress.close`, :meth:`Progress.farewell`); the other two
#: kinds are the process's exit paths (lifecycle.py).
DEPART_CLOSE = "close"
_DEPARTURE_NOTES = {
    DEPART_CLOSE: "it closed its process group",
    DEPART_EXIT: "its process ended without closing its process group",
}

#: Longest a driver blocks in one poll before re-checking deadlines and its operation.
POLL_SLICE_S = 0.05
#: How long the fast lane (a small blocking all_reduce) looks for its messages without
#: sleeping, yielding the core between looks, before it blocks (ZmqTransport.poll).
FAST_LANE_SPIN_S = 200e-6
#: Longest a thread waiting for the driver sleeps before looking again (a backstop: a
#: driver that leaves hands over at once, and an op's completion wakes its thread).
WAIT_SLICE_S = 0.005
#: Most messages dispatched in one round before new submissions are admitted.
MAX_DISPATCH_PER_ROUND = 4096

Key = tuple[int, int, int, int]


class Receiver(Protocol):
    """Takes the pieces of messages with one key. An :class:`Op`, or an object with
    ``op`` (the Op it feeds, None once detached) and ``sealed`` (see ``_needs_more``)."""

    def on_piece(self, header: Header, payload: memoryview) -> bool:
        """Consume one piece; return True when this receiver wants no more pieces."""


class AnyReceiver(Receiver, Protocol):
    """A point-to-point receiver that takes the next message from any of ``sources``
    (:meth:`Progress.post_any`). ``order``: when it was posted
    (:meth:`Progress.next_order`), against receivers for one sender posted meanwhile."""

    order: int
    sources: frozenset[int]

    def bind(self, src: int) -> None:
        """Its message comes from global rank ``src`` (called once, before its first piece)."""


class SerialQueue:
    """Operations that must run one after another (a group's collectives)."""

    __slots__ = ("active", "pending")

    def __init__(self) -> None:
        self.active: Op | None = None
        self.pending: collections.deque[Op] = collections.deque()


class Op:
    """An operation the engine carries out; completion is observed through ``done``."""

    serial: SerialQueue | None = None
    #: Whether the op failing leaves its group failed for good (collectives; not p2p).
    fails_group = True
    #: A collective's ``(group id, sequence number, the group's global ranks)``: its
    #: failure is told to those ranks (one outcome per collective); None: not one.
    collective: tuple[int, int, Sequence[int]] | None = None
    #: Completion callbacks (``Work.add_done_callback``); None until one is added.
    _callbacks: list[Callable[[Op], None]] | None = None

    def __init__(self, progress: Progress, desc: str = "", *, async_op: bool = False) -> None:
        self.progress = progress
        self._desc = desc
        self.async_op = async_op
        self.done = False
        self.error: BaseException | None = None
        self.result: Any = None
        self.started = False
        self._event: threading.Event | None = None  # made only if another thread waits
        self._trackers: collections.deque[Completion] = collections.deque()
        self._settled = False  # all receives/sends issued; only trackers left

    @property
    def desc(self) -> str:
        """What the op is, for messages: 'recv from peer 2 (op recv, tag 7, float32[10])'."""
        return self._desc or self.describe()

    # -- to implement ------------------------------------------------------------------
    def describe(self) -> str:
        """Built only when a message needs it (keeps string formatting off the hot path)."""
        return type(self).__name__

    def start(self) -> None:
        """Queue sends and post receivers. May finish the op right away."""
        raise NotImplementedError

    def progress_note(self) -> str:
        """Where the op is, for timeout messages (e.g. 'step 3/7, piece 2')."""
        return ""

    def where(self) -> str:
        """What the op is and where it is, for the progress map (built only when asked)."""
        note = self.progress_note() if self.started else "queued"
        return self.desc + (f" [{note}]" if note else "")

    def on_timeout(self, error: RingcommError) -> bool:
        """Clean up after a deadline. Return True if the group is still usable."""
        return False

    # -- tracking of zero-copy sends ---------------------------------------------------
    def add_tracker(self, tracker: Completion | None) -> None:
        if tracker is not None and not tracker.done:
            self._trackers.append(tracker)

    def pending_tracker(self) -> Completion | None:
        """The first zero-copy send still in libzmq's hands, once nothing else is left."""
        if not self._settled:
            return None
        while self._trackers and self._trackers[0].done:
            self._trackers.popleft()
        return self._trackers[0] if self._trackers else None

    def settle(self) -> None:
        """Everything is issued and received: finish once libzmq let go of our buffers."""
        self._settled = True
        if not self._trackers or self.pending_tracker() is None:
            self.finish()
        else:
            self.progress.track(self)

    # -- completion --------------------------------------------------------------------
    def finish(self, error: BaseException | None = None) -> None:
        if self.done:
            return
        self.error = error
        self.done = True
        event = self._event
        if event is not None:
            event.set()
        progress = self.progress
        progress._on_finished(self)
        self.release()
        if self._callbacks is not None:
            progress._run_callbacks(self)

    def release(self) -> None:
        """Drop what a finished op no longer needs (called once, by :meth:`finish`).

        A finished op must hold no reference cycle and nothing of the caller's but its
        ``result``, so the caller's arrays are freed as soon as the caller drops them
        (by reference counting: without waiting for the cyclic garbage collector).
        Subclasses extend it (and call it).
        """
        self._trackers.clear()

    def add_callback(self, fn: Callable[[Op], None]) -> bool:
        """Call ``fn(op)`` once the op finishes; False (nothing added) if it is done.

        Safe from any thread: the check and the append happen under the engine's callback
        lock, and :meth:`finish` sets ``done`` before it takes the list under that lock.
        """
        with self.progress._callback_lock:
            if self.done:
                return False
            if self._callbacks is None:
                self._callbacks = []
            self._callbacks.append(fn)
            return True


class Progress:
    """Owns the transport; matches incoming pieces to posted receivers."""

    def __init__(
        self,
        transport: Transport,
        rank: int,
        *,
        max_unexpected_messages: int = MAX_UNEXPECTED_MESSAGES,
        max_unexpected_bytes: int = MAX_UNEXPECTED_BYTES,
        log_ops: bool = False,
    ) -> None:
        self.transport = transport
        self.rank = rank
        self._lock = threading.Lock()
        self._submitted: collections.deque[Op] = collections.deque()
        self._posted: dict[Key, collections.deque[Receiver]] = {}
        # Any-source point-to-point receives (post_any), per (group, tag), in posting
        # order; and the senders of the unexpected point-to-point messages per (group,
        # tag), in arrival order (what an any-source receive takes first).
        self._posted_any: dict[tuple[int, int], collections.deque[AnyReceiver]] = {}
        self._arrivals: dict[tuple[int, int], collections.deque[int]] = {}
        self._orders = itertools.count()
        self._unexpected: dict[Key, collections.deque[tuple[Header, memoryview]]] = {}
        self._loopback: collections.deque[tuple[Header, memoryview]] = collections.deque()
        self._tracking: list[Op] = []
        self._live: set[Op] = set()  # submitted and not finished (failed on close)
        self._closed = False
        self._cv = threading.Condition()
        self._async_pending = 0
        self._thread: threading.Thread | None = None
        self.dropped_frames = 0
        #: Collectives that failed at a peer, per group id: ``(seq, reporting global rank,
        #: error type, text)``, the earliest seq kept (module docstring).
        self.group_aborts: dict[int, tuple[int, int, str, str, int]] = {}
        self.unexpected_count = 0
        self.listeners: list[Callable[[Header], None]] = []
        # Liveness and failure (module docstring).
        self.failure: RingcommError | None = None
        self.failed_peers: set[int] = set()
        self._departed: set[int] = set()  # peers that said goodbye
        self._departure: dict[int, str] = {}  # peer -> how it left (_DEPARTURE_NOTES)
        # Departed peers that a receiver still waits on (or a send goes to): they fail the
        # engine at the start of the next round (found where failing at once is unsafe).
        self._orphaned: set[int] = set()
        self._said_goodbye = False
        self._fast_stream = Stream()  # the fast lane's one-message streams (reset per use)
        self._disconnected: set[int] = set()  # peers whose connection dropped (not back)
        self._suspects: dict[int, float] = {}  # peer -> when its connection dropped
        self._next_health = time.monotonic() + HEALTH_CHECK_S
        # Per-peer accounting of the unexpected queues: src -> [messages, bytes].
        self.max_unexpected_messages = max_unexpected_messages
        self.max_unexpected_bytes = max_unexpected_bytes
        self._unexpected_by_src: dict[int, list[int]] = {}
        # Progress queries (a timed-out op asking its peers where they are).
        self._query_ids = itertools.count(1)
        self._query: tuple[int, dict[int, str]] | None = None
        self._known_src = set(transport.peers()) | {rank}
        #: Log every op's start and end (RINGCOMM_LOG=debug).
        self.log_ops = log_ops
        self._callback_lock = threading.Lock()
        #: Ops whose threads wait for the driver lock (:meth:`_wait_turn`).
        self._waiting: list[Op] = []

    # -- entry points (any thread) -----------------------------------------------------
    def submit(self, op: Op) -> Op:
        """Hand ``op`` to the engine; it starts now if this thread can drive."""
        if self._closed:
            raise GroupClosedError(f"rank {self.rank}: {op.desc}: the process group is closed")
        if self.failure is not None:
            raise self.failed_error(op.desc)
        if op.async_op:
            with self._cv:
                self._async_pending += 1
                self._ensure_thread()
                self._cv.notify()
        self._live.add(op)
        if self._lock.acquire(blocking=False):
            try:
                while self._submitted:  # earlier submissions from other threads go first
                    self._admit(self._submitted.popleft())
                self._admit(op)
            finally:
                self._lock.release()
                if self._waiting:
                    self._hand_over()
        else:
            self._submitted.append(op)
            self.transport.wake()
        return op

    def wait(self, op: Op, timeout_s: float | None, deadline: float | None = None) -> Any:
        """Drive until ``op`` is done; raise its error, or CommTimeoutError at the deadline.

        ``deadline``: a ``time.monotonic()`` instant to stop at, when the call's clock
        started earlier (``timeout_s`` then only names the limit in the error message).
        """
        if deadline is None and timeout_s is not None:
            deadline = time.monotonic() + timeout_s
        while not op.done:
            if self._closed:
                op.finish(GroupClosedError(f"rank {self.rank}: {op.desc}: the process group was closed"))
                break
            remaining = POLL_SLICE_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                self._expire(op, timeout_s)
                break
            tracker = op.pending_tracker() if op._settled else None
            if tracker is not None:
                # Only libzmq's I/O thread can finish this: wait without holding the lock.
                self.transport.wait_sent(tracker, min(remaining, POLL_SLICE_S))
                if self._lock.acquire(blocking=False):
                    try:
                        self._round(0.0)
                    finally:
                        self._lock.release()
                        if self._waiting:
                            self._hand_over()
                continue
            if self._lock.acquire(blocking=False):
                try:
                    if not op.done:
                        self._round(min(remaining, POLL_SLICE_S), until=op)
                finally:
                    self._lock.release()
                    if self._waiting and op.done:  # leaving: someone else drives now
                        self._hand_over()
            else:
                self._wait_turn(op, min(remaining, WAIT_SLICE_S))
        if op.error is not None:
            raise op.error
        return op.result

    def _wait_turn(self, op: Op, timeout_s: float) -> None:
        """Another thread drives: sleep until ``op`` is done or the driver hands over.

        The waiter registers first and only then looks at the lock again, so a driver
        that leaves in between finds it registered (no missed hand-over). ``timeout_s``
        is only a backstop.
        """
        # Safe without a lock: finish() sets ``done`` before it reads ``_event``, and we
        # publish ``_event`` before we read ``done``.
        event = op._event
        if event is None:
            event = op._event = threading.Event()
        waiting = self._waiting
        waiting.append(op)
        try:
            if self._lock.locked() and not op.done:
                event.wait(timeout_s)
        finally:
            waiting.remove(op)
        if not op.done:
            # Woken to drive (or timed out); ``finish`` sets ``done`` before the event,
            # and the caller looks at ``done`` before it waits again.
            event.clear()

    def _hand_over(self) -> None:
        """The driver lock was just released: wake one thread waiting to drive."""
        for op in list(self._waiting):
            if not op.done:
                event = op._event
                if event is not None:
                    event.set()
                return

    def exchange(
        self,
        op: Op,
        header: bytes,
        payload: Any,
        nbytes: int,
        peers: Sequence[int],
        keys: Sequence[Key],
        fp: Any,
        deadline: float,
        reply: tuple[Callable[[list[memoryview]], tuple[bytes, Any]], Sequence[int]] | None = None,
    ) -> list[memoryview] | bool:
        """The fast lane of a blocking one-step exchange (the small all_reduce, ``op``).

        Sends the message ``header`` (packed, without an inline payload) and ``payload``
        (``nbytes``; None: ``header`` is the one-frame message, payload inline) to each of
        ``peers`` (global ranks, not this one) and collects one
        message per ``keys`` entry, on this thread, holding the driver lock throughout.
        Payloads are copied as they are queued (sizes the transport would send zero-copy
        are not taken), so the caller may write its buffer once this returns. Returns

        * the payloads, in ``keys`` order, once each has arrived whole (one piece of
          ``nbytes``) with fingerprint ``fp``;
        * ``False``, having done nothing, when the engine is not idle (another thread
          drives, asynchronous work, queued submissions, loopback or tracked sends, a
          collective of ``op``'s group running), or ``nbytes`` is too large: run ``op``
          the regular way;
        * ``True`` when it gave up after sending: a message on ``keys`` with another
          fingerprint or layout (a mismatch, an abort), the engine needs more than
          dispatching (a submission from another thread, loopback or tracked sends,
          closing), or the messages took longer than one poll slice (``POLL_SLICE_S``, or
          until ``deadline``, a ``time.monotonic()`` instant): a long wait goes the
          regular way, whose rounds let other threads take the lock in between. The
          messages it took are back at the front of the unexpected queue, in order, and
          ``op`` is admitted (so it starts before anything submitted meanwhile): its
          receivers take over as if everything had gone the regular way. ``op`` must not
          send again. Wait for it (an error while sending fails it, as in ``_start``).

        ``reply``: ``(make, to)``: once every message is in, ``make(payloads)`` returns
        a message (header, payload of ``nbytes``) sent to each global rank in ``to``
        before this returns the payloads (the star all_reduce's rank 0). Messages for
        anyone else are dispatched as they arrive, as in a regular round.
        So the fast lane keeps every guarantee of the regular path; it only skips its
        bookkeeping (inboxes, queues, rounds) while nothing else needs the engine.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            serial = op.serial
            if (
                self._closed or self._submitted or self._loopback or self._tracking
                or self._async_pending or (serial is not None and serial.active is not None)
                or nbytes >= ZERO_COPY_MIN_BYTES or self._orphaned
            ):  # fmt: skip
                return False
            if time.monotonic() >= self._next_health:
                self._check_health()
            if self.failure is not None:
                return False  # the regular path raises
            got: dict[Key, tuple[Header, memoryview]] = {}
            try:
                got_all = self._exchange(
                    op, header, payload, nbytes, peers, keys, fp, deadline, got
                )
                if reply is not None and type(got_all) is list:
                    make, to = reply
                    answer, data = make(got_all)
                    send, stream = self.transport.send, self._fast_stream
                    stream.ordered = None
                    for peer in to:  # the op's only message to each peer: nothing to overtake
                        send(peer, stream, answer, data, nbytes)
                return got_all
            except Exception as exc:  # noqa: BLE001 (as in _start: fail the op, not the rank)
                err = (
                    exc
                    if isinstance(exc, RingcommError)
                    else RingcommError(f"rank {self.rank}: {op.desc} failed: {exc!r}")
                )
                if err is not exc:
                    err.__cause__ = exc
                return self._give_back(op, got, err)
            except BaseException:  # KeyboardInterrupt: leave the queues as they were
                self._requeue(got)
                raise
        finally:
            self._lock.release()
            if self._waiting:
                self._hand_over()

    def _exchange(
        self,
        op: Op,
        header: bytes,
        payload: Any,
        nbytes: int,
        peers: Sequence[int],
        keys: Sequence[Key],
        fp: Any,
        deadline: float,
        got: dict[Key, tuple[Header, memoryview]],
    ) -> list[memoryview] | bool:
        """The body of exchange (driver lock held, the engine idle)."""
        transport = self.transport
        stream = self._fast_stream  # the op's only message to each peer: nothing to overtake
        stream.ordered = None
        for peer in peers:
            transport.send(peer, stream, header, payload, nbytes)  # copied: below zero-copy
        for key in keys:  # what arrived before we asked, as post would feed it
            waiting = self._unexpected.get(key)
            if waiting:
                h, data = got[key] = waiting.popleft()
                self.unexpected_count -= 1
                self._unaccount(h.src, data)
                if not waiting:
                    del self._unexpected[key]
                if h.fp != fp or h.npieces != 1 or len(data) != nbytes:
                    return self._give_back(op, got)
        give_up_at = min(deadline, time.monotonic() + POLL_SLICE_S)
        while len(got) < len(keys):
            if self.failure is not None:
                return self._give_back(op, got, self.failed_error(op.desc))
            if self._closed or self._submitted or self._loopback or self._tracking:
                return self._give_back(op, got)
            remaining = give_up_at - time.monotonic()
            if remaining <= 0:
                return self._give_back(op, got)
            if not transport.poll(remaining, FAST_LANE_SPIN_S):
                continue
            ready = True
            while len(got) < len(keys):
                message = self._recv(ready)
                ready = False
                if message is None:
                    break
                if message is False:
                    continue
                h, data = message
                key = (h.src, h.group, h.kind, h.tag)
                if key in got or key not in keys:
                    self.dispatch(h, data)
                    if h.kind == KIND_CTRL and self.group_aborts:
                        aborted = self._abort_for(op)
                        if aborted is not None:  # a peer failed this call
                            return self._give_back(op, got, aborted)
                    continue
                got[key] = message
                if h.fp != fp or h.npieces != 1 or len(data) != nbytes:
                    return self._give_back(op, got)
        return [got[key][1] for key in keys]

    def _give_back(
        self,
        op: Op,
        got: dict[Key, tuple[Header, memoryview]],
        error: BaseException | None = None,
    ) -> bool:
        """``exchange`` gives up: requeue what it took (at the front); admit ``op``, or
        fail it with ``error``."""
        self._requeue(got)
        if error is not None:
            op.started = True
            op.finish(error)
            return True
        self._live.add(op)
        self._admit(op)
        return True

    def _requeue(self, got: dict[Key, tuple[Header, memoryview]]) -> None:
        """Put messages ``exchange`` took back at the front of their unexpected queues."""
        for key, message in got.items():
            waiting = self._unexpected.get(key)
            if waiting is None:
                self._unexpected[key] = waiting = collections.deque()
            waiting.appendleft(message)
            self.unexpected_count += 1
            self._account(message[0].src, message[1])
        got.clear()

    def test(self, op: Op) -> bool:
        """Non-blocking progress for ``Work.done()``."""
        if not op.done and self._lock.acquire(blocking=False):
            try:
                self._round(0.0)
            finally:
                self._lock.release()
                if self._waiting:
                    self._hand_over()
        return op.done

    # -- used by ops (driver lock held) ------------------------------------------------
    def send(
        self, peer: int, stream: Stream | None, header: bytes, payload: Any, nbytes: int
    ) -> Completion | None:
        """Queue one message to global rank ``peer``: ``header`` (packed without an
        inline payload) and ``payload`` (``nbytes``); the transport picks the path
        (transport/base.py; ``stream``: the op's messages, whose order it keeps; None:
        point-to-point, never overtaking). Returns a completion if the payload went
        zero-copy. To ourselves: copied now onto the loopback queue (the caller may reuse
        its buffer once the op completes)."""
        if peer in self._departed:
            self._orphaned.add(peer)
        if peer == self.rank:
            h, inline = unpack_header(header)
            data = bytes(payload) if payload is not None else inline or b""
            self._loopback.append((h, memoryview(data)))
            return None
        return self.transport.send(peer, stream, header, payload, nbytes)

    def post(self, key: Key, receiver: Receiver) -> None:
        """Post a receiver for messages with ``key``; queued pieces are fed to it first."""
        waiting = self._unexpected.get(key)
        while waiting:
            header, payload = waiting.popleft()
            self.unexpected_count -= 1
            self._unaccount(header.src, payload)
            if not waiting:
                del self._unexpected[key]
            if header.kind == KIND_P2P and header.piece == 0:
                self._arrived_taken(header)
            if receiver.on_piece(header, payload):
                return
        q = self._posted.get(key)
        if q is None:
            self._posted[key] = q = collections.deque()
        q.append(receiver)
        if key[0] in self._departed and _needs_more(receiver):  # nothing more can come
            self._orphaned.add(key[0])

    def next_order(self) -> int:
        """A number for a point-to-point receive being posted (``AnyReceiver.order``)."""
        return next(self._orders)

    def post_any(self, group: int, tag: int, receiver: AnyReceiver) -> None:
        """Post a receiver for the next point-to-point message on ``group`` with ``tag``
        from any of ``receiver.sources`` (global ranks), MPI's ``MPI_ANY_SOURCE``.

        It is bound (``receiver.bind(src)``, then posted as for ``src`` alone) to the
        sender of the earliest-arrived such message waiting, else of the first one to
        arrive for which no receive naming its sender was posted earlier. A message is
        never split between receivers, and messages from one sender still match receives
        in the order sent (no overtaking): binding happens only at a message's first piece.
        """
        arrivals = self._arrivals.get((group, tag))
        src = next((s for s in arrivals if s in receiver.sources), None) if arrivals else None
        if src is not None:
            receiver.bind(src)
            self.post((src, group, KIND_P2P, tag), receiver)
            return
        q = self._posted_any.get((group, tag))
        if q is None:
            self._posted_any[(group, tag)] = q = collections.deque()
        q.append(receiver)
        peer = self._all_departed(receiver.sources)
        if peer is not None:  # nobody left who could send it
            self._orphaned.add(peer)

    def unpost_any(self, group: int, tag: int, receiver: AnyReceiver) -> bool:
        """Withdraw an any-source receiver not bound yet; False if it was not posted."""
        q = self._posted_any.get((group, tag))
        if q is None:
            return False
        try:
            q.remove(receiver)
        except ValueError:
            return False
        if not q:
            del self._posted_any[(group, tag)]
        return True

    def _all_departed(self, sources: frozenset[int]) -> int | None:
        """A departed peer among ``sources`` if every one of them but this rank departed
        (an any-source receive then waits for nothing that can come), else None. A
        group of this rank alone never counts as departed."""
        others = [s for s in sources if s != self.rank]
        if others and all(s in self._departed for s in others):
            return max(others)
        return None

    def _arrived_taken(self, header: Header) -> None:
        """The first piece of unexpected point-to-point message ``header`` was taken."""
        where = (header.group, header.tag)
        arrivals = self._arrivals.get(where)
        if arrivals is not None:
            try:
                arrivals.remove(header.src)  # its first entry: per sender in order sent
            except ValueError:
                pass
            if not arrivals:
                del self._arrivals[where]

    def _bind_any(
        self, header: Header, q: collections.deque[Receiver] | None
    ) -> collections.deque[Receiver] | None:
        """At the first piece of a point-to-point message: if an any-source receive
        posted before any receive naming the sender waits, bind it and put it first."""
        anyq = self._posted_any.get((header.group, header.tag))
        if not anyq or header.src not in anyq[0].sources:
            return q
        first = anyq[0]
        if q and getattr(q[0], "order", -1) < first.order:
            return q  # a receive naming the sender was posted earlier: it matches first
        anyq.popleft()
        if not anyq:
            del self._posted_any[(header.group, header.tag)]
        first.bind(header.src)
        key = (header.src, header.group, header.kind, header.tag)
        if q is None:
            self._posted[key] = q = collections.deque()
        q.appendleft(first)
        return q

    def unpost(self, key: Key, receiver: Receiver) -> bool:
        q = self._posted.get(key)
        if q is None:
            return False
        try:
            q.remove(receiver)
        except ValueError:
            return False
        if not q:
            del self._posted[key]
        return True

    def track(self, op: Op) -> None:
        self._tracking.append(op)

    def dispatch(self, header: Header, payload: memoryview) -> None:
        key = (header.src, header.group, header.kind, header.tag)  # header.key, inlined
        q = self._posted.get(key)
        if self._posted_any and header.kind == KIND_P2P and header.piece == 0:
            q = self._bind_any(header, q)
        if q:
            receiver = q[0]
            if receiver.on_piece(header, payload):
                q.popleft()
                if not q:
                    del self._posted[key]
            return
        if header.src not in self._known_src:  # nobody will ever receive it
            self.dropped_frames += 1
            return
        if header.kind == KIND_CTRL:  # never posted for: handled here
            self._on_ctrl(header)
            return
        if not self._account(header.src, payload):
            self.dropped_frames += 1  # over the cap: the engine failed already
            return
        waiting = self._unexpected.get(key)
        if waiting is None:
            self._unexpected[key] = waiting = collections.deque()
        waiting.append((header, payload))
        self.unexpected_count += 1
        if header.kind == KIND_P2P and header.piece == 0:
            where = (header.group, header.tag)
            arrivals = self._arrivals.get(where)
            if arrivals is None:
                self._arrivals[where] = arrivals = collections.deque()
            arrivals.append(header.src)
        for listener in self.listeners:
            listener(header)

    # -- bounded unexpected queues -----------------------------------------------------
    def _account(self, src: int, payload: memoryview) -> bool:
        """Count a message queued as unexpected; False (and fail) when over the cap."""
        counts = self._unexpected_by_src.get(src)
        if counts is None:
            self._unexpected_by_src[src] = counts = [0, 0]
        if src in self.failed_peers:
            return False
        counts[0] += 1
        counts[1] += len(payload)
        if counts[0] > self.max_unexpected_messages or counts[1] > self.max_unexpected_bytes:
            counts[0] -= 1
            counts[1] -= len(payload)
            self._fail_engine(
                QueueLimitError(
                    f"rank {self.rank}: peer rank {src} has {counts[0]} messages "
                    f"({counts[1]} bytes) waiting that no receive was posted for, and sent "
                    f"another: over the cap of {self.max_unexpected_messages} messages / "
                    f"{self.max_unexpected_bytes} bytes per peer "
                    "(RINGCOMM_MAX_UNEXPECTED_MESSAGES / RINGCOMM_MAX_UNEXPECTED_BYTES); "
                    "its sends have no matching receives (or it floods this rank)"
                ),
                peer=src,
                tell_peers=False,
            )
            return False
        return True

    def _unaccount(self, src: int, payload: memoryview) -> None:
        counts = self._unexpected_by_src.get(src)
        if counts is not None:
            counts[0] -= 1
            counts[1] -= len(payload)

    # -- control messages --------------------------------------------------------------
    def _send_ctrl(self, peer: int, tag: int, fp: Any) -> None:
        """Queue a control message to global rank ``peer`` (best effort)."""
        header = pack_header(Header(KIND_CTRL, self.rank, 0, tag, fp=fp))
        try:
            self.transport.send(peer, None, header, b"", 0)
        except Exception as exc:  # noqa: BLE001 (a control message never fails the caller)
            log.debug("rank %d: control message to rank %d not sent: %r", self.rank, peer, exc)

    def _live_peers(self) -> list[int]:
        gone = self.failed_peers | self._departed
        return [p for p in self.transport.peers() if p not in gone and p != self.rank]

    def _on_ctrl(self, header: Header) -> None:
        """Handle a control message (its contents came off the wire: check everything)."""
        src, tag, fp = header.src, header.tag, header.fp
        if tag == CTRL_BYE:
            self._on_goodbye(src, fp)
        elif tag == CTRL_PEER_FAILED and _is_list(fp, 2) and type(fp[0]) is int:
            dead = fp[0]
            if dead != self.rank and dead not in self.failed_peers:
                self._peer_failed(dead, reporter=src, text=str(fp[1])[:_CTRL_TEXT_MAX])
        elif tag == CTRL_QUERY and _is_list(fp, 1) and type(fp[0]) is int:
            self._send_ctrl(src, CTRL_STATE, [fp[0], self.where()[:_CTRL_TEXT_MAX]])
        elif tag == CTRL_STATE and _is_list(fp, 2) and type(fp[0]) is int:
            query = self._query
            if query is not None and query[0] == fp[0]:
                query[1][src] = str(fp[1])[:_CTRL_TEXT_MAX]
        elif tag == CTRL_ABORT and _is_list(fp, 5) and all(type(fp[i]) is int for i in (0, 1, 4)):
            culprit = fp[4] if 0 <= fp[4] != self.rank else src
            self._on_abort(culprit, fp[0], fp[1], str(fp[2])[:64], str(fp[3])[:_CTRL_TEXT_MAX],
                           src)  # fmt: skip
        else:
            self.dropped_frames += 1

    # -- one outcome per collective ----------------------------------------------------
    def collective_failed(
        self, group_id: int, seq: int, error: BaseException, ranks: Sequence[int]
    ) -> None:
        """Collective ``seq`` of group ``group_id`` failed here with ``error``: tell the
        group's other ``ranks`` (global), unless a peer's abort or a failed engine (whose
        news travels anyway) was the cause, or the group was closed here. For a caller
        outside the engine (the shared workspace); the engine's own collectives tell
        their peers when they finish (``Op.collective``)."""
        with self._lock:
            if not self._closed:
                self._send_abort(group_id, seq, error, ranks)

    def _send_abort(
        self, group_id: int, seq: int, error: BaseException, ranks: Sequence[int]
    ) -> None:
        """:meth:`collective_failed`, driver lock held."""
        if self.failure is not None or not isinstance(error, RingcommError):
            return
        if isinstance(error, GroupClosedError):
            return
        known = self.group_aborts.get(group_id)
        if known is not None and known[0] <= seq:
            return  # a peer's abort: every rank of the group heard it from that peer
        peer = getattr(error, "peer", None)
        culprit = peer if isinstance(error, PeerFailedError) and type(peer) is int else -1
        fp = [group_id, seq, type(error).__name__, str(error)[:_CTRL_TEXT_MAX], culprit]
        for peer in ranks:
            if peer != self.rank:
                self._send_ctrl(peer, CTRL_ABORT, fp)

    def _on_abort(
        self, culprit: int, group_id: int, seq: int, kind: str, text: str, src: int
    ) -> None:
        """Peer ``src``'s collective ``seq`` of ``group_id`` failed (because of global rank
        ``culprit``: a PeerFailedError's peer, else ``src``): fail ours from it on."""
        known = self.group_aborts.get(group_id)
        if known is not None and known[0] <= seq:
            return
        self.group_aborts[group_id] = (seq, src, kind, text, culprit)
        for op in list(self._live):
            c = op.collective
            if c is not None and c[0] == group_id and c[1] >= seq:
                if op.serial is not None and op in op.serial.pending:
                    op.serial.pending.remove(op)
                op.finish(self.abort_error(group_id, f"{op.desc}"))

    def abort_error(self, group_id: int, what: str) -> RingcommError:
        """The error a call (``what``) of ``group_id`` raises after a peer's abort: the
        peer's error type and reason (a PeerFailedError names the rank that went)."""
        seq, src, kind, text, culprit = self.group_aborts[group_id]
        message = (
            f"rank {self.rank}: {what}: rank {src} failed collective #{seq} of this group, "
            f"so every rank fails it: {kind}: {text}"
        )
        cls = _ABORT_ERRORS.get(kind)
        return PeerFailedError(message, peer=culprit) if cls is None else cls(message)

    def _abort_for(self, op: Op) -> RingcommError | None:
        """The abort error of collective ``op`` if a peer failed it (or an earlier one)."""
        c = op.collective
        if c is None:
            return None
        known = self.group_aborts.get(c[0])
        if known is None or known[0] > c[1]:
            return None
        return self.abort_error(c[0], op.desc)

    def aborted(self, group_id: int, seq: int, what: str) -> RingcommError | None:
        """After collective ``seq`` of ``group_id`` completed here: the error to raise if
        a peer failed it (its abort may wait behind the pieces this call consumed, so
        what has arrived is dispatched first, when no other thread drives), else None."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed and self.transport.control_waiting():
                    self._drain()
            finally:
                self._lock.release()
        known = self.group_aborts.get(group_id)
        if known is None or known[0] > seq:
            return None
        return self.abort_error(group_id, what)

    def _on_goodbye(self, src: int, fp: Any) -> None:
        """Peer ``src`` leaves: a failure if it goes down with an error; else a departure,
        which fails the engine only if something here still waits on ``src``."""
        self._suspects.pop(src, None)
        if src in self._departed:
            return
        self._departed.add(src)
        kind = fp[0] if _is_list(fp, 2) else DEPART_CLOSE
        if kind == DEPART_ERROR:
            why = str(fp[1])[:_CTRL_TEXT_MAX]
            self._fail_engine(
                PeerFailedError(f"rank {self.rank}: peer rank {src} exited: {why}", peer=src),
                peer=src,
            )
            return
        self._departure[src] = _DEPARTURE_NOTES.get(kind, _DEPARTURE_NOTES[DEPART_CLOSE])
        # Every message src sent before its goodbye was dispatched before it: a receiver
        # still posted for src waits for nothing that can come.
        if any(key[0] == src and any(map(_needs_more, q)) for key, q in self._posted.items()):
            self._orphaned.add(src)
            self._fail_orphaned()
            return
        for q in list(self._posted_any.values()):  # every possible sender of one gone
            if any(map(_needs_more, q)) and self._all_departed(q[0].sources) is not None:
                self._orphaned.add(src)
                self._fail_orphaned()
                return

    def _fail_orphaned(self) -> None:
        """Fail the engine for a departed peer that something here still needs."""
        peer = min(self._orphaned)
        self._orphaned.clear()
        note = self._departure.get(peer, _DEPARTURE_NOTES[DEPART_CLOSE])
        self._fail_engine(
            PeerFailedError(
                f"rank {self.rank}: peer rank {peer} left the group ({note}) while this "
                "rank still expected messages from it or sent it more",
                peer=peer,
            ),
            peer=peer,
        )

    def where(self) -> str:
        """Where this rank is: each unfinished operation and its progress."""
        ops = sorted(self._live, key=id)
        if not ops:
            return "no operation in progress"
        parts = [op.where() for op in ops[:8]]
        if len(ops) > 8:
            parts.append(f"... {len(ops) - 8} more")
        return "; ".join(parts)

    def progress_map(self, wait_s: float = QUERY_WAIT_S) -> str:
        """Ask every live peer where it is (answers within ``wait_s``); lines per rank.

        Driver lock held. Peers answer from their own driving thread, so a peer busy
        outside ringcomm (or hung, or dead) shows as not answering.
        """
        peers = self._live_peers()
        qid = next(self._query_ids)
        answers: dict[int, str] = {}
        self._query = (qid, answers)
        try:
            for peer in peers:
                self._send_ctrl(peer, CTRL_QUERY, [qid])
            give_up_at = time.monotonic() + wait_s
            while len(answers) < len(peers):
                remaining = give_up_at - time.monotonic()
                if remaining <= 0 or self._closed:
                    break
                if self.transport.poll(remaining):
                    self._drain(ready=True)
        finally:
            self._query = None
        lines = [f"  rank {self.rank} (this rank): {self.where()}"]
        for peer in self.transport.peers():
            if peer == self.rank:
                continue
            if peer in answers:
                lines.append(f"  rank {peer}: {answers[peer]}")
            elif peer in self.failed_peers:
                lines.append(f"  rank {peer}: failed")
            elif peer in self._departed:
                lines.append(f"  rank {peer}: left the group ({self._departure.get(peer)})")
            else:
                lines.append(
                    f"  rank {peer}: no answer within {wait_s:g} s (busy outside ringcomm, "
                    "hung, or unreachable)"
                )
        return "where each rank was:\n" + "\n".join(lines)

    # -- liveness and failure ----------------------------------------------------------
    def _check_health(self, drain: bool = True) -> None:
        """Look at connection events; declare peers failed (driver lock held).

        ``drain=False``: from inside a dispatch (a wait for a zero-copy release), where
        the socket must not be read; a goodbye still waiting there is then not seen.
        """
        now = time.monotonic()
        self._next_health = now + HEALTH_CHECK_S
        for peer, event in self.transport.poll_events():
            if event == EVENT_DISCONNECTED:
                self._disconnected.add(peer)
                if peer in self._departed or peer in self.failed_peers:
                    continue
                if self._said_goodbye:
                    # We are closing (every operation is over): a peer that had our
                    # goodbye may leave without one of its own to us (the store's host
                    # still waits for check-outs then): a departure, not a failure.
                    self._departed.add(peer)
                    self._departure[peer] = _DEPARTURE_NOTES[DEPART_CLOSE]
                    log.debug("rank %d: rank %d disconnected after our goodbye", self.rank, peer)
                else:
                    self._suspects.setdefault(peer, now)
            elif event == EVENT_HANDSHAKE_OK:
                self._suspects.pop(peer, None)  # reconnected: alive after all
                self._disconnected.discard(peer)
        if not self._suspects:
            return
        due = [p for p, t in self._suspects.items() if now - t >= SUSPECT_GRACE_S]
        if not due:
            return
        if drain:
            self._drain()  # a goodbye may be waiting on the socket
        for peer in due:
            if self._suspects.pop(peer, None) is not None and peer not in self._departed:
                self._peer_failed(peer)

    def check_health(self) -> None:
        """:meth:`_check_health` from any thread, if the driver lock is free."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._check_health()
            finally:
                self._lock.release()

    def _peer_failed(self, peer: int, reporter: int | None = None, text: str = "") -> None:
        if reporter is None and peer in self.transport.refused_by:
            why = (
                f"peer rank {peer} refused this rank's data-plane login: token mismatch (or "
                "a reconnection, whose login was used already); every rank must use the "
                "job's token"
            )
        elif reporter is None:
            why = (
                f"peer rank {peer} failed: its connection dropped without a goodbye "
                f"(killed, crashed, or silent for {self.transport.heartbeat_timeout_s:g} s)"
            )
        else:
            why = f"peer rank {peer} failed (reported by rank {reporter}: {text})"
        self._fail_engine(PeerFailedError(f"rank {self.rank}: {why}", peer=peer), peer=peer)

    def _fail_engine(self, error: RingcommError, peer: int, tell_peers: bool = True) -> None:
        """The engine fails for good: every unfinished op and every later one raise."""
        self.failed_peers.add(peer)
        if self.failure is not None:
            return
        self.failure = error
        log.warning("%s", error)
        if tell_peers:
            for q in self._live_peers():
                self._send_ctrl(q, CTRL_PEER_FAILED, [peer, str(error)[:_CTRL_TEXT_MAX]])
        for op in list(self._live):
            if op.done:
                continue
            if op.serial is not None and op in op.serial.pending:
                op.serial.pending.remove(op)
            note = op.progress_note() if op.started else "queued"
            err = self.failed_error(op.desc + (f" [{note}]" if note else ""))
            if op.started:
                try:
                    op.on_timeout(err)  # detach receivers: later pieces are discarded
                except Exception as exc:  # noqa: BLE001
                    log.debug("rank %d: %s: detaching failed: %r", self.rank, op.desc, exc)
            op.finish(err)

    def failed_error(self, what: str) -> RingcommError:
        """A fresh error for ``what`` (an op) after the engine failed."""
        failure = self.failure
        assert failure is not None
        text = f"rank {self.rank}: {what}: the process group failed: {failure}"
        if isinstance(failure, PeerFailedError):
            return PeerFailedError(text, peer=failure.peer)
        err = type(failure)(text)
        err.__cause__ = failure
        return err

    # -- the round ---------------------------------------------------------------------
    def _round(self, timeout_s: float, until: Op | None = None) -> None:
        """One progress round: admit, deliver loopback, check trackers, poll, dispatch.

        With ``until``, dispatching stops as soon as that op is done (its caller returns
        without paying for another look at the socket).
        """
        if self._orphaned:
            self._fail_orphaned()
        while self._submitted:
            self._admit(self._submitted.popleft())
        while self._loopback:
            self.dispatch(*self._loopback.popleft())
        if time.monotonic() >= self._next_health:
            self._check_health()
        if self._tracking:
            still = []
            for op in self._tracking:
                if not op.done and op.pending_tracker() is None:
                    op.finish()
                elif not op.done:
                    still.append(op)
            self._tracking = still
            del op  # a finished op must not outlive the loop in this (polling) frame
            if still:
                # Trackers finish on pyzmq's gc thread, which cannot wake a poll: look again
                # every millisecond (zmq poll's resolution) rather than spin and starve it.
                timeout_s = min(timeout_s, 0.001)
        if self._submitted or self._loopback:
            timeout_s = 0.0
        if timeout_s <= 0.0 or (until is not None and until.done):
            self._drain(until)
            return
        # A poll returns at once if a message is already waiting, and finds out in C
        # what a look from Python (recv_first) costs a microsecond to ask.
        if self.transport.poll(timeout_s):
            self._drain(until, ready=True)

    def _drain(self, until: Op | None = None, ready: bool = False) -> int:
        """Dispatch what has arrived (without blocking); return how many messages.

        ``ready``: a poll just said a message is waiting.
        """
        n = 0
        for n in range(1, MAX_DISPATCH_PER_ROUND + 1):
            if until is not None and until.done:
                return n - 1
            message = self._recv(ready)
            ready = False
            if message is None:
                return n - 1
            if message is not False:
                self.dispatch(*message)
        return n

    def _recv(self, ready: bool = False) -> tuple[Header, memoryview] | Literal[False] | None:
        """The next message as ``(header, payload)`` without blocking; None if none is
        waiting; False for a malformed one (dropped and counted).

        ``ready``: a poll just said a message is waiting.
        """
        transport = self.transport
        first = transport.recv_first(ready)
        if first is None:
            return None
        raw_header, more = first
        try:
            header, inline = unpack_header(raw_header)
        except WireError:
            if more:
                transport.recv_payload(copy=True)
            self.dropped_frames += 1
            return False
        if inline is not None:
            if more:  # an inline payload and a payload frame: malformed
                transport.recv_payload(copy=True)
                self.dropped_frames += 1
                return False
            return header, memoryview(inline)
        if more:
            # Small payloads are copied out of libzmq (cheaper than a zero-copy frame).
            payload = transport.recv_payload(header.nbytes < ZERO_COPY_MIN_BYTES, header.src)
            if payload is False:
                self.dropped_frames += 1
                return False
            return header, payload  # type: ignore[return-value]
        self.dropped_frames += 1  # a header without its payload
        return False

    def _admit(self, op: Op) -> None:
        serial = op.serial
        if serial is not None:
            if serial.active is not None:
                serial.pending.append(op)
                return
            serial.active = op
        self._start(op)

    def _start(self, op: Op) -> None:
        op.started = True
        if self.log_ops:
            log.debug("rank %d: start %s", self.rank, op.desc)
        if self.group_aborts:
            aborted = self._abort_for(op)
            if aborted is not None:  # a peer failed this collective already
                op.finish(aborted)
                return
        try:
            op.start()
        except RingcommError as exc:
            op.finish(exc)
        except Exception as exc:  # noqa: BLE001 (a bug or bad input found late: fail the op)
            err = RingcommError(f"rank {self.rank}: {op.desc} failed: {exc!r}")
            err.__cause__ = exc
            op.finish(err)

    def _on_finished(self, op: Op) -> None:
        self._live.discard(op)
        if op.error is not None and op.collective is not None and not self._closed:
            group_id, seq, ranks = op.collective
            self._send_abort(group_id, seq, op.error, ranks)  # (driver lock held)
        if self.log_ops:
            if op.error is None:
                log.debug("rank %d: end %s", self.rank, op.desc)
            else:
                log.debug("rank %d: failed %s: %s", self.rank, op.desc, op.error)
        if op.async_op:
            with self._cv:
                self._async_pending -= 1
        serial = op.serial
        if serial is not None and serial.active is op:
            serial.active = None
            while serial.pending and serial.active is None:
                nxt = serial.pending.popleft()
                if nxt.done:  # failed while queued (group aborted)
                    continue
                serial.active = nxt
                self._start(nxt)

    def _run_callbacks(self, op: Op) -> None:
        """Run ``op``'s completion callbacks (once; on the thread that finished it).

        A callback's exception is logged, never raised into the engine."""
        with self._callback_lock:
            callbacks, op._callbacks = op._callbacks, None
        for fn in callbacks or ():
            try:
                fn(op)
            except Exception:  # a user callback never breaks the engine
                log.exception("rank %d: a completion callback of %s failed", self.rank, op.desc)

    def _expire(self, op: Op, timeout_s: float | None) -> None:
        with self._lock:
            if op.done:
                return
            note = op.progress_note()
            where = ""
            if not self._closed and self.failure is None and self.transport.peers():
                where = "\n" + self.progress_map()
                if op.done:  # it finished while we asked around
                    return
            err = CommTimeoutError(
                f"rank {self.rank}: {op.desc} timed out after {timeout_s:g} s"
                + (f" ({note})" if note else "")
                + where
            )
            if not op.started:
                # Still queued behind another collective: remove it from its queue.
                if op.serial is not None and op in op.serial.pending:
                    op.serial.pending.remove(op)
                op.finish(err)
                return
            op.on_timeout(err)
            op.finish(err)

    # -- progress thread ---------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._thread_main, name=f"ringcomm-progress-r{self.rank}", daemon=True
            )
            self._thread.start()

    def _thread_main(self) -> None:
        while True:
            with self._cv:
                while self._async_pending <= 0 and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
            if self._lock.acquire(timeout=POLL_SLICE_S):
                try:
                    if not self._closed:
                        self._round(0.02)
                except Exception:  # noqa: BLE001 (never let the thread die silently mid-job)
                    import traceback

                    traceback.print_exc()
                finally:
                    self._lock.release()
                    if self._waiting and self._async_pending <= 0:  # going to sleep
                        self._hand_over()

    # -- closing -----------------------------------------------------------------------
    def _say_goodbye(self, linger_s: float, kind: str = DEPART_CLOSE) -> None:
        """Tell every live peer we are leaving (so our disconnection is no failure) and
        wait, up to ``linger_s``, until libzmq took each goodbye (and so everything queued
        before it) off its queue, or the peer left or failed itself (the close then
        lingers briefly on live peers' sockets to flush libzmq's last write batch). A peer that closed first can
        never take our goodbye: waiting for it (libzmq's linger) would cost the whole
        ``linger_s``, so the wait ends for it as soon as its own goodbye is read."""
        self._read_control()
        linger_s = max(linger_s, GOODBYE_MIN_S)  # even a failed group says goodbye
        fp = None if kind == DEPART_CLOSE else [kind, ""]
        frame = pack_header(Header(KIND_CTRL, self.rank, 0, CTRL_BYE, fp=fp), b"")
        pending = {}
        for peer in self._live_peers():
            try:
                pending[peer] = self.transport.send_tracked(peer, frame)
            except Exception as exc:  # noqa: BLE001 (best effort, as every control message)
                log.debug("rank %d: goodbye to rank %d not sent: %r", self.rank, peer, exc)
        give_up_at = time.monotonic() + linger_s
        while True:
            gone = self.failed_peers | self._departed
            pending = {p: t for p, t in pending.items() if not t.done and p not in gone}
            remaining = give_up_at - time.monotonic()
            if not pending or remaining <= 0:
                return
            if self.transport.poll(min(remaining, 0.005)):
                self._read_control()

    def _read_control(self) -> None:
        """Take what arrived off the socket, acting on goodbyes and failure reports only
        (the group is closing: nothing may reach a receiver any more)."""
        for _ in range(MAX_DISPATCH_PER_ROUND):
            message = self._recv()
            if message is None:
                return
            if message is not False and message[0].kind == KIND_CTRL:
                header = message[0]
                if header.src in self._known_src and header.tag in (CTRL_BYE, CTRL_PEER_FAILED):
                    self._on_ctrl(header)

    def read_control(self) -> None:
        """Before closing (every operation finished): act on the goodbyes and failure
        reports that arrived, and on dropped connections, so the caller knows who is gone
        (:attr:`failure`, :meth:`departed`)."""
        with self._lock:
            if not self._closed:
                self._read_control()
                self._check_health(drain=False)

    def wait_disconnected(self, peer: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until the connection to global rank ``peer`` drops
        (its process ended, wherever it ran); True if it did."""
        give_up_at = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._closed:
                    return False
                self._check_health(drain=False)
                if peer in self._disconnected:
                    return True
            if time.monotonic() >= give_up_at:
                return False
            time.sleep(0.01)

    def departed(self, peer: int) -> bool:
        """Whether global rank ``peer`` said goodbye or failed."""
        return peer in self._departed or peer in self.failed_peers

    def departure_note(self, peer: int) -> str:
        """How global rank ``peer`` left ("it closed its process group", ...), once it did."""
        return self._departure.get(peer, _DEPARTURE_NOTES[DEPART_CLOSE])

    def peer_failed(self, error: PeerFailedError) -> None:
        """A caller outside the engine (the shared workspace) found ``error.peer`` dead:
        fail as the engine does when a connection drops (every op, peers told)."""
        peer = error.peer
        assert peer is not None
        with self._lock:
            if not self._closed:
                self._fail_engine(error, peer=peer)

    def poll_now(self) -> None:
        """One round without blocking, if no other thread drives: for a caller that waits
        outside the engine (the shared workspace) and must still hear goodbyes, failure
        reports and dropped connections."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._round(0.0)
                    self._check_health()
            finally:
                self._lock.release()

    def farewell(
        self, why: str, timeout_s: float = FAREWELL_S, skip: Callable[[int], bool] | None = None
    ) -> None:
        """Tell every live peer this rank goes down because of ``why`` (their calls then
        raise :class:`PeerFailedError` saying ``rank N exited: why``).

        Takes no lock and touches no data socket (:meth:`ZmqTransport.send_farewell`), so
        it may run from a signal handler that interrupted this engine's driver.
        ``skip(peer)``: True for peers not to tell (known to be gone).
        """
        fp = [DEPART_ERROR, why[:_CTRL_TEXT_MAX]]
        frame = pack_header(Header(KIND_CTRL, self.rank, 0, CTRL_BYE, fp=fp), b"")
        # Peers that said goodbye are told too (one may still wait for check-outs); not
        # those that dropped without one (dead: a farewell to them would only linger).
        try:
            dead = self.failed_peers - self._departed
            peers = [p for p in self.transport.peers() if p != self.rank and p not in dead]
        except RuntimeError:  # a set changed under us (another thread): tell everyone
            peers = [p for p in self.transport.peers() if p != self.rank]
        if skip is not None:  # e.g. peers known to be gone
            peers = [p for p in peers if not skip(p)]
        self.transport.send_farewell(frame, peers, timeout_s)

    def abort(self, error_for: Callable[[Op], BaseException], group: int | None = None) -> None:
        """Fail every unfinished operation (all, or those of one group id)."""
        with self._lock:
            for op in list(self._live):
                if group is None or getattr(op, "group_id", None) == group:
                    if op.serial is not None and op in op.serial.pending:
                        op.serial.pending.remove(op)
                    op.finish(error_for(op))

    def say_goodbye(self, linger_s: float, kind: str = DEPART_CLOSE) -> None:
        """Tell every live peer this rank leaves (``kind``), before :meth:`close`: peers
        waiting on it fail at once instead of when the transport closes."""
        with self._lock:
            if not self._closed and not self._said_goodbye:
                self._said_goodbye = True
                self._say_goodbye(linger_s, kind)

    def close(self, linger_s: float | None = None, kind: str = DEPART_CLOSE) -> None:
        """Finish every operation (GroupClosedError), say goodbye unless
        :meth:`say_goodbye` did (``kind``: how this rank leaves; none for
        :data:`DEPART_ERROR`, whose :meth:`farewell` was sent), close the transport."""
        if self._closed:
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self.transport.wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._lock:
            for op in list(self._live):
                op.finish(GroupClosedError(f"rank {self.rank}: {op.desc}: the process group was closed"))
            # Goodbyes written out (tracked) leave libzmq's batch buffer only on a
            # lingering close: live peers get a short linger, gone ones none.
            if kind == DEPART_ERROR:
                self.transport.close(0.0)
            else:
                if not self._said_goodbye:
                    self._say_goodbye(
                        self.transport.linger_s if linger_s is None else linger_s, kind
                    )
                self.transport.close(GOODBYE_MIN_S, abandon=self.failed_peers | self._departed)
            self._posted.clear()
            self._posted_any.clear()
            self._arrivals.clear()
            self._unexpected.clear()
            self._loopback.clear()


def _needs_more(receiver: Receiver) -> bool:
    """Whether ``receiver`` feeds an unfinished operation. A receiver is an :class:`Op`
    itself, or exposes the one it feeds as ``op`` (None once detached) and ``sealed``
    (True: it only swallows what is left of a failed call's stream)."""
    if getattr(receiver, "sealed", False):
        return False
    op = receiver if isinstance(receiver, Op) else getattr(receiver, "op", None)
    return op is not None and not op.done


def _is_list(value: Any, n: int) -> bool:
    return type(value) is list and len(value) == n
