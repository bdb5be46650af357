"""Operations the progress engine carries out, and what they may use of the engine.

An :class:`Op` is a small state machine: ``start()`` queues its first sends and posts
receivers; pieces are fed to it in arrival order; it finishes once (``finish``), with an
error or without, and then holds nothing of the caller's but its ``result``. It sees the
engine only through :class:`Engine` (a :class:`~ringcomm.core.progress.Progress`), and
every method that touches the engine runs under the engine's driver lock, except
:meth:`Op.add_callback`, which any thread may call.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ringcomm.core.matching import AnyReceiver, Key, Receiver
from ringcomm.errors import RingcommError
from ringcomm.transport.base import Completion, Stream

__all__ = ["Engine", "Op", "SerialQueue", "needs_more"]

log = logging.getLogger("ringcomm")


class Engine(Protocol):
    """What an operation may use of the engine (:class:`~ringcomm.core.progress.Progress`)."""

    rank: int
    #: Guards each op's completion callbacks (:meth:`Op.add_callback`).
    callback_lock: threading.Lock

    @property
    def failure(self) -> RingcommError | None: ...

    def failed_error(self, what: str) -> RingcommError: ...

    def send(
        self, peer: int, stream: Stream | None, header: bytes, payload: Any, nbytes: int
    ) -> Completion | None: ...

    def post(self, key: Key, receiver: Receiver) -> None: ...

    def unpost(self, key: Key, receiver: Receiver) -> bool: ...

    def post_any(self, group: int, tag: int, receiver: AnyReceiver) -> None: ...

    def unpost_any(self, group: int, tag: int, receiver: AnyReceiver) -> bool: ...

    def next_order(self) -> int: ...

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
    ) -> list[memoryview] | bool: ...

    def check_health_if_due(self, now: float, drain: bool = True) -> None: ...

    def track(self, op: Op) -> None: ...

    def on_finished(self, op: Op) -> None: ...


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

    def __init__(self, progress: Engine, desc: str = "", *, async_op: bool = False) -> None:
        self.progress = progress
        self._desc = desc
        self.async_op = async_op
        self.done = False
        self.error: BaseException | None = None
        self.result: Any = None
        self.started = False
        self._event: threading.Event | None = None  # made only if another thread waits
        self._trackers: collections.deque[Completion] = collections.deque()
        #: All receives and sends are issued; only zero-copy sends may be left.
        self.settled = False

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
        if not self.settled:
            return None
        while self._trackers and self._trackers[0].done:
            self._trackers.popleft()
        return self._trackers[0] if self._trackers else None

    def settle(self) -> None:
        """Everything is issued and received: finish once libzmq let go of our buffers."""
        self.settled = True
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
        self.progress.on_finished(self)
        self.release()
        if self._callbacks is not None:
            self._run_callbacks()

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
        with self.progress.callback_lock:
            if self.done:
                return False
            if self._callbacks is None:
                self._callbacks = []
            self._callbacks.append(fn)
            return True

    def _run_callbacks(self) -> None:
        """Run the completion callbacks (once; on the thread that finished the op).

        A callback's exception is logged, never raised into the engine."""
        with self.progress.callback_lock:
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # a user callback never breaks the engine
                log.exception(
                    "rank %d: a completion callback of %s failed", self.progress.rank, self.desc
                )

    # -- the thread that waits for it --------------------------------------------------
    def turn_event(self) -> threading.Event:
        """The event a thread waiting for this op sleeps on: set when the op finishes or
        the engine is handed to that thread (made at the first wait, then kept)."""
        event = self._event
        if event is None:
            event = self._event = threading.Event()
        return event

    def wake(self) -> None:
        """Wake the thread waiting for this op, if one sleeps on :meth:`turn_event`."""
        event = self._event
        if event is not None:
            event.set()


def needs_more(receiver: Receiver) -> bool:
    """Whether ``receiver`` feeds an unfinished operation. A receiver is an :class:`Op`
    itself, or exposes the one it feeds as ``op`` (None once detached) and ``sealed``
    (True: it only swallows what is left of a failed call's stream)."""
    if getattr(receiver, "sealed", False):
        return False
    op = receiver if isinstance(receiver, Op) else getattr(receiver, "op", None)
    return op is not None and not op.done
