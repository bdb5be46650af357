"""Matching: incoming pieces to posted receivers, by key ``(src, group, kind, tag)``.

A receiver takes the pieces of messages with one key in arrival order, and receivers for
one key match messages in the order posted. Pieces that arrive before their receiver is
posted wait in an unexpected queue, capped per sending peer (messages and bytes): a peer
over the cap fails the engine with :class:`QueueLimitError` instead of exhausting memory.
An any-source point-to-point receive is bound to a sender only at a message's first piece,
so a message is never split between receivers and a sender's messages never overtake one
another. Control messages are never matched: they go to the engine's handler. Everything
here runs under the engine's driver lock.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from ringcomm.core.health import Health
from ringcomm.errors import QueueLimitError
from ringcomm.transport.wire import KIND_CTRL, KIND_P2P, Header

__all__ = [
    "MAX_UNEXPECTED_BYTES",
    "MAX_UNEXPECTED_MESSAGES",
    "AnyReceiver",
    "Key",
    "Matching",
    "Message",
    "Receiver",
]

#: Defaults of the per-peer cap on buffered unexpected messages.
MAX_UNEXPECTED_MESSAGES = 65536
MAX_UNEXPECTED_BYTES = 1 << 30

Key = tuple[int, int, int, int]
Message = tuple[Header, memoryview]

K = TypeVar("K")
R = TypeVar("R")


class Receiver(Protocol):
    """Takes the pieces of messages with one key. An :class:`~ringcomm.core.progress.Op`,
    or an object with ``op`` (the Op it feeds, None once detached) and ``sealed`` (True: it
    only swallows what is left of a failed call's stream)."""

    def on_piece(self, header: Header, payload: memoryview) -> bool:
        """Consume one piece; return True when this receiver wants no more pieces."""


class AnyReceiver(Receiver, Protocol):
    """A point-to-point receiver that takes the next message from any of ``sources``
    (:meth:`Matching.post_any`). ``order``: when it was posted
    (:meth:`Matching.next_order`), against receivers for one sender posted meanwhile."""

    order: int
    sources: frozenset[int]

    def bind(self, src: int) -> None:
        """Its message comes from global rank ``src`` (called once, before its first piece)."""


class Matching:
    """Posted receivers and unexpected messages of one engine.

    ``health``: whose departed peers a receiver posted now waits for in vain (it marks
    them orphaned) and whose ``fail`` the cap calls; ``on_ctrl(header)``: handles a control
    message; ``needs_more(receiver)``: whether it feeds an unfinished operation;
    ``known_src``: the global ranks whose messages are kept (others are dropped).
    """

    def __init__(
        self,
        rank: int,
        health: Health,
        on_ctrl: Callable[[Header], None],
        needs_more: Callable[[Receiver], bool],
        known_src: Iterable[int],
        max_unexpected_messages: int = MAX_UNEXPECTED_MESSAGES,
        max_unexpected_bytes: int = MAX_UNEXPECTED_BYTES,
    ) -> None:
        self.rank = rank
        self.health = health
        self.on_ctrl = on_ctrl
        self.needs_more = needs_more
        self.known_src = set(known_src) | {rank}
        self.max_unexpected_messages = max_unexpected_messages
        self.max_unexpected_bytes = max_unexpected_bytes
        self.posted: dict[Key, collections.deque[Receiver]] = {}
        # Any-source point-to-point receives (post_any), per (group, tag), in posting
        # order; and the senders of the unexpected point-to-point messages per (group,
        # tag), in arrival order (what an any-source receive takes first).
        self.posted_any: dict[tuple[int, int], collections.deque[AnyReceiver]] = {}
        self.arrivals: dict[tuple[int, int], collections.deque[int]] = {}
        self.orders = itertools.count()
        self.unexpected: dict[Key, collections.deque[Message]] = {}
        self.unexpected_count = 0
        # Per-peer accounting of the unexpected queues: src -> [messages, bytes].
        self.unexpected_by_src: dict[int, list[int]] = {}
        #: Messages dropped: malformed, from an unknown sender, or over the cap.
        self.dropped_frames = 0

    # -- posting receivers -------------------------------------------------------------
    def post(self, key: Key, receiver: Receiver) -> None:
        """Post a receiver for messages with ``key``; queued pieces are fed to it first."""
        waiting = self.unexpected.get(key)
        while waiting:
            header, payload = waiting.popleft()
            self.unexpected_count -= 1
            self._unaccount(header.src, payload)
            if not waiting:
                del self.unexpected[key]
            if header.kind == KIND_P2P and header.piece == 0:
                self._arrived_taken(header)
            if receiver.on_piece(header, payload):
                return
        q = self.posted.get(key)
        if q is None:
            self.posted[key] = q = collections.deque()
        q.append(receiver)
        if key[0] in self.health.departed and self.needs_more(receiver):  # nothing can come
            self.health.orphaned.add(key[0])

    def next_order(self) -> int:
        """A number for a point-to-point receive being posted (``AnyReceiver.order``)."""
        return next(self.orders)

    def post_any(self, group: int, tag: int, receiver: AnyReceiver) -> None:
        """Post a receiver for the next point-to-point message on ``group`` with ``tag``
        from any of ``receiver.sources`` (global ranks), MPI's ``MPI_ANY_SOURCE``.

        It is bound (``receiver.bind(src)``, then posted as for ``src`` alone) to the
        sender of the earliest-arrived such message waiting, else of the first one to
        arrive for which no receive naming its sender was posted earlier. A message is
        never split between receivers, and messages from one sender still match receives
        in the order sent (no overtaking): binding happens only at a message's first piece.
        """
        arrivals = self.arrivals.get((group, tag))
        src = next((s for s in arrivals if s in receiver.sources), None) if arrivals else None
        if src is not None:
            receiver.bind(src)
            self.post((src, group, KIND_P2P, tag), receiver)
            return
        q = self.posted_any.get((group, tag))
        if q is None:
            self.posted_any[(group, tag)] = q = collections.deque()
        q.append(receiver)
        peer = self._all_departed(receiver.sources)
        if peer is not None:  # nobody left who could send it
            self.health.orphaned.add(peer)

    def unpost_any(self, group: int, tag: int, receiver: AnyReceiver) -> bool:
        """Withdraw an any-source receiver not bound yet; False if it was not posted."""
        return _withdraw(self.posted_any, (group, tag), receiver)

    def unpost(self, key: Key, receiver: Receiver) -> bool:
        """Withdraw a receiver posted for ``key``; False if it was not posted."""
        return _withdraw(self.posted, key, receiver)

    def awaits(self, src: int) -> bool:
        """Whether a posted receiver still needs a message from departed peer ``src``
        (every message it sent before its goodbye was dispatched before it), or an
        any-source one waits on senders that all departed."""
        needs_more = self.needs_more
        if any(key[0] == src and any(map(needs_more, q)) for key, q in self.posted.items()):
            return True
        return any(
            any(map(needs_more, q)) and self._all_departed(q[0].sources) is not None
            for q in list(self.posted_any.values())
        )

    def _all_departed(self, sources: frozenset[int]) -> int | None:
        """A departed peer among ``sources`` if every one of them but this rank departed
        (an any-source receive then waits for nothing that can come), else None. A
        group of this rank alone never counts as departed."""
        departed = self.health.departed
        others = [s for s in sources if s != self.rank]
        if others and all(s in departed for s in others):
            return max(others)
        return None

    def _arrived_taken(self, header: Header) -> None:
        """The first piece of unexpected point-to-point message ``header`` was taken."""
        where = (header.group, header.tag)
        arrivals = self.arrivals.get(where)
        if arrivals is not None:
            try:
                arrivals.remove(header.src)  # its first entry: per sender in order sent
            except ValueError:
                pass
            if not arrivals:
                del self.arrivals[where]

    def _bind_any(
        self, header: Header, q: collections.deque[Receiver] | None
    ) -> collections.deque[Receiver] | None:
        """At the first piece of a point-to-point message: if an any-source receive
        posted before any receive naming the sender waits, bind it and put it first."""
        anyq = self.posted_any.get((header.group, header.tag))
        if not anyq or header.src not in anyq[0].sources:
            return q
        first = anyq[0]
        if q and getattr(q[0], "order", -1) < first.order:
            return q  # a receive naming the sender was posted earlier: it matches first
        anyq.popleft()
        if not anyq:
            del self.posted_any[(header.group, header.tag)]
        first.bind(header.src)
        key = (header.src, header.group, header.kind, header.tag)
        if q is None:
            self.posted[key] = q = collections.deque()
        q.appendleft(first)
        return q

    # -- incoming pieces ---------------------------------------------------------------
    def dispatch(self, header: Header, payload: memoryview) -> None:
        """Feed a piece to its receiver, or queue it as unexpected."""
        key = (header.src, header.group, header.kind, header.tag)  # header.key, inlined
        q = self.posted.get(key)
        if self.posted_any and header.kind == KIND_P2P and header.piece == 0:
            q = self._bind_any(header, q)
        if q:
            receiver = q[0]
            if receiver.on_piece(header, payload):
                q.popleft()
                if not q:
                    del self.posted[key]
            return
        if header.src not in self.known_src:  # nobody will ever receive it
            self.dropped_frames += 1
            return
        if header.kind == KIND_CTRL:  # never posted for: handled by the engine
            self.on_ctrl(header)
            return
        if not self._account(header.src, payload):
            self.dropped_frames += 1  # over the cap: the engine failed already
            return
        waiting = self.unexpected.get(key)
        if waiting is None:
            self.unexpected[key] = waiting = collections.deque()
        waiting.append((header, payload))
        self.unexpected_count += 1
        if header.kind == KIND_P2P and header.piece == 0:
            where = (header.group, header.tag)
            arrivals = self.arrivals.get(where)
            if arrivals is None:
                self.arrivals[where] = arrivals = collections.deque()
            arrivals.append(header.src)

    def take(self, key: Key) -> Message | None:
        """The first unexpected message with ``key`` (a collective's), taken off its queue
        (the fast lane, which looks at it before it posts nothing)."""
        waiting = self.unexpected.get(key)
        if not waiting:
            return None
        message = waiting.popleft()
        self.unexpected_count -= 1
        self._unaccount(message[0].src, message[1])
        if not waiting:
            del self.unexpected[key]
        return message

    def requeue(self, got: dict[Key, Message]) -> None:
        """Put messages taken off the socket or the queues (the fast lane's) back at the
        front of their unexpected queues, and forget them from ``got``."""
        for key, message in got.items():
            waiting = self.unexpected.get(key)
            if waiting is None:
                self.unexpected[key] = waiting = collections.deque()
            waiting.appendleft(message)
            self.unexpected_count += 1
            self._account(message[0].src, message[1])
        got.clear()

    def clear(self) -> None:
        """Forget every receiver and queued message (the engine closed)."""
        self.posted.clear()
        self.posted_any.clear()
        self.arrivals.clear()
        self.unexpected.clear()

    # -- bounded unexpected queues -----------------------------------------------------
    def _account(self, src: int, payload: memoryview) -> bool:
        """Count a message queued as unexpected; False (and fail) when over the cap."""
        counts = self.unexpected_by_src.get(src)
        if counts is None:
            self.unexpected_by_src[src] = counts = [0, 0]
        if src in self.health.failed_peers:
            return False
        counts[0] += 1
        counts[1] += len(payload)
        if counts[0] > self.max_unexpected_messages or counts[1] > self.max_unexpected_bytes:
            counts[0] -= 1
            counts[1] -= len(payload)
            self.health.fail(
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
        counts = self.unexpected_by_src.get(src)
        if counts is not None:
            counts[0] -= 1
            counts[1] -= len(payload)


def _withdraw(queues: dict[K, collections.deque[R]], key: K, receiver: R) -> bool:
    """Take ``receiver`` out of ``queues[key]`` (dropping the queue once empty); False if
    it was not there."""
    q = queues.get(key)
    if q is None:
        return False
    try:
        q.remove(receiver)
    except ValueError:
        return False
    if not q:
        del queues[key]
    return True
