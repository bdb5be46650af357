"""One outcome per collective: the collectives that peers reported failed, per group.

A collective that fails on a rank (a timeout, a mismatch) makes that rank send an abort
(:data:`~ringcomm.core.control.CTRL_ABORT`) to the group's other ranks; they fail that
collective and every later one of the group with the first failure's type and reason,
including a late rank whose call could still complete from what was in flight. This module
keeps what was heard (the earliest failed collective of each group) and builds the messages
and errors; the engine finishes the operations. See docs/architecture.md, "The progress
engine".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ringcomm.core.control import CTRL_TEXT_MAX
from ringcomm.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    GroupClosedError,
    PeerFailedError,
    QueueLimitError,
    RingcommError,
)

__all__ = ["Call", "GroupAborts"]

#: The error a peer's abort is raised as, by the name it gives (others: PeerFailedError).
ABORT_ERRORS: dict[str, type[RingcommError]] = {
    cls.__name__: cls for cls in (CommTimeoutError, CollectiveMismatchError, QueueLimitError)
}


class Call(Protocol):
    """What an abort needs of a call: an :class:`~ringcomm.core.progress.Op`."""

    #: A collective's ``(group id, sequence number, the group's global ranks)``; None
    #: for a call that is not one.
    collective: tuple[int, int, Sequence[int]] | None

    @property
    def desc(self) -> str: ...


class GroupAborts:
    """Per group id, the earliest collective a peer failed: ``known[group id] = (seq,
    reporting global rank, error type, text, the global rank to blame)``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.known: dict[int, tuple[int, int, str, str, int]] = {}

    def failed(self, group_id: int, seq: int) -> bool:
        """Whether a peer failed collective ``seq`` of ``group_id``, or an earlier one."""
        known = self.known.get(group_id)
        return known is not None and known[0] <= seq

    def message(self, group_id: int, seq: int, error: BaseException) -> list[Any] | None:
        """The abort to send the group's other ranks when collective ``seq`` of
        ``group_id`` failed here with ``error``; None when there is nothing to tell (not
        a ringcomm error, the group was closed here, or a peer's abort was the cause:
        every rank of the group heard it from that peer)."""
        if not isinstance(error, RingcommError) or isinstance(error, GroupClosedError):
            return None
        if self.failed(group_id, seq):
            return None
        peer = getattr(error, "peer", None)
        culprit = peer if isinstance(error, PeerFailedError) and type(peer) is int else -1
        return [group_id, seq, type(error).__name__, str(error)[:CTRL_TEXT_MAX], culprit]

    def record(self, culprit: int, group_id: int, seq: int, kind: str, text: str, src: int) -> bool:
        """Peer ``src``'s collective ``seq`` of ``group_id`` failed with ``kind``: ``text``
        (because of global rank ``culprit``). True if that is news: no earlier collective
        of the group was known failed (the engine then fails ours from ``seq`` on)."""
        if self.failed(group_id, seq):
            return False
        self.known[group_id] = (seq, src, kind, text, culprit)
        return True

    def error(self, group_id: int, what: str) -> RingcommError:
        """The error a call (``what``) of ``group_id`` raises after a peer's abort: the
        peer's error type and reason (a PeerFailedError names the rank that went)."""
        seq, src, kind, text, culprit = self.known[group_id]
        message = (
            f"rank {self.rank}: {what}: rank {src} failed collective #{seq} of this group, "
            f"so every rank fails it: {kind}: {text}"
        )
        cls = ABORT_ERRORS.get(kind)
        return PeerFailedError(message, peer=culprit) if cls is None else cls(message)

    def call_error(self, call: Call) -> RingcommError | None:
        """The abort error of collective ``call`` if a peer failed it (or an earlier one)."""
        c = call.collective
        if c is None or not self.failed(c[0], c[1]):
            return None
        return self.error(c[0], call.desc)
