"""A call's deadline: made once where the call enters, from its ``timeout_s``, then carried.

``timeout_s`` is checked here, once per call; every step below (the algorithm's fast lane,
the engine's wait, a hierarchical call's sub-group calls) asks the same :class:`Deadline`
what is left, so the whole call ends within its ``timeout_s``, not each step. Pure.
"""

from __future__ import annotations

import time

__all__ = ["Deadline"]


class Deadline:
    """``timeout_s`` (> 0, else ValueError) from ``start`` (a ``time.monotonic()`` instant;
    None: now). ``at`` is the instant it passes."""

    __slots__ = ("at", "start", "timeout_s")

    def __init__(self, timeout_s: float, start: float | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.start = time.monotonic() if start is None else start
        self.at = self.start + timeout_s

    def remaining(self) -> float:
        """Seconds left (negative once it passed)."""
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def __repr__(self) -> str:
        return f"Deadline({self.timeout_s:g} s, {self.remaining():.3g} s left)"
