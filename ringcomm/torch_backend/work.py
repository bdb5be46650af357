"""The torch backend's Work, and who completes its future when nobody waits.

:class:`RingcommWork` is what every backend call returns: ``wait()`` settles it on the
calling thread; ``get_future()`` hands it to the group's :class:`Completer`, which settles
it from a thread of its own. Settling (once, whoever comes first) waits for the ringcomm
operations, runs the call's post step and completes the future; a failure makes ``wait()``
raise and fails the future's C++ side. Why threads and not ringcomm's done callbacks
alone: docs/architecture.md, "The torch backend".
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ringcomm.core.work import Work as RcWork
from ringcomm.errors import CommTimeoutError
from ringcomm.torch_backend.device import CallScope
from ringcomm.torch_backend.tensors import Post

__all__ = ["Completer", "RingcommWork", "torch_wording", "when_done"]


class RingcommWork(dist.Work):
    """A torch Work over one or more ringcomm operations.

    ``wait()`` blocks (driving ringcomm's progress on this thread) and raises the
    operation's error; ``get_future()`` is completed with the output tensors (or the error)
    by whichever comes first: a ``wait()`` or the group's completion thread.
    """

    def __init__(
        self,
        works: Sequence[RcWork | RingcommWork],
        outputs: list[torch.Tensor],
        post: Post | None,
        timeout_s: float,
        desc: str,
        on_error: Callable[[BaseException], None] | None = None,
        watch: Callable[[RingcommWork], None] | None = None,
        scope: CallScope | None = None,
    ) -> None:
        super().__init__()
        #: The call's device and stream (None or host: nothing to order).
        self._scope = scope
        self._end: Any = None  # the event after the call's own steps (device calls)
        self._on_error = on_error
        self._watch = watch
        self._works = list(works)
        self._outputs = outputs
        self._post = post
        self._timeout_s = timeout_s
        self._desc = desc
        devices: list[Any] = scope.future_devices() if scope is not None else []
        self._source: Future[Any] = Future(devices=devices)
        self._future: Future[Any] | None = None
        self._lock = threading.Lock()
        self._settled = False
        self._error: BaseException | None = None

    # -- completion (any thread) -----------------------------------------------------
    def settle(self, limit_s: float | None = None) -> None:
        """Wait for the ringcomm work (at most the call's timeout, or ``limit_s`` if
        shorter: expiry fails the operation), run the post step, complete the future
        (once)."""
        with self._lock:
            if self._settled:
                return
            error: BaseException | None = None
            try:
                wait_s = self._timeout_s if limit_s is None else min(limit_s, self._timeout_s)
                deadline = time.monotonic() + wait_s
                for w in self._works:
                    if isinstance(w, RcWork):
                        # (without torch, RingcommWork's base is Any: it might be an RcWork)
                        w.wait(max(deadline - time.monotonic(), 1e-3))  # type: ignore[arg-type]
                    else:
                        w.wait()
                # (device calls: on the caller's stream, then an event after them)
                with self._on_stream():
                    if self._post is not None:
                        self._post()
                    if self._scope is not None:
                        self._end = self._scope.finish()
            except BaseException as exc:  # noqa: BLE001 (reported through the future)
                error = torch_wording(exc, f"ringcomm backend: {self._desc}")
            self._error = error
            self._settled = True
        if error is not None and self._on_error is not None:
            self._on_error(error)
        with self._on_stream():  # (a CUDA future records its event on the current stream)
            self._source.set_result(self._outputs)

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return self._scope.on_stream() if self._scope is not None else contextlib.nullcontext()

    def _unwrap(self, fut: Future[Any]) -> Any:
        """The chained future's value; raises the failure (see ``get_future``)."""
        value = fut.value()
        error = self._error
        if error is not None:
            raise RuntimeError(f"ringcomm {self._desc} failed: {type(error).__name__}: {error}")
        return value

    def _ready(self) -> bool:
        """Non-blocking: are the ringcomm operations done (progress made if possible)?"""
        return all(
            w.is_completed() if isinstance(w, RingcommWork) else w.done() for w in self._works
        )

    def operations(self) -> list[RcWork]:
        """The ringcomm operations under this work (those of nested works included)."""
        ops: list[RcWork] = []
        for w in self._works:
            if isinstance(w, RcWork):
                ops.append(w)
            else:
                ops += w.operations()
        return ops

    # -- torch's Work interface ------------------------------------------------------
    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until done; raise the operation's error. ``timeout`` (torch's, a
        timedelta; zero or None: the group's) bounds the wait: on expiry the operation
        fails with ``CommTimeoutError``."""
        limit_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0
        self.settle(limit_s if limit_s > 0 else None)
        if self._error is not None:
            raise self._error
        if self._scope is not None:  # the waiter's stream waits for the result (not the host)
            self._scope.join(self._end)
        return True

    def get_future(self) -> Future[Any]:
        """The future of the output tensors. A failure is a real error of the future (its
        C++ side), so DDP's reducer raises it from ``loss.backward()``: torch's
        ``Future.set_exception`` only stores the exception as the *value* (DDP then reads
        it as tensors and crashes), while an exception raised by a ``then`` callback fails
        the chained future properly."""
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = self._source.then(self._unwrap)
            settled = self._settled
        if not settled and self._watch is not None:
            self._watch(self)  # someone must complete it without a wait(): the completer
        return self._future

    def is_completed(self) -> bool:
        """Done, and (device calls) the steps queued on the caller's stream after it too."""
        if not self._settled and self._ready():
            self.settle()
        return self._settled and (self._end is None or bool(self._end.query()))

    def is_success(self) -> bool:
        return self._settled and self._error is None

    def _source_rank(self) -> int:
        """The sender's group rank of a receive (torch's ``Work._source_rank``; what
        ``dist.recv`` without ``src`` returns). Waits for the receive first."""
        self.wait()
        for w in self._works:
            src = w._source_rank() if isinstance(w, RingcommWork) else w.source
            if src is not None:
                return int(src)
        raise RuntimeError(f"ringcomm backend: {self._desc}: not a receive, no source rank")

    source_rank = _source_rank

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def __repr__(self) -> str:
        state = "pending" if not self._settled else ("failed" if self._error else "done")
        return f"<RingcommWork {self._desc}: {state}>"


def when_done(work: RingcommWork, fn: Callable[[], None]) -> None:
    """Call ``fn()`` once every ringcomm operation under ``work`` is done (from the thread
    that completes the last one, or here if they all are)."""
    ops = work.operations()
    if not ops:
        fn()
        return
    left = [len(ops)]
    lock = threading.Lock()

    def one(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    for op in ops:
        op.add_done_callback(one)


class Completer:
    """Completes the torch futures of one group without anyone calling ``wait()``.

    Collectives: one thread waits on them in issue order (ringcomm finishes a group's
    collectives in that order, so waiting on the oldest never holds up a younger one).
    Point-to-point work may finish in any order: each tells a second thread when it is
    done (:func:`when_done`, ringcomm's done callbacks), which settles it.
    """

    def __init__(self, name: str) -> None:
        self._colls: collections.deque[RingcommWork | None] = collections.deque()
        self._coll_cv = threading.Condition()
        self._p2p: collections.deque[RingcommWork] = collections.deque()  # done, to settle
        self._p2p_cv = threading.Condition()
        self._closed = False
        self._coll_thread = threading.Thread(
            target=self._coll_main, name=f"ringcomm-torch-{name}", daemon=True
        )
        self._p2p_thread: threading.Thread | None = None
        self._name = name
        self._coll_thread.start()

    def add(self, work: RingcommWork, p2p: bool) -> None:
        if p2p:
            with self._p2p_cv:
                if self._p2p_thread is None:
                    self._p2p_thread = threading.Thread(
                        target=self._p2p_main, name=f"ringcomm-torch-p2p-{self._name}", daemon=True
                    )
                    self._p2p_thread.start()
            when_done(work, lambda: self._p2p_done(work))
        else:
            with self._coll_cv:
                self._colls.append(work)
                self._coll_cv.notify()

    def _p2p_done(self, work: RingcommWork) -> None:
        """Every ringcomm operation of ``work`` is done (a done callback: no waiting)."""
        with self._p2p_cv:
            self._p2p.append(work)
            self._p2p_cv.notify()

    def _coll_main(self) -> None:
        while True:
            with self._coll_cv:
                while not self._colls:
                    self._coll_cv.wait()
                work = self._colls.popleft()
            if work is None:
                return
            work.settle()

    def _p2p_main(self) -> None:
        while True:
            with self._p2p_cv:
                while not self._p2p and not self._closed:
                    self._p2p_cv.wait()
                if self._closed:
                    return
                work = self._p2p.popleft()
            work.settle()  # (its operations are done: nothing to wait for)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._coll_cv:
            self._colls.append(None)
            self._coll_cv.notify()
        with self._p2p_cv:
            self._closed = True
            self._p2p_cv.notify()
        self._coll_thread.join(timeout_s)
        if self._p2p_thread is not None:
            self._p2p_thread.join(timeout_s)


def torch_wording(error: BaseException, what: str) -> BaseException:
    """``error`` as torch reports it. torch's callers (its own test suite among them) tell a
    timeout by the words " Timed out " (Gloo: "Timed out waiting 1000ms for recv ...";
    NCCL's watchdog: "Watchdog caught collective operation timeout"): a ringcomm
    ``CommTimeoutError`` gets a new ``CommTimeoutError`` (same type, chained) whose message
    starts with torch's words and goes on with ringcomm's whole message (rank, peer, op,
    tag, the progress of each rank). Any other error is returned as it is."""
    if not isinstance(error, CommTimeoutError) or " Timed out " in str(error):
        return error
    mapped = CommTimeoutError(f"{what}: Timed out ({error})")
    mapped.__cause__ = error
    return mapped
