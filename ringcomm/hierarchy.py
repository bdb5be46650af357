"""Hierarchical collectives for a group that spans hosts (``algo="hier"``).

The plan is pure (:mod:`ringcomm.schedule.topology`): the buffer is cut into M pieces
(M = the most ranks any host has); each piece is reduced onto its owner on every host
(over the host's own sub-group: its shared workspace), all-reduced among the owners of
that piece across the hosts (one sub-group per piece, one rank per host: every local rank
drives its own inter-host ring), and sent back from the owner to its host. With the same
number of ranks on every host the first and last steps are the host's reduce_scatter and
all_gather (its shared workspace; the ``count % M`` elements left over go flat over the
whole group); otherwise one reduce and one broadcast per piece.

:class:`Hierarchy` makes its sub-groups once (every rank of the group makes all of them,
in one order, as ``new_group`` requires) and runs the calls. It uses only the public
calls of the groups it is given (ringcomm.group's ProcessGroup), so it imports no group.
"""

from __future__ import annotations

from typing import Any

from .ops import ReduceOp
from .schedule.topology import Topology, hier_plan, piece_bounds

__all__ = ["FLAT_ALGO", "Hierarchy"]

#: The flat all_reduce a few leftover elements take (fewer than the pieces).
FLAT_ALGO = "ring"
#: Bytes per segment of a hierarchical all_reduce (its steps overlap segment by segment).
SEGMENT_BYTES = 8 << 20


class Hierarchy:
    """The sub-groups and calls of hierarchical collectives over ``pg`` (module docstring)."""

    def __init__(self, pg: Any, topo: Topology) -> None:
        self.topo = topo
        self.plan = plan = hier_plan(topo)
        self.pg = pg
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
        self.even = topo.uniform  # every host L = M ranks: one piece per local rank

    def all_reduce(self, x: Any, op: ReduceOp, timeout_s: float | None) -> Any:
        """``x`` reduced over the whole group, in place (``op`` not AVG on integers)."""
        flat = x.reshape(-1)
        if flat.size == 0:
            return x
        avg = op is ReduceOp.AVG
        rop = ReduceOp.SUM if avg else op
        if self.even:
            self._even(flat, rop, timeout_s)
        else:
            self._uneven(flat, rop, timeout_s)
        if avg:  # a sum over every rank: the mean (every rank divides the same sums)
            flat /= self.topo.world_size
        return x

    def _even(self, flat: Any, op: ReduceOp, timeout_s: float | None) -> None:
        """One piece per local rank: the host's reduce_scatter and all_gather (on its
        shared workspace) over the first ``M * (count // M)`` elements; the last
        ``count % M`` (fewer than M) are all-reduced flat over the whole group."""
        m, local, me = self.plan.pieces, self.local, self.local.rank
        q, r = divmod(int(flat.size), m)
        # Segments of about SEGMENT_BYTES: the host's steps of one overlap the inter-host
        # all_reduce of the one before (it is asynchronous).
        per = max(1, SEGMENT_BYTES // (m * flat.itemsize))
        pending: list[tuple[Any, Any, Any]] = []  # (work, my piece, the segment's rows)
        for c0 in range(0, q, per):
            c1 = min(q, c0 + per)
            rows = flat[c0 * m : c1 * m].reshape(m, c1 - c0)
            mine = rows[me]
            mine[...] = local.reduce_scatter(rows, op=op, timeout_s=timeout_s)
            pending.append((self.cross[me].all_reduce(mine, op=op, async_op=True,
                                                      timeout_s=timeout_s), mine, rows))  # fmt: skip
            if len(pending) > 1:
                self._gather(pending.pop(0), timeout_s)
        for item in pending:
            self._gather(item, timeout_s)
        if r:
            self.pg.all_reduce(flat[q * m :], op=op, timeout_s=timeout_s, algo=FLAT_ALGO)

    def _gather(self, item: tuple[Any, Any, Any], timeout_s: float | None) -> None:
        work, mine, rows = item
        work.wait(timeout_s=timeout_s)
        self.local.all_gather(mine.copy(), out=rows, timeout_s=timeout_s)

    def _uneven(self, flat: Any, op: ReduceOp, timeout_s: float | None) -> None:
        """Hosts of different sizes: piece j reduced onto local rank ``j % L``, all-reduced
        across the hosts by its owners, broadcast back from the owner."""
        size, local = self.local_size, self.local
        bounds = piece_bounds(int(flat.size), self.plan.pieces)
        if size > 1:
            for j, (a, b) in enumerate(bounds):
                local.reduce(flat[a:b], dst=j % size, op=op, timeout_s=timeout_s)
        for j, group in sorted(self.cross.items()):
            a, b = bounds[j]
            group.all_reduce(flat[a:b], op=op, timeout_s=timeout_s)
        if size > 1:
            for j, (a, b) in enumerate(bounds):
                local.broadcast(flat[a:b], src=j % size, timeout_s=timeout_s)
