"""Errors raised by ringcomm.

The tree (every public error is a ``RingcommError``)::

    RingcommError
    ├── CommTimeoutError          (also a builtin TimeoutError) a deadline passed
    ├── PeerFailedError           a peer died or aborted the group; names the peer
    ├── CollectiveMismatchError   ranks called different collectives/shapes/dtypes/ops
    │   └── MessageMismatchError  a recv's buffer does not match the message sent to it
    ├── AuthenticationError       wrong or missing job token
    ├── RendezvousError           could not form the group (store unreachable, bad config)
    ├── GroupClosedError          the group was closed, or failed earlier and stays failed
    ├── QueueLimitError           a peer has more unreceived messages buffered than the cap
    └── RankFailedError           a rank of a spawned job failed (launchers)

Messages name rank, peer, op and tag where they apply, built with :func:`where`.
Lower-layer errors (zmq, msgpack, OS) are mapped to these with ``raise X(...) from exc``.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "CollectiveMismatchError",
    "CommTimeoutError",
    "GroupClosedError",
    "MessageMismatchError",
    "PeerFailedError",
    "QueueLimitError",
    "RankFailedError",
    "RendezvousError",
    "RingcommError",
    "where",
]


def where(
    rank: int | None = None,
    peer: int | None = None,
    op: str | None = None,
    tag: object | None = None,
) -> str:
    """Format the standard location prefix: ``rank 1, peer 2, op recv, tag 7``."""
    parts = []
    if rank is not None:
        parts.append(f"rank {rank}")
    if peer is not None:
        parts.append(f"peer {peer}")
    if op is not None:
        parts.append(f"op {op}")
    if tag is not None:
        parts.append(f"tag {tag}")
    return ", ".join(parts)


class RingcommError(Exception):
    """Base class of every error ringcomm raises on purpose."""


class CommTimeoutError(RingcommError, TimeoutError):
    """A blocking call's deadline passed before it completed."""


class PeerFailedError(RingcommError):
    """A peer died, disconnected or aborted the group."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class CollectiveMismatchError(RingcommError):
    """Ranks called different collectives, shapes, dtypes, ops or roots."""


class MessageMismatchError(CollectiveMismatchError):
    """A message's size or dtype differs from the receive buffer posted for it."""


class AuthenticationError(RingcommError):
    """A connection presented no job token or the wrong one."""


class RendezvousError(RingcommError):
    """The group could not be formed: store unreachable, bad rank/world size, ..."""


class GroupClosedError(RingcommError):
    """The group is closed, or saw a failure earlier and stays failed."""


class QueueLimitError(RingcommError):
    """A peer sent more messages nobody received than the per-peer cap allows."""


class RankFailedError(RingcommError):
    """One or more ranks of a launched job failed.

    ``failures`` maps rank -> remote traceback text (or exit description);
    ``rank`` is the rank that failed first (``first``; by default the lowest listed);
    ``exitcodes`` maps rank -> exit code, for ranks that exited on their own.
    """

    def __init__(
        self,
        failures: dict[int, str],
        exitcodes: dict[int, int] | None = None,
        first: int | None = None,
    ) -> None:
        self.failures = dict(sorted(failures.items()))
        self.exitcodes = dict(exitcodes or {})
        if first is None or first not in self.failures:
            first = next(iter(self.failures)) if self.failures else -1
        self.rank = first
        lines = [f"{len(self.failures)} rank(s) failed: {sorted(self.failures)}"]
        for r, tb in self.failures.items():
            lines.append(f"--- rank {r} ---")
            lines.append(tb.rstrip())
        super().__init__("\n".join(lines))
