"""Work: the handle of an asynchronous operation (``isend``, ``irecv``, ``async_op=True``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ringcomm.core.progress import Op, Progress

__all__ = ["Work"]

log = logging.getLogger("ringcomm")


class Work:
    """Completion handle. ``wait()`` returns the result or raises the operation's error.

    Once it has seen its operation finish, a Work keeps only the result (or the error)
    and lets the operation go, so nothing else of the call stays referenced.
    """

    __slots__ = (
        "_default_timeout_s",
        "_engine",
        "_error",
        "_label",
        "_op",
        "_result",
        "_source",
    )

    def __init__(self, progress: Progress, op: Op, default_timeout_s: float | None) -> None:
        self._engine = progress
        self._op: Op | None = op
        self._default_timeout_s = default_timeout_s
        self._result: Any = None
        self._source: int | None = None
        self._error: BaseException | None = None
        self._label = ""

    def _take(self, op: Op) -> None:
        """The op is done: keep its result and error, drop the op."""
        self._result = op.result
        self._source = getattr(op, "source", None)
        self._error = op.error
        self._label = type(op).__name__
        self._op = None

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until done (driving progress); ``timeout_s`` None: the group's default."""
        op = self._op
        if op is not None:
            t = self._default_timeout_s if timeout_s is None else timeout_s
            try:
                self._engine.wait(op, t)
            finally:
                if op.done:
                    self._take(op)
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def source(self) -> int | None:
        """The group rank a receive's message came from (``irecv``; with
        :data:`ringcomm.ANY_SOURCE`, known once the message matched); None for other
        operations. Never blocks."""
        op = self._op
        if op is None:
            return self._source
        if op.done:
            self._take(op)
            return self._source
        return getattr(op, "source", None)

    def done(self) -> bool:
        """True once the operation completed or failed (never blocks; makes progress)."""
        op = self._op
        if op is None:
            return True
        if self._engine.test(op):
            self._take(op)
            return True
        return False

    is_completed = done

    def exception(self) -> BaseException | None:
        """The error the operation failed with, if it is done and failed."""
        op = self._op
        if op is not None:
            if not op.done:
                return None
            self._take(op)
        return self._error

    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        """Call ``fn(self)`` once the operation is done (completed or failed).

        Called exactly once: on the thread that completes the operation (a waiting caller,
        the progress thread, or whichever thread drives the engine at the time), or right
        here if it is done already. ``fn`` runs inside the engine: keep it short, and do
        not wait for other ringcomm operations in it. An exception from ``fn`` is logged
        (logger ``ringcomm``), never raised into the engine or to the caller.
        """
        op = self._op
        if op is not None and op.add_callback(lambda _op: self._call(fn)):
            return
        self._call(fn)

    def _call(self, fn: Callable[[Work], Any]) -> None:
        op = self._op
        if op is not None and op.done:
            self._take(op)
        try:
            fn(self)
        except Exception:  # a user callback never breaks anything
            log.exception("a done callback of %r failed", self)

    def __repr__(self) -> str:
        op = self._op
        if op is None:
            return f"<Work {self._label}: {'failed' if self._error else 'done'}>"
        state = "pending" if not op.done else ("failed" if op.error else "done")
        return f"<Work {op.desc}: {state}>"
