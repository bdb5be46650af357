"""The progress engine: who drives the transport, and the operations it carries out.

An operation is a small state machine (:class:`Op`): ``start()`` queues its first sends and
posts receivers, which are fed pieces in arrival order, so a piece is copied or reduced as
soon as it arrives while later ones are still on the wire. The thread that waits drives: a
blocking call takes the driver lock and polls the transport itself; a progress thread runs
only while asynchronous work is pending; a driver that leaves hands the engine to one
waiting thread at once. :class:`Progress` composes the concerns, each in its own module:
matching (:mod:`~ringcomm.core.matching`), peer liveness (:mod:`~ringcomm.core.health`),
one outcome per collective (:mod:`~ringcomm.core.aborts`), control messages
(:mod:`~ringcomm.core.control`) and the fast lane (:mod:`~ringcomm.core.fastlane`).
Everything runs under the driver lock but the entry points, which take it themselves. A
failure of the engine is final: every unfinished and every later operation fails.
See docs/architecture.md, "The progress engine".
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ringcomm.core.aborts import GroupAborts
from ringcomm.core.control import CTRL_ABORT, send_ctrl
from ringcomm.core.dispatch import QUERY_WAIT_S, Dispatcher
from ringcomm.core.fastlane import FastLane
from ringcomm.core.health import (
    DEPART_CLOSE,
    FAREWELL_S,
    GOODBYE_MIN_S,
    HEALTH_CHECK_S,
    SUSPECT_GRACE_S,
    Health,
)
from ringcomm.core.lifecycle import DEPART_ERROR, DEPART_EXIT
from ringcomm.core.matching import (
    MAX_UNEXPECTED_BYTES,
    MAX_UNEXPECTED_MESSAGES,
    AnyReceiver,
    Key,
    Matching,
    Message,
    Receiver,
)
from ringcomm.core.op import Op, SerialQueue, needs_more
from ringcomm.errors import CommTimeoutError, GroupClosedError, PeerFailedError, RingcommError
from ringcomm.transport.base import (
    INLINE_MAX_BYTES,
    ZERO_COPY_MIN_BYTES,
    Completion,
    Stream,
    Transport,
)
from ringcomm.transport.wire import Header, unpack_header

__all__ = [
    "DEPART_CLOSE",
    "DEPART_ERROR",
    "DEPART_EXIT",
    "HEALTH_CHECK_S",
    "INLINE_MAX_BYTES",
    "MAX_UNEXPECTED_BYTES",
    "MAX_UNEXPECTED_MESSAGES",
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

#: Longest a driver blocks in one poll before re-checking deadlines and its operation
#: (and longest the fast lane waits before it hands its call over to the regular path).
POLL_SLICE_S = 0.05
#: Longest a thread waiting for the driver sleeps before looking again (a backstop: a
#: driver that leaves hands over at once, and an op's completion wakes its thread).
WAIT_SLICE_S = 0.005


class Progress:
    """Owns the transport; drives it and carries out operations (module docstring).

    Its parts, each used under the driver lock: :attr:`matching` (posted receivers and
    unexpected messages; ``post``, ``dispatch``... are its bound methods), :attr:`dispatcher`
    (reading the transport, control messages), :attr:`health` (peers' liveness, the
    engine's failure), :attr:`aborts` (collectives peers failed) and :attr:`fast_lane`.
    """

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
        self._loopback: collections.deque[Message] = collections.deque()
        self._tracking: list[Op] = []
        self._live: set[Op] = set()  # submitted and not finished (failed on close)
        self._closed = False
        self._cv = threading.Condition()
        self._async_pending = 0
        self._thread: threading.Thread | None = None
        self.health = health = Health(transport, rank, self._fail_live_ops, self._drain_arrived)
        self.matching = matching = Matching(
            rank,
            health,
            self._on_ctrl,
            needs_more,
            transport.peers(),
            max_unexpected_messages,
            max_unexpected_bytes,
        )
        self.aborts = aborts = GroupAborts(rank)
        self.dispatcher = dispatcher = Dispatcher(
            transport,
            rank,
            matching,
            health,
            aborts,
            self.where,
            self._fail_collectives,
            self._is_closed,
        )
        self.fast_lane = FastLane(transport, matching, health, aborts, dispatcher.recv, self._busy)
        # Matching's entry points, bound once (no extra call per message).
        self.dispatch = matching.dispatch
        self.post = matching.post
        self.unpost = matching.unpost
        self.post_any = matching.post_any
        self.unpost_any = matching.unpost_any
        self.next_order = matching.next_order
        #: Log every op's start and end (RINGCOMM_LOG=debug).
        self.log_ops = log_ops
        #: Guards each op's completion callbacks (:meth:`Op.add_callback`).
        self.callback_lock = threading.Lock()
        #: Ops whose threads wait for the driver lock (:meth:`_wait_turn`).
        self._waiting: list[Op] = []

    # -- what callers read of the parts ------------------------------------------------
    @property
    def failure(self) -> RingcommError | None:
        """The engine's failure, once it failed (final)."""
        return self.health.failure

    @property
    def failed_peers(self) -> set[int]:
        return self.health.failed_peers

    @property
    def group_aborts(self) -> dict[int, tuple[int, int, str, str, int]]:
        """Collectives that failed at a peer, per group id: ``(seq, reporting global rank,
        error type, text, the global rank to blame)``, the earliest seq kept."""
        return self.aborts.known

    @property
    def unexpected_count(self) -> int:
        return self.matching.unexpected_count

    @property
    def dropped_frames(self) -> int:
        return self.matching.dropped_frames

    @property
    def max_unexpected_messages(self) -> int:
        return self.matching.max_unexpected_messages

    @property
    def max_unexpected_bytes(self) -> int:
        return self.matching.max_unexpected_bytes

    # -- entry points (any thread) -----------------------------------------------------
    def submit(self, op: Op) -> Op:
        """Hand ``op`` to the engine; it starts now if this thread can drive."""
        if self._closed:
            raise GroupClosedError(f"rank {self.rank}: {op.desc}: the process group is closed")
        if self.health.failure is not None:
            raise self.health.failed_error(op.desc)
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
                op.finish(
                    GroupClosedError(f"rank {self.rank}: {op.desc}: the process group was closed")
                )
                break
            remaining = POLL_SLICE_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                self._expire(op, timeout_s)
                break
            tracker = op.pending_tracker() if op.settled else None
            if tracker is not None:
                # Only libzmq's I/O thread can finish this: wait without holding the lock.
                self.transport.wait_sent(tracker, min(remaining, POLL_SLICE_S))
                self._try_round()
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
        # Safe without a lock: finish() sets ``done`` before it reads the event, and
        # turn_event() publishes it before we read ``done``.
        event = op.turn_event()
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
                op.wake()
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
        ``peers`` (global ranks, not this one) and collects one message per ``keys``
        entry, on this thread, holding the driver lock throughout. Payloads are copied as
        they are queued, so the caller may write its buffer once this returns. Returns

        * the payloads, in ``keys`` order, once each has arrived whole with fingerprint
          ``fp`` (``reply``: ``(make, to)``: ``make(payloads)`` is first sent to each
          global rank in ``to``, as :meth:`FastLane.reply`);
        * ``False``, having done nothing, when the engine is not idle or ``nbytes`` is
          too large: run ``op`` the regular way;
        * ``True`` when it gave up after sending (:mod:`~ringcomm.core.fastlane`; at the
          latest after one poll slice, or at ``deadline``, a ``time.monotonic()``
          instant): ``op`` is admitted, or failed, and its receivers take over as if
          everything had gone the regular way. ``op`` must not send again; wait for it.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            serial = op.serial
            health = self.health
            if (
                self._closed or self._submitted or self._loopback or self._tracking
                or self._async_pending or (serial is not None and serial.active is not None)
                or nbytes >= ZERO_COPY_MIN_BYTES or health.orphaned
            ):  # fmt: skip
                return False
            if time.monotonic() >= health.next_check:
                health.check()
            if health.failure is not None:
                return False  # the regular path raises
            got: dict[Key, Message] = {}
            try:
                lane = self.fast_lane
                result = lane.run(
                    op, header, payload, nbytes, peers, keys, fp, deadline, POLL_SLICE_S, got
                )
                if not isinstance(result, list):
                    return self._give_back(op, got, result)
                if reply is not None:
                    lane.reply(reply[0], reply[1], result, nbytes)
                return result
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
                self.matching.requeue(got)
                raise
        finally:
            self._lock.release()
            if self._waiting:
                self._hand_over()

    def _busy(self) -> bool:
        """Whether the engine needs more than dispatching (the fast lane gives up)."""
        return bool(self._closed or self._submitted or self._loopback or self._tracking)

    def _give_back(
        self,
        op: Op,
        got: dict[Key, Message],
        error: BaseException | None = None,
    ) -> bool:
        """``exchange`` gives up: requeue what it took (at the front); admit ``op``, or
        fail it with ``error``."""
        self.matching.requeue(got)
        if error is not None:
            op.started = True
            op.finish(error)
            return True
        self._live.add(op)
        self._admit(op)
        return True

    def test(self, op: Op) -> bool:
        """Non-blocking progress for ``Work.done()``."""
        if not op.done:
            self._try_round()
        return op.done

    def _try_round(self) -> None:
        """One round without blocking, if no other thread drives (then wake one waiting to
        drive, as every driver that leaves does)."""
        if self._lock.acquire(blocking=False):
            try:
                self._round(0.0)
            finally:
                self._lock.release()
                if self._waiting:
                    self._hand_over()

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
        health = self.health
        if peer in health.departed:
            health.orphaned.add(peer)
        if peer == self.rank:
            h, inline = unpack_header(header)
            data = bytes(payload) if payload is not None else inline or b""
            self._loopback.append((h, memoryview(data)))
            return None
        return self.transport.send(peer, stream, header, payload, nbytes)

    def track(self, op: Op) -> None:
        """Finish ``op`` once libzmq let go of its zero-copy sends (:meth:`Op.settle`)."""
        self._tracking.append(op)

    # -- the parts' callbacks into the engine ------------------------------------------
    def _on_ctrl(self, header: Header) -> None:
        """A control message arrived (:meth:`Dispatcher.on_ctrl`)."""
        self.dispatcher.on_ctrl(header)

    def _drain_arrived(self) -> None:
        """Dispatch what has arrived (for :meth:`Health.check`)."""
        self.dispatcher.drain()

    def _is_closed(self) -> bool:
        return self._closed

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
        if self.health.failure is not None:
            return
        fp = self.aborts.message(group_id, seq, error)
        if fp is None:
            return
        for peer in ranks:
            if peer != self.rank:
                send_ctrl(self.transport, self.rank, peer, CTRL_ABORT, fp)

    def _fail_collectives(self, group_id: int, seq: int) -> None:
        """A peer aborted collective ``seq`` of ``group_id``: fail ours from it on."""
        for op in list(self._live):
            c = op.collective
            if c is not None and c[0] == group_id and c[1] >= seq:
                if op.serial is not None and op in op.serial.pending:
                    op.serial.pending.remove(op)
                op.finish(self.aborts.error(group_id, f"{op.desc}"))

    def abort_error(self, group_id: int, what: str) -> RingcommError:
        """The error a call (``what``) of ``group_id`` raises after a peer's abort: the
        peer's error type and reason (a PeerFailedError names the rank that went)."""
        return self.aborts.error(group_id, what)

    def aborted(self, group_id: int, seq: int, what: str) -> RingcommError | None:
        """After collective ``seq`` of ``group_id`` completed here: the error to raise if
        a peer failed it (its abort may wait behind the pieces this call consumed, so
        what has arrived is dispatched first, when no other thread drives), else None."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed and self.transport.control_waiting():
                    self.dispatcher.drain()
            finally:
                self._lock.release()
        if not self.aborts.failed(group_id, seq):
            return None
        return self.aborts.error(group_id, what)

    # -- where everyone is -------------------------------------------------------------
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
        Driver lock held (:meth:`Dispatcher.progress_map`)."""
        return self.dispatcher.progress_map(wait_s)

    # -- liveness and failure ----------------------------------------------------------
    def check_health_if_due(self, now: float, drain: bool = True) -> None:
        """Driver lock held: look at connection events if :data:`HEALTH_CHECK_S` passed
        since the last look (``now``: ``time.monotonic()``). ``drain=False``: from inside
        a dispatch (a wait for a zero-copy release), where the socket must not be read."""
        health = self.health
        if now >= health.next_check:
            health.check(drain)

    def check_health(self) -> None:
        """Look at connection events from any thread, if the driver lock is free."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self.health.check()
            finally:
                self._lock.release()

    def failed_error(self, what: str) -> RingcommError:
        """A fresh error for ``what`` (an op) after the engine failed."""
        return self.health.failed_error(what)

    def _fail_live_ops(self) -> None:
        """The engine failed (:meth:`Health.fail`): fail every unfinished op."""
        for op in list(self._live):
            if op.done:
                continue
            if op.serial is not None and op in op.serial.pending:
                op.serial.pending.remove(op)
            note = op.progress_note() if op.started else "queued"
            err = self.health.failed_error(op.desc + (f" [{note}]" if note else ""))
            if op.started:
                try:
                    op.on_timeout(err)  # detach receivers: later pieces are discarded
                except Exception as exc:  # noqa: BLE001
                    log.debug("rank %d: %s: detaching failed: %r", self.rank, op.desc, exc)
            op.finish(err)

    def peer_failed(self, error: PeerFailedError) -> None:
        """A caller outside the engine (the shared workspace) found ``error.peer`` dead:
        fail as the engine does when a connection drops (every op, peers told)."""
        peer = error.peer
        assert peer is not None
        with self._lock:
            if not self._closed:
                self.health.fail(error, peer=peer)

    def departed(self, peer: int) -> bool:
        """Whether global rank ``peer`` said goodbye or failed."""
        return self.health.gone(peer)

    def departure_note(self, peer: int) -> str:
        """How global rank ``peer`` left ("it closed its process group", ...), once it did."""
        return self.health.departure_note(peer)

    def read_control(self) -> None:
        """Before closing (every operation finished): act on the goodbyes and failure
        reports that arrived, and on dropped connections, so the caller knows who is gone
        (:attr:`failure`, :meth:`departed`)."""
        with self._lock:
            if not self._closed:
                self.dispatcher.read_control()
                self.health.check(drain=False)

    def wait_disconnected(self, peer: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until the connection to global rank ``peer`` drops
        (its process ended, wherever it ran); True if it did."""
        give_up_at = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._closed:
                    return False
                self.health.check(drain=False)
                if peer in self.health.disconnected:
                    return True
            if time.monotonic() >= give_up_at:
                return False
            time.sleep(0.01)

    def poll_now(self) -> None:
        """One round without blocking, if no other thread drives: for a caller that waits
        outside the engine (the shared workspace) and must still hear goodbyes, failure
        reports and dropped connections."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._round(0.0)
                    self.health.check()
            finally:
                self._lock.release()

    def farewell(
        self, why: str, timeout_s: float = FAREWELL_S, skip: Callable[[int], bool] | None = None
    ) -> None:
        """Tell every live peer this rank goes down because of ``why`` (their calls then
        raise :class:`PeerFailedError` saying ``rank N exited: why``); no lock taken, so
        it may run from a signal handler (:meth:`Health.farewell`)."""
        self.health.farewell(why, timeout_s, skip)

    # -- the round ---------------------------------------------------------------------
    def _round(self, timeout_s: float, until: Op | None = None) -> None:
        """One progress round: admit, deliver loopback, check trackers, poll, dispatch.

        With ``until``, dispatching stops as soon as that op is done (its caller returns
        without paying for another look at the socket).
        """
        health = self.health
        if health.orphaned:
            health.fail_orphaned()
        while self._submitted:
            self._admit(self._submitted.popleft())
        while self._loopback:
            self.dispatch(*self._loopback.popleft())
        if time.monotonic() >= health.next_check:
            health.check()
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
            self.dispatcher.drain(until)
            return
        # A poll returns at once if a message is already waiting, and finds out in C
        # what a look from Python (recv_first) costs a microsecond to ask.
        if self.transport.poll(timeout_s):
            self.dispatcher.drain(until, ready=True)

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
        if self.aborts.known:
            aborted = self.aborts.call_error(op)
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

    def on_finished(self, op: Op) -> None:
        """``op`` just finished (:meth:`Op.finish`): tell its group's peers if it was a
        failed collective, and start the next op of its serial queue."""
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

    def _expire(self, op: Op, timeout_s: float | None) -> None:
        with self._lock:
            if op.done:
                return
            note = op.progress_note()
            where = ""
            if not self._closed and self.health.failure is None and self.transport.peers():
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
            health = self.health
            if not self._closed and not health.said_goodbye:
                health.said_goodbye = True
                health.say_goodbye(linger_s, kind, self.dispatcher.read_control)

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
                op.finish(
                    GroupClosedError(f"rank {self.rank}: {op.desc}: the process group was closed")
                )
            # Goodbyes written out (tracked) leave libzmq's batch buffer only on a
            # lingering close: live peers get a short linger, gone ones none.
            health = self.health
            if kind == DEPART_ERROR:
                self.transport.close(0.0)
            else:
                if not health.said_goodbye:
                    linger = self.transport.linger_s if linger_s is None else linger_s
                    health.say_goodbye(linger, kind, self.dispatcher.read_control)
                self.transport.close(GOODBYE_MIN_S, abandon=health.failed_peers | health.departed)
            self.matching.clear()
            self._loopback.clear()
