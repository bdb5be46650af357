"""Which ranks share a host, and the pieces of a hierarchical collective (pure).

:func:`topology`: hosts numbered in the order of their lowest rank, each host's ranks
ascending; a rank's local rank is its index there, the host's leader its first rank;
:attr:`Topology.ring_order` lists the ranks host by host, so a ring in that order crosses
each host boundary once. :func:`hier_plan`: a hierarchical all_reduce cuts the buffer into
``M = max(ranks per host)`` pieces, each reduced onto its owner within the host,
all-reduced among the owners of that piece across hosts and sent back, so no single
leader carries everything. Details: docs/architecture.md, section "schedule/topology.py".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ringcomm.schedule.partition import split_rows

__all__ = ["HierPlan", "Topology", "hier_plan", "piece_bounds", "topology"]


@dataclass(frozen=True)
class Topology:
    """Ranks by host (``hosts[h]``: host h's group ranks, ascending; ``host_of[r]``)."""

    hosts: tuple[tuple[int, ...], ...]
    host_of: tuple[int, ...]

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def world_size(self) -> int:
        return len(self.host_of)

    def local_rank(self, rank: int) -> int:
        return self.hosts[self.host_of[rank]].index(rank)

    def local_size(self, rank: int) -> int:
        return len(self.hosts[self.host_of[rank]])

    @property
    def leaders(self) -> tuple[int, ...]:
        """The first rank of each host."""
        return tuple(h[0] for h in self.hosts)

    @property
    def ring_order(self) -> tuple[int, ...]:
        """Every rank, host by host (hosts in order, each host's ranks ascending)."""
        return tuple(r for h in self.hosts for r in h)

    @property
    def max_local_size(self) -> int:
        return max(len(h) for h in self.hosts)

    @property
    def uniform(self) -> bool:
        """Every host has the same number of ranks."""
        return len({len(h) for h in self.hosts}) == 1


def topology(host_ids: Sequence[str]) -> Topology:
    """The topology of a group whose rank r runs on host ``host_ids[r]``."""
    index: dict[str, int] = {}
    members: list[list[int]] = []
    host_of = []
    for rank, hid in enumerate(host_ids):
        h = index.setdefault(hid, len(members))
        if h == len(members):
            members.append([])
        members[h].append(rank)
        host_of.append(h)
    return Topology(tuple(tuple(m) for m in members), tuple(host_of))


def piece_bounds(count: int, pieces: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``pieces`` near-equal consecutive pieces of ``count`` elements
    (the first ``count % pieces`` one longer: :func:`~ringcomm.schedule.partition.split_rows`)."""
    return split_rows(count, pieces)


@dataclass(frozen=True)
class HierPlan:
    """What a hierarchical collective of a :class:`Topology` does (module docstring)."""

    pieces: int  # M
    #: owners[j][h]: the group rank on host h that owns piece j
    owners: tuple[tuple[int, ...], ...]

    def owned_by(self, rank: int) -> list[int]:
        """The pieces ``rank`` owns, ascending."""
        return [j for j, row in enumerate(self.owners) if rank in row]

    def owner_local(self, topo: Topology, j: int, host: int) -> int:
        """Piece ``j``'s owner on ``host`` as a local rank there."""
        return j % len(topo.hosts[host])


def hier_plan(topo: Topology) -> HierPlan:
    """The pieces and their owners (module docstring)."""
    m = topo.max_local_size
    owners = tuple(tuple(h[j % len(h)] for h in topo.hosts) for j in range(m))
    return HierPlan(m, owners)
