"""Joining a group at the store: the checks its host makes before anybody waits.

A rank joins a group *instance* (a store namespace, e.g. ``pg0``) saying its rank, the world
size, its ringcomm version and who it is (host, pid). Pure bookkeeping, no sockets: the
store's server thread calls it.

Invariants: per namespace the first values told (or the launcher's world size) win, and a
join that disagrees (world size, rank out of range, a rank held by another process,
version) fails the whole namespace at once, so every rank raises ``RendezvousError``
naming both values instead of waiting out its deadline; a ``gated`` store admits joins to a
namespace only once its host opened it. Details: docs/architecture.md, section
"rendezvous/join.py".
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ringcomm.errors import RendezvousError

__all__ = ["Formations", "JoinRefusedError", "JoinRequest", "claim", "parse_claim"]

_CLAIM = re.compile(r"rank (\d+) of group (\S+)")


def claim(rank: int, ns: str) -> str:
    """What rank ``rank`` of the group in namespace ``ns`` asks a minted token as."""
    return f"rank {rank} of group {ns}"


def parse_claim(text: str | None) -> tuple[int, str] | None:
    """``(rank, ns)`` of a :func:`claim`, or None."""
    m = _CLAIM.fullmatch(text or "")
    return None if m is None else (int(m.group(1)), m.group(2))


class JoinRefusedError(RendezvousError):
    """The store's host refused this rank's group: a join disagreed (the message names
    both values). Every rank of the group raises it."""


@dataclass(frozen=True)
class JoinRequest:
    """What a rank says when it joins namespace ``ns``."""

    ns: str
    rank: int
    world_size: int
    version: str
    who: str  # e.g. "pid 123 on host a"
    nonce: str  # this join's identity (two processes never share one)
    opens: bool = False  # the join of the store's host: opens ``ns`` on a gated store

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> JoinRequest | None:
        """The request in a store message, or None when a field is missing or mistyped."""
        fields: dict[str, Any] = {}
        for name, kind in (
            ("ns", str),
            ("rank", int),
            ("world_size", int),
            ("version", str),
            ("who", str),
            ("nonce", str),
        ):
            value = body.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                return None
            fields[name] = value
        if not fields["ns"]:
            return None
        return cls(**fields, opens=body.get("opens") is True)

    def to_body(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Formation:
    """One namespace: the values it was formed with, who holds which rank, its failure."""

    world_size: int
    world_from: str
    version: str | None = None
    version_from: str = ""
    members: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (who, nonce)
    error: str | None = None


class Formations:
    """Every namespace joined at one store (see the module docstring).

    ``world_size``: what every group formed here must have (a launcher's rank count), named
    ``world_from`` in messages (e.g. ``"ringcomm run -n 2"``); None: the first join says.
    ``gated``: a namespace admits joins only once its host opened it.
    """

    def __init__(
        self, world_size: int | None = None, world_from: str = "the launcher", gated: bool = False
    ) -> None:
        self._world_size = world_size
        self._world_from = world_from
        self._gated = gated
        self._opened: set[str] = set()
        self._formations: dict[str, _Formation] = {}

    def admits(self, req: JoinRequest) -> bool:
        """Whether ``req`` may join now (False: its namespace is not opened yet, come
        back); the host's join opens it."""
        if req.opens:
            self._opened.add(req.ns)
        return not self._gated or req.ns in self._opened

    def join(self, req: JoinRequest) -> str | None:
        """Admit ``req``; None, or why not (the namespace then stays failed with it)."""
        f = self._formations.get(req.ns)
        if f is None:
            if self._world_size is not None:
                f = _Formation(self._world_size, self._world_from)
            else:
                f = _Formation(req.world_size, f"by rank {req.rank}, {req.who}")
            self._formations[req.ns] = f
        if f.error is not None:
            return f.error
        error = self._disagreement(f, req)
        if error is not None:
            f.error = error
            return error
        f.members[req.rank] = (req.who, req.nonce)
        if f.version is None:
            f.version, f.version_from = req.version, f"rank {req.rank}, {req.who}"
        return None

    @staticmethod
    def _disagreement(f: _Formation, req: JoinRequest) -> str | None:
        r = req.rank
        if req.world_size != f.world_size:
            return (
                f"rank {r} ({req.who}) says world_size={req.world_size}, the group was "
                f"formed with world_size={f.world_size} ({f.world_from})"
            )
        if not 0 <= r < f.world_size:
            return (
                f"rank {r} ({req.who}) is out of range: the group has ranks 0.."
                f"{f.world_size - 1} (world_size={f.world_size}, {f.world_from})"
            )
        held = f.members.get(r)
        if held is not None and held[1] != req.nonce:
            return (
                f"rank {r} joined twice: {req.who} says it is rank {r}, and so did "
                f"{held[0]} (every rank needs its own number)"
            )
        if f.version is not None and req.version != f.version:
            return (
                f"rank {r} ({req.who}) runs {req.version}, the group was formed by "
                f"{f.version} ({f.version_from})"
            )
        return None

    def claimed_twice(self, ns: str, rank: int, who: str, held: str) -> str | None:
        """A second process (``who``) claimed rank ``rank``'s token in ``ns`` after
        ``held``: fail the namespace with that if it is still forming (a formed group is
        left alone: a stranger's claim must not end it). The error, or None."""
        f = self._formations.get(ns)
        if f is None:
            f = _Formation(self._world_size or 0, self._world_from)
            self._formations[ns] = f
        if f.error is None and f.world_size and len(f.members) >= f.world_size:
            return None
        if f.error is None:
            f.error = (
                f"rank {rank} joined twice: {who} says it is rank {rank}, and so did "
                f"{held} (every rank needs its own number; or a process not of this "
                "job took its place)"
            )
        return f.error

    def failure(self, keys: list[str]) -> str | None:
        """The error of a failed namespace holding one of ``keys``, or None."""
        for ns, f in self._formations.items():
            if f.error is not None and any(k == ns or k.startswith(ns + "/") for k in keys):
                return f.error
        return None

    def failed(self) -> dict[str, str]:
        """Every failed namespace and its error."""
        return {ns: f.error for ns, f in self._formations.items() if f.error is not None}
