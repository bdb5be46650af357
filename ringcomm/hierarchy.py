"""Hierarchical collectives for a group that spans hosts (``algo="hier"``).

The plan is pure (:mod:`ringcomm.schedule.topology`): the buffer is cut into M pieces
(M = the most ranks any host has); each piece is reduced onto its owner on every host
(over the host's own sub-group: its shared workspace), all-reduced among the owners of
that piece across the hosts (one sub-group per piece, one rank per host: every local rank
drives its own inter-host ring), and sent back from the owner to its host. With the same
number of ranks on every host the first and last steps are one reduce_scatter_v and one
all_gather_v; otherwise one reduce and one broadcast per piece.

:class:`Hierarchy` makes its sub-groups once (every rank of the group makes all of them,
in one order, as ``new_group`` requires) and runs the calls. It uses only the public
calls of the groups it is given (ringcomm.group's ProcessGroup), so it imports no group.
"""

from __future__ import annotations

from typing import Any

from .ops import ReduceOp
from .schedule.topology import Topology, hier_plan, piece_bounds

__all__ = ["Hierarchy"]


class Hierarchy:
    """The sub-groups and calls of hierarchical collectives over ``pg`` (module docstring)."""

    def __init__(self, pg: Any, topo: Topology) -> None:
        self.topo = topo
        self.plan = plan = hier_plan(topo)
        self.rank = pg.rank
        self.host = topo.host_of[pg.rank]
        self.local: Any = None
        for members in topo.hosts:  # every rank makes every host's group, in host order
            group = pg.new_group(list(members))
            if group is not None:
                self.local = group
        self.cross: dict[int, Any] = {}
        for j, owners in enumerate(plan.owners):  # then one group per piece, in piece order
            group = pg.new_group(list(owners))
            if group is not None:
                self.cross[j] = group
        self.local_size = len(topo.hosts[self.host])
        self.even = self.local_size == plan.pieces  # one piece per local rank

    def all_reduce(self, x: Any, op: ReduceOp, timeout_s: float | None) -> Any:
        """``x`` reduced over the whole group, in place (``op`` not AVG on integers)."""
        flat = x.reshape(-1)
        if flat.size == 0:
            return x
        avg = op is ReduceOp.AVG
        rop = ReduceOp.SUM if avg else op
        m, size = self.plan.pieces, self.local_size
        bounds = piece_bounds(int(flat.size), m)
        local = self.local
        me = local.rank
        # 1. each piece reduced onto its owner on this host
        if size > 1:
            if self.even:
                counts = [b - a for a, b in bounds]
                mine = local.reduce_scatter_v(flat, counts, op=rop, timeout_s=timeout_s)
                a, b = bounds[me]
                flat[a:b] = mine
            else:
                for j, (a, b) in enumerate(bounds):
                    local.reduce(flat[a:b], dst=j % size, op=rop, timeout_s=timeout_s)
        # 2. each owned piece all-reduced with its owners on the other hosts
        for j, group in sorted(self.cross.items()):
            a, b = bounds[j]
            group.all_reduce(flat[a:b], op=rop, timeout_s=timeout_s)
        if avg:  # a sum over every rank so far: the mean, on the owned pieces
            n = self.topo.world_size
            for j in self.cross:
                a, b = bounds[j]
                flat[a:b] /= n
        # 3. each piece back from its owner to this host
        if size > 1:
            if self.even:
                a, b = bounds[me]
                counts = [hi - lo for lo, hi in bounds]
                local.all_gather_v(flat[a:b].copy(), counts, out=flat, timeout_s=timeout_s)
            else:
                for j, (a, b) in enumerate(bounds):
                    local.broadcast(flat[a:b], src=j % size, timeout_s=timeout_s)
        return x
