"""Hostfiles and rank placement for multi-host launch (pure: no I/O but reading a file).

Accepted hostfile lines (comments start at ``#``; blank lines are skipped):

* ``host``                      one slot (OpenMPI's default)
* ``host slots=N``              OpenMPI / DeepSpeed (``max_slots=M`` is accepted and ignored)
* ``host:N``                    Horovod; ``[v6addr]:N`` for an IPv6 literal with slots

``-H h1:2,h2:2`` (or ``-H h1,h2``) lists the same thing inline. A host named twice adds
its slots to the first mention (as OpenMPI does). Ranks are placed contiguously per host,
hosts in file order: host 0 gets ranks 0..slots-1, and so on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "HostSlots",
    "HostfileError",
    "Placement",
    "assign_ranks",
    "parse_hostfile",
    "parse_hosts_option",
    "read_hostfile",
]

_HOST = re.compile(r"[A-Za-z0-9_.@%\-]+|\[[0-9A-Fa-f:.%A-Za-z]+\]|[0-9A-Fa-f:]+")


class HostfileError(ValueError):
    """A hostfile or ``-H`` list that cannot be used; the message names the line."""


@dataclass(frozen=True)
class HostSlots:
    host: str  # as written: a name, an ssh_config alias, ``user@host`` or an address
    slots: int


@dataclass(frozen=True)
class Placement:
    """Where one rank runs."""

    rank: int
    host: str
    host_index: int  # position of ``host`` among the hosts in use (0: the master's host)
    local_rank: int
    local_world_size: int


def _check_host(host: str, where: str) -> str:
    if not host or not _HOST.fullmatch(host) or host.startswith("-"):
        raise HostfileError(f"{where}: {host!r} is not a host name or address")
    return host


def _slots(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise HostfileError(f"{where}: slots must be a positive integer, got {text!r}")
    return int(text)


def _split_host_colon(item: str, where: str) -> HostSlots:
    """``host``, ``host:N``, ``[v6]:N``, or a bare IPv6 literal (no slots)."""
    if item.startswith("["):
        host, sep, rest = item.partition("]")
        host += "]"
        if not sep:
            raise HostfileError(f"{where}: unclosed '[' in {item!r}")
        if not rest:
            return HostSlots(_check_host(host, where)[1:-1], 1)
        if not rest.startswith(":"):
            raise HostfileError(f"{where}: expected ':N' after {host!r}, got {rest!r}")
        return HostSlots(_check_host(host, where)[1:-1], _slots(rest[1:], where))
    if item.count(":") == 1:
        host, _, n = item.partition(":")
        return HostSlots(_check_host(host, where), _slots(n, where))
    return HostSlots(_check_host(item, where), 1)


def _has_colon_slots(item: str) -> bool:
    """Whether ``item`` carries ``:N`` slots (``host:N`` or ``[v6]:N``)."""
    return ("]:" in item) if item.startswith("[") else item.count(":") == 1


def _merge(entries: Sequence[HostSlots]) -> list[HostSlots]:
    order: dict[str, int] = {}
    for e in entries:
        order[e.host] = order.get(e.host, 0) + e.slots
    return [HostSlots(h, n) for h, n in order.items()]


def parse_hostfile(text: str, name: str = "hostfile") -> list[HostSlots]:
    """Parse hostfile ``text`` (formats in the module docstring)."""
    entries: list[HostSlots] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}:{lineno}"
        first, *rest = line.split()
        slots: int | None = None
        for word in rest:
            key, sep, value = word.partition("=")
            if not sep:
                raise HostfileError(f"{where}: unexpected {word!r} (expected key=value)")
            if key == "slots":
                slots = _slots(value, where)
            elif key == "max_slots":
                _slots(value, where)
            else:
                raise HostfileError(f"{where}: unknown setting {key!r} (known: slots, max_slots)")
        entry = _split_host_colon(first, where)
        if slots is not None:
            if _has_colon_slots(first):
                raise HostfileError(f"{where}: slots given twice in {line!r}")
            entry = HostSlots(entry.host, slots)
        entries.append(entry)
    if not entries:
        raise HostfileError(f"{name}: no hosts listed")
    return _merge(entries)


def read_hostfile(path: str) -> list[HostSlots]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise HostfileError(f"cannot read hostfile {path}: {exc.strerror or exc}") from None
    return parse_hostfile(text, name=path)


def parse_hosts_option(value: str) -> list[HostSlots]:
    """``-H h1:2,h2:2`` or ``-H h1,h2``."""
    items = [item.strip() for item in value.split(",")]
    if not value.strip() or any(not item for item in items):
        raise HostfileError(f"-H {value!r}: empty host in the list")
    return _merge([_split_host_colon(item, f"-H {value!r}") for item in items])


def assign_ranks(
    hosts: Sequence[HostSlots], nproc: int | None = None, nproc_per_node: int | None = None
) -> list[Placement]:
    """Place ranks contiguously per host, hosts in order.

    ``nproc_per_node`` replaces every host's slot count. ``nproc`` None: fill every slot;
    fewer than the slots: the first hosts are filled and the rest are not used; more:
    :class:`HostfileError` (no oversubscription).
    """
    if nproc_per_node is not None and nproc_per_node < 1:
        raise HostfileError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    slots = [(h.host, nproc_per_node or h.slots) for h in hosts]
    total = sum(n for _, n in slots)
    if nproc is None:
        nproc = total
    if nproc < 1:
        raise HostfileError(f"-n must be >= 1, got {nproc}")
    if nproc > total:
        listed = ", ".join(f"{h}:{n}" for h, n in slots)
        raise HostfileError(f"-n {nproc} ranks do not fit in {total} slot(s) ({listed})")
    placements: list[Placement] = []
    rank = 0
    for index, (host, n) in enumerate(slots):
        here = min(n, nproc - rank)
        if here == 0:
            break
        for local in range(here):
            placements.append(Placement(rank, host, index, local, here))
            rank += 1
    return placements
