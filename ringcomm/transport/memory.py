"""An in-memory transport for tests: every rank of a job in one process, no sockets.

The progress engine and everything above it run unchanged over :class:`MemoryTransport`
(a :class:`~ringcomm.transport.base.Transport`), while a :class:`MemoryHub` (the "network"
of one process) decides when each message becomes visible, so protocol tests are
deterministic and need no sleeps. Framing is ZmqTransport's; faults (:meth:`MemoryHub.kill`,
:meth:`MemoryHub.hold`/:meth:`MemoryHub.release`, :meth:`MemoryHub.drop_next`) are injected
on the hub, from any thread.

Invariants: messages from one sender to one receiver keep their order (one FIFO per
sending rank, one for farewells); the interleaving across senders is drawn by the
receiver's ``random.Random`` seeded from the hub's seed and its rank; a killed or closed
rank's peers get ``(rank, EVENT_DISCONNECTED)``, as libzmq's monitor reports. Delivery
order and faults in full: docs/architecture.md, section "transport/memory.py".
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ringcomm.errors import RingcommError
from ringcomm.transport.base import EVENT_DISCONNECTED, INLINE_MAX_BYTES, Completion, Stream
from ringcomm.transport.wire import inline_frame

if TYPE_CHECKING:
    from ringcomm.transport.base import Transport

__all__ = ["MemoryHub", "MemoryTransport", "Sent"]

#: A message in a queue: its first frame, and its payload frame (None: one frame).
_Message = tuple[bytes, bytes | None]


class Sent:
    """The completion :meth:`MemoryTransport.send_tracked` returns: done at once (the
    message is in the receiver's queue, or dropped, when the call returns)."""

    __slots__ = ()
    done = True


_SENT = Sent()


class _Inbox:
    """One rank's incoming side: its queues, held messages, faults and events (all
    guarded by ``cv``: senders are other ranks' threads)."""

    def __init__(self, rank: int, seed: int) -> None:
        self.rank = rank
        self.cv = threading.Condition(threading.Lock())
        self.rng = random.Random(f"ringcomm.memory:{seed}:{rank}")
        self.queues: dict[int, deque[_Message]] = {}  # channel -> visible messages
        self.ready = 0  # visible messages, over every channel
        self.held: dict[int, deque[_Message]] = {}  # src -> held back, in order
        self.hold_after: dict[int, int] = {}  # src -> messages still let through
        self.drop: dict[int, int] = {}  # src -> messages still to lose
        self.events: list[tuple[int, int]] = []
        self.woken = False
        self.gone = False  # killed or closed: nothing is delivered here
        self.dropped = 0

    def deliver(self, src: int, channel: int, message: _Message, faults: bool) -> None:
        """Queue ``message`` from ``src`` on ``channel``, unless a fault takes it."""
        with self.cv:
            if self.gone:
                self.dropped += 1
                return
            if faults:
                lose = self.drop.get(src, 0)
                if lose:
                    self.drop[src] = lose - 1
                    self.dropped += 1
                    return
                passing = self.hold_after.get(src)
                if passing is not None:
                    held = self.held.get(src)
                    if held or passing <= 0:  # behind what is held already: order kept
                        self.held.setdefault(src, deque()).append(message)
                        self.cv.notify_all()  # MemoryHub.wait_held
                        return
                    self.hold_after[src] = passing - 1
            self._queue(channel, message)

    def _queue(self, channel: int, message: _Message) -> None:
        q = self.queues.get(channel)
        if q is None:
            self.queues[channel] = q = deque()
        q.append(message)
        self.ready += 1
        self.cv.notify_all()

    def release(self, src: int) -> None:
        with self.cv:
            self.hold_after.pop(src, None)
            held = self.held.pop(src, None)
            if held and not self.gone:
                for message in held:
                    self._queue(src, message)

    def forget(self, src: int) -> None:
        """``src`` was killed: what it sent that is still held back is lost."""
        with self.cv:
            held = self.held.pop(src, None)
            if held:
                self.dropped += len(held)

    def take(self) -> _Message | None:
        """The next visible message (drawn among the channels' heads), or None."""
        with self.cv:
            if not self.ready:
                return None
            channels = [c for c, q in self.queues.items() if q]
            channel = channels[0] if len(channels) == 1 else self.rng.choice(sorted(channels))
            self.ready -= 1
            return self.queues[channel].popleft()

    def cut_off(self) -> None:
        """Killed or closed: drop what is queued or held, deliver nothing more."""
        with self.cv:
            self.gone = True
            self.dropped += self.ready + sum(len(q) for q in self.held.values())
            self.queues.clear()
            self.held.clear()
            self.ready = 0
            self.woken = True
            self.cv.notify_all()

    def event(self, peer: int, event: int) -> None:
        with self.cv:
            if not self.gone:
                self.events.append((peer, event))
                self.woken = True  # a poll in progress returns (the engine looks soon)
                self.cv.notify_all()


class MemoryHub:
    """The network of one process's ranks ``0..world_size-1`` (module docstring).

    ``seed`` picks the delivery order across senders. Fault injection: :meth:`kill`,
    :meth:`hold`/:meth:`release` (:meth:`wait_held`: a cue for tests), :meth:`drop_next`;
    ``dropped`` counts lost messages.
    """

    def __init__(self, world_size: int, *, seed: int = 0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.seed = seed
        self._inboxes = [_Inbox(r, seed) for r in range(world_size)]
        self._lock = threading.Lock()
        self._killed: set[int] = set()
        self._closed: set[int] = set()

    def transport(self, rank: int) -> MemoryTransport:
        """A new transport for ``rank`` on this hub (same as ``MemoryTransport(rank, hub)``)."""
        return MemoryTransport(rank, self)

    # -- fault injection -----------------------------------------------------------------
    def kill(self, rank: int) -> None:
        """Cut ``rank`` off (module docstring): every other live rank, and ``rank`` itself
        for each of them, gets an ``EVENT_DISCONNECTED``. Idempotent."""
        self._check_rank(rank)
        with self._lock:
            if rank in self._killed:
                return
            self._killed.add(rank)
            others = [r for r in range(self.world_size) if r != rank and r not in self._closed]
        for r in others:
            self._inboxes[r].forget(rank)
            self._inboxes[r].event(rank, EVENT_DISCONNECTED)
        inbox = self._inboxes[rank]
        if rank not in self._closed:
            for r in others:
                inbox.event(r, EVENT_DISCONNECTED)
        inbox.cut_off()

    def killed(self, rank: int) -> bool:
        return rank in self._killed

    def hold(self, src: int, dst: int, n: int = 0) -> None:
        """Hold back messages from ``src`` to ``dst``: the next ``n`` still go through,
        every later one waits (in order) until :meth:`release`."""
        inbox = self._inbox_between(src, dst)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with inbox.cv:
            inbox.hold_after[src] = n

    def held(self, src: int, dst: int) -> int:
        """How many messages from ``src`` to ``dst`` are held back now."""
        inbox = self._inboxes[dst]
        with inbox.cv:
            return len(inbox.held.get(src, ()))

    def wait_held(self, src: int, dst: int, n: int = 1, timeout_s: float = 10.0) -> bool:
        """Wait up to ``timeout_s`` until at least ``n`` messages from ``src`` to ``dst``
        are held back (a test's cue that a rank got that far); True if they are."""
        inbox = self._inboxes[dst]
        with inbox.cv:
            return inbox.cv.wait_for(lambda: len(inbox.held.get(src, ())) >= n, timeout_s)

    def release(self, src: int, dst: int) -> None:
        """Make the held messages from ``src`` to ``dst`` visible (in order, behind what
        ``dst`` has already) and stop holding."""
        self._inbox_between(src, dst).release(src)

    def drop_next(self, src: int, dst: int, k: int = 1) -> None:
        """Lose the next ``k`` messages from ``src`` to ``dst`` (farewells excepted: they
        take a connection of their own)."""
        inbox = self._inbox_between(src, dst)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        with inbox.cv:
            inbox.drop[src] = inbox.drop.get(src, 0) + k

    @property
    def dropped(self) -> int:
        """Messages lost so far (to a killed or closed rank, from a killed one, or by
        :meth:`drop_next`)."""
        return sum(inbox.dropped for inbox in self._inboxes)

    def _inbox_between(self, src: int, dst: int) -> _Inbox:
        """The inbox of ``dst``, where messages from ``src`` arrive (both ranks checked)."""
        self._check_rank(src)
        self._check_rank(dst)
        return self._inboxes[dst]

    # -- for MemoryTransport ---------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")

    def _inbox(self, rank: int) -> _Inbox:
        return self._inboxes[rank]

    def _send(self, src: int, dst: int, message: _Message, *, farewell: bool = False) -> None:
        inbox = self._inboxes[dst]
        if src in self._killed:
            with inbox.cv:
                inbox.dropped += 1
            return
        # Farewells take a channel of their own (they may overtake the data path) and no
        # fault but death applies to them.
        channel = -1 - src if farewell else src
        inbox.deliver(src, channel, message, faults=not farewell)

    def _closing(self, rank: int) -> None:
        """``rank``'s transport closes: its peers see the connection drop."""
        with self._lock:
            if rank in self._closed:
                return
            self._closed.add(rank)
            others = (
                []
                if rank in self._killed
                else [r for r in range(self.world_size) if r != rank and r not in self._killed]
            )
        for r in others:
            self._inboxes[r].event(rank, EVENT_DISCONNECTED)
        self._inboxes[rank].cut_off()


class MemoryTransport:
    """Rank ``rank``'s end of a :class:`MemoryHub`: a
    :class:`~ringcomm.transport.base.Transport` with no sockets (module docstring).

    Like the zmq transport, it is driven by one thread at a time (the engine's driver),
    but for :meth:`wake` and :meth:`send_farewell` (any thread). After :meth:`close`,
    sending and receiving raise :class:`~ringcomm.errors.RingcommError`.
    """

    # The same-host paths of the zmq transport do not exist here.
    lane_messages = 0
    shm_pieces = 0
    lane_fallbacks = 0

    def __init__(
        self,
        rank: int,
        hub: MemoryHub,
        *,
        linger_s: float = 3.0,
        heartbeat_timeout_s: float = 4.0,
    ) -> None:
        hub._check_rank(rank)
        self.rank = rank
        self.hub = hub
        self.linger_s = linger_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.security: str | None = None
        self.auth_failures = 0
        self.refused_by: set[int] = set()
        self.sent_bytes = 0
        self.sent_messages = 0
        self._inbox = hub._inbox(rank)
        self._peers = [r for r in range(hub.world_size) if r != rank]
        self._payload: bytes | None = None  # the payload frame recv_first said follows
        self._closed = False

    def peers(self) -> list[int]:
        """Every other rank of the hub (global ranks, ascending)."""
        return list(self._peers)

    def _check_open(self) -> None:
        if self._closed:
            raise RingcommError(f"rank {self.rank}: the memory transport is closed")

    def _check_peer(self, peer: int) -> None:
        if peer not in self._peers:
            raise RingcommError(f"rank {self.rank}: no endpoint known for peer {peer}")

    # -- sending -----------------------------------------------------------------------
    def send(
        self, peer: int, stream: Stream | None, header: bytes, payload: Any, nbytes: int
    ) -> Completion | None:
        """Queue one message to ``peer``: inline below ``INLINE_MAX_BYTES``, else header
        and a copy of the payload (never a completion: nothing to wait for)."""
        self._check_open()
        self._check_peer(peer)
        self.sent_bytes += nbytes
        self.sent_messages += 1
        if payload is None:  # a one-frame message framed by the caller
            message: _Message = (bytes(header), None)
        elif nbytes < INLINE_MAX_BYTES:
            message = (inline_frame(header, payload), None)
        else:
            message = (bytes(header), memoryview(payload).tobytes())
        self.hub._send(self.rank, peer, message)
        return None

    def send_tracked(self, peer: int, frame: bytes) -> Sent:
        """Queue a one-frame message; the completion is done at once."""
        self._check_open()
        self._check_peer(peer)
        self.hub._send(self.rank, peer, (bytes(frame), None))
        return _SENT

    def send_farewell(self, frame: bytes, peers: Collection[int], timeout_s: float) -> None:
        """Put ``frame`` in each of ``peers``' farewell queue (any thread, even after
        :meth:`close`, as the zmq transport makes connections of its own for it)."""
        for peer in peers:
            if peer in self._peers:
                self.hub._send(self.rank, peer, (bytes(frame), None), farewell=True)

    def wait_sent(self, completion: Any, timeout_s: float) -> bool:
        """Every send is complete when it returns."""
        return True

    # -- receiving ---------------------------------------------------------------------
    def poll(self, timeout_s: float, spin_s: float = 0.0) -> bool:
        """Wait up to ``timeout_s`` for a message (True) or a wake-up or event (False)."""
        self._check_open()
        inbox = self._inbox
        with inbox.cv:
            if not inbox.ready and not inbox.woken and timeout_s > 0:
                inbox.cv.wait_for(lambda: inbox.ready or inbox.woken, timeout_s)
            inbox.woken = False
            return inbox.ready > 0

    def control_waiting(self) -> bool:
        """Always True here: the in-memory transport has no cheaper look than a take."""
        return True

    def recv_first(self, ready: bool = False) -> tuple[bytes, bool] | None:
        """The next message's first frame and whether a payload frame follows (take it
        with :meth:`recv_payload`); None when nothing is visible (never blocks)."""
        self._check_open()
        message = self._inbox.take()
        if message is None:
            return None
        first, self._payload = message
        return first, self._payload is not None

    def recv_payload(self, copy: bool, src: int = -1) -> memoryview | bool:
        """The payload frame :meth:`recv_first` said follows (a read-only view); False
        when there is none."""
        self._check_open()
        payload, self._payload = self._payload, None
        if payload is None:
            return False
        return memoryview(payload)

    def poll_events(self) -> list[tuple[int, int]]:
        """Connection events since the last look, as ``(peer, event)``."""
        inbox = self._inbox
        with inbox.cv:
            events, inbox.events = inbox.events, []
        return events

    def wake(self) -> None:
        """Make a :meth:`poll` in progress (or the next one) return (any thread)."""
        inbox = self._inbox
        with inbox.cv:
            inbox.woken = True
            inbox.cv.notify_all()

    def remove_files(self) -> None:
        """Nothing to remove: no file was made."""

    def close(self, linger_s: float | None = None, abandon: Collection[int] = ()) -> None:
        """Leave the hub (idempotent): what is queued here is dropped, what was sent
        stays with its receivers, and every live peer sees the connection drop."""
        if self._closed:
            return
        self._closed = True
        self._payload = None
        self.hub._closing(self.rank)


if TYPE_CHECKING:

    def _implements_the_interface(t: MemoryTransport) -> Transport:
        return t  # mypy checks MemoryTransport against the Transport protocol here
