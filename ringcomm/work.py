"""Work: the handle of an asynchronous operation (``isend``, ``irecv``, ``async_op=True``)."""

from __future__ import annotations

from typing import Any

from .progress import Engine, Op

__all__ = ["Work"]


class Work:
    """Completion handle. ``wait()`` returns the result or raises the operation's error."""

    __slots__ = ("_default_timeout_s", "_engine", "_op")

    def __init__(self, engine: Engine, op: Op, default_timeout_s: float | None) -> None:
        self._engine = engine
        self._op = op
        self._default_timeout_s = default_timeout_s

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until done (driving progress); ``timeout_s`` None: the group's default."""
        t = self._default_timeout_s if timeout_s is None else timeout_s
        return self._engine.wait(self._op, t)

    def done(self) -> bool:
        """True once the operation completed or failed (never blocks; makes progress)."""
        return self._engine.test(self._op)

    is_completed = done

    def exception(self) -> BaseException | None:
        """The error the operation failed with, if it is done and failed."""
        return self._op.error if self._op.done else None

    def __repr__(self) -> str:
        state = "pending" if not self._op.done else ("failed" if self._op.error else "done")
        return f"<Work {self._op.desc}: {state}>"
