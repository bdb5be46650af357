"""Hierarchical collectives for a group that spans hosts (``algo="hier"``).

:class:`Hierarchy` makes its sub-groups once (one per host, then one per piece across the
hosts: every rank of the group makes all of them, in one order, as ``new_group`` requires)
and runs all_reduce, all_gather, reduce_scatter, broadcast and barrier over them; large
calls go in segments whose inter-host step overlaps the host's step of the next. Its plan
is pure (:mod:`ringcomm.schedule.topology`). Every step of a call asks the call's one
:class:`~ringcomm.core.deadline.Deadline` what is left (:func:`step_s`), so the call ends
within its ``timeout_s``. It uses only the public calls of the groups it is given
(ringcomm.group's ProcessGroup), so it imports no group. The algorithms step by step:
docs/architecture.md ("Hierarchical collectives").
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from ringcomm.core.deadline import Deadline
from ringcomm.device.xp import get_xp
from ringcomm.ops import ReduceOp
from ringcomm.schedule.topology import Topology, hier_plan, piece_bounds
from ringcomm.tuning.costmodel import HIER_SEGMENT_BYTES

__all__ = ["FLAT_ALGO", "MIN_STEP_S", "Hierarchy", "step_s"]

#: The flat all_reduce a few leftover elements take (fewer than the pieces).
FLAT_ALGO = "ring"
#: Bytes per segment of a hierarchical call when nothing chose another (its steps overlap
#: segment by segment).
SEGMENT_BYTES = HIER_SEGMENT_BYTES


#: The least a step of a hierarchical call is given once its call's deadline has passed
#: (it then times out at once, naming the step and its sub-group).
MIN_STEP_S = 1e-3


def step_s(deadline: Deadline) -> float:
    """The time limit of the next step of a hierarchical call: what is left of the call's
    ``deadline``, at least :data:`MIN_STEP_S`."""
    return max(deadline.remaining(), MIN_STEP_S)


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
        self.local_rank = topo.local_rank(pg.rank)
        self.even = topo.uniform  # every host L = M ranks: one piece per local rank
        order = topo.ring_order
        #: None when the ranks are host-contiguous in rank order (no reordering needed)
        self.order: list[int] | None = None if order == tuple(range(len(order))) else list(order)
        #: where each host's block of rows starts in host order
        self.offsets = [sum(len(h) for h in topo.hosts[:k]) for k in range(topo.num_hosts)]

    # -- helpers ------------------------------------------------------------------------
    def _steps(self, deadline: Deadline | None) -> Callable[[], float]:
        """The time limit of each next step (:func:`step_s`) of a call ending at
        ``deadline`` (None: the group's default ``timeout_s`` from now)."""
        return partial(step_s, Deadline(self.pg.timeout_s) if deadline is None else deadline)

    @staticmethod
    def _segments(
        count: int, itemsize: int, rows: int, segment_bytes: int | None = None
    ) -> list[tuple[int, int]]:
        """``[c0, c1)`` spans of ``count`` elements of ``rows`` rows each, about
        ``segment_bytes`` (default SEGMENT_BYTES) a segment (at least one element, one
        empty span for count 0)."""
        seg = SEGMENT_BYTES if segment_bytes is None else segment_bytes
        per = max(1, seg // max(1, rows * itemsize))
        return [(c0, min(count, c0 + per)) for c0 in range(0, count, per)] or [(0, 0)]

    @staticmethod
    def _overlapped(
        spans: list[tuple[int, int]],
        start: Callable[[int, int], Any],
        finish: Callable[[Any], None],
    ) -> None:
        """``start`` each span (it returns what ``finish`` needs, e.g. an asynchronous
        inter-host Work), ``finish`` the one before: the two overlap."""
        pending: list[Any] = []
        for c0, c1 in spans:
            pending.append(start(c0, c1))
            if len(pending) > 1:
                finish(pending.pop(0))
        for item in pending:
            finish(item)

    def _block_pieces(self, count: int) -> list[list[tuple[int, int]]]:
        """``[h][j]``: piece j of host h's block of rows (its ``L_h * count`` elements),
        as offsets into the whole host-ordered buffer."""
        out = []
        for h, members in enumerate(self.topo.hosts):
            base = self.offsets[h] * count
            out.append(
                [
                    (base + a, base + b)
                    for a, b in piece_bounds(len(members) * count, self.plan.pieces)
                ]
            )
        return out

    def all_reduce(
        self, x: Any, op: ReduceOp, deadline: Deadline | None, segment_bytes: int | None = None
    ) -> Any:
        """``x`` reduced over the whole group, in place (``op`` not AVG on integers), in
        segments of ``segment_bytes`` (None: :data:`SEGMENT_BYTES`)."""
        t = self._steps(deadline)
        flat = x.reshape(-1)
        if flat.size == 0:
            return x
        avg = op is ReduceOp.AVG
        rop = ReduceOp.SUM if avg else op
        if self.even:
            self._even(flat, rop, t, segment_bytes)
        else:
            self._uneven(flat, rop, t)
        if avg:  # a sum over every rank: the mean (every rank divides the same sums)
            flat /= self.topo.world_size
        return x

    def _even(
        self, flat: Any, op: ReduceOp, t: Callable[[], float], segment_bytes: int | None
    ) -> None:
        """One piece per local rank: the host's reduce_scatter and all_gather (on its
        shared workspace, in place) over the first ``M * (count // M)`` elements, in
        segments: the host's steps of one overlap the inter-host all_reduce of the one
        before; the last ``count % M`` (fewer than M) are all-reduced flat."""
        m, local, me = self.plan.pieces, self.local, self.local.rank
        q, r = divmod(int(flat.size), m)

        def start(c0: int, c1: int) -> Any:
            rows = flat[c0 * m : c1 * m].reshape(m, c1 - c0)
            mine = rows[me]
            local.reduce_scatter(rows, out=mine, op=op, timeout_s=t())
            return self.cross[me].all_reduce(mine, op=op, async_op=True, timeout_s=t()), rows

        def finish(item: Any) -> None:
            work, rows = item
            work.wait(timeout_s=t())
            local.all_gather(rows[me], out=rows, timeout_s=t())  # in place

        if q:
            self._overlapped(self._segments(q, flat.itemsize, m, segment_bytes), start, finish)
        if r:
            self.pg.all_reduce(flat[q * m :], op=op, timeout_s=t(), algo=FLAT_ALGO)

    def _uneven(self, flat: Any, op: ReduceOp, t: Callable[[], float]) -> None:
        """Hosts of different sizes: piece j reduced onto local rank ``j % L``, all-reduced
        across the hosts by its owners, broadcast back from the owner."""
        size, local = self.local_size, self.local
        bounds = piece_bounds(int(flat.size), self.plan.pieces)
        if size > 1:
            for j, (a, b) in enumerate(bounds):
                local.reduce(flat[a:b], dst=j % size, op=op, timeout_s=t())
        for j, group in sorted(self.cross.items()):
            a, b = bounds[j]
            group.all_reduce(flat[a:b], op=op, timeout_s=t())
        if size > 1:
            for j, (a, b) in enumerate(bounds):
                local.broadcast(flat[a:b], src=j % size, timeout_s=t())

    # -- all_gather ---------------------------------------------------------------------
    def all_gather(
        self, x: Any, out: Any, deadline: Deadline | None, segment_bytes: int | None = None
    ) -> Any:
        """Every rank's ``x`` into ``out`` (``(world_size, *x.shape)``, rank order), in
        segments of ``segment_bytes`` of ``out`` (None: :data:`SEGMENT_BYTES`)."""
        t = self._steps(deadline)
        count = int(x.size)
        if count == 0:
            return out
        flat_x = x.reshape(-1)
        rows = out.reshape(self.topo.world_size, count)
        if self.even:
            self._all_gather_even(flat_x, rows, t, segment_bytes)
        else:
            self._all_gather_uneven(flat_x, rows, t)
        return out

    def _all_gather_even(
        self, flat_x: Any, rows: Any, t: Callable[[], float], segment_bytes: int | None
    ) -> None:
        """Across the hosts among the ranks of my local index, then over the host."""
        cross, local, hosts = self.cross[self.local_rank], self.local, self.topo.hosts

        def start(c0: int, c1: int) -> Any:
            return cross.all_gather(flat_x[c0:c1], async_op=True, timeout_s=t()), c0, c1

        def finish(item: Any) -> None:
            work, c0, c1 = item
            mine = work.wait(timeout_s=t())  # (H, w): my local index on every host
            both = local.all_gather(mine, timeout_s=t())  # (L, H, w)
            for h, members in enumerate(hosts):
                for i, r in enumerate(members):
                    rows[r, c0:c1] = both[i, h]

        self._overlapped(
            self._segments(int(flat_x.size), flat_x.itemsize, self.topo.world_size, segment_bytes),
            start,
            finish,
        )

    def _all_gather_uneven(self, flat_x: Any, rows: Any, t: Callable[[], float]) -> None:
        """The host's block first, then piece j of every host's block among piece j's
        owners, broadcast on each host from its owner there."""
        count, local, h = int(flat_x.size), self.local, self.host
        xp = get_xp(rows)  # (device arrays: their module, so the copies stay on the device)
        ordered = rows if self.order is None else xp.empty_like(rows)  # rows in host order
        mine = ordered[self.offsets[h] : self.offsets[h] + self.local_size]
        if self.local_size > 1:
            local.all_gather(flat_x, out=mine, timeout_s=t())
        else:
            mine[0] = flat_x
        flat = ordered.reshape(-1)
        pieces = self._block_pieces(count)
        for j in range(self.plan.pieces):
            spans = [p[j] for p in pieces]
            sizes = [b - a for a, b in spans]
            got = xp.empty(sum(sizes), flat.dtype)
            if j in self.cross:
                a, b = spans[h]
                self.cross[j].all_gather_v(flat[a:b], sizes=sizes, out=got, timeout_s=t())
            if self.local_size > 1:
                local.broadcast(got, src=j % self.local_size, timeout_s=t())
            at = 0
            for (a, b), n in zip(spans, sizes, strict=True):
                flat[a:b] = got[at : at + n]
                at += n
        if self.order is not None:
            rows[self.order] = ordered

    # -- reduce_scatter -----------------------------------------------------------------
    def reduce_scatter(
        self,
        x: Any,
        out: Any,
        op: ReduceOp,
        deadline: Deadline | None,
        segment_bytes: int | None = None,
    ) -> Any:
        """Row ``x[rank]`` of the reduction of ``x`` over the group, into ``out``
        (``op`` not AVG on integers), in segments of ``segment_bytes`` of ``x`` (None:
        :data:`SEGMENT_BYTES`)."""
        t = self._steps(deadline)
        n = self.topo.world_size
        count = int(x.size) // n
        if count == 0:
            return out
        rows = x.reshape(n, count)
        flat_out = out.reshape(-1)
        avg = op is ReduceOp.AVG
        rop = ReduceOp.SUM if avg else op
        if self.even:
            self._reduce_scatter_even(rows, flat_out, rop, t, segment_bytes)
        else:
            self._reduce_scatter_uneven(rows, flat_out, rop, t)
        if avg:
            flat_out /= n
        return out

    def _reduce_scatter_even(
        self,
        rows: Any,
        flat_out: Any,
        op: ReduceOp,
        t: Callable[[], float],
        segment_bytes: int | None,
    ) -> None:
        """Over the host, the rows of each local index's ranks onto that local rank;
        then across the hosts among the ranks of my local index."""
        cross, local, hosts = self.cross[self.local_rank], self.local, self.topo.hosts
        m, nh = self.plan.pieces, self.topo.num_hosts

        xp = get_xp(rows)

        def start(c0: int, c1: int) -> Any:
            by_local = xp.empty((m, nh, c1 - c0), rows.dtype)  # [i][h]: rank hosts[h][i]'s row
            for h, members in enumerate(hosts):
                for i, r in enumerate(members):
                    by_local[i, h] = rows[r, c0:c1]
            host_sums = local.reduce_scatter(by_local, op=op, timeout_s=t())  # (H, w)
            return cross.reduce_scatter(
                host_sums, out=flat_out[c0:c1], op=op, async_op=True, timeout_s=t()
            ), host_sums

        def finish(item: Any) -> None:
            item[0].wait(timeout_s=t())

        spans = self._segments(
            int(rows.shape[1]), rows.itemsize, self.topo.world_size, segment_bytes
        )
        self._overlapped(spans, start, finish)

    def _reduce_scatter_uneven(
        self, rows: Any, flat_out: Any, op: ReduceOp, t: Callable[[], float]
    ) -> None:
        """Piece j of every host's block of rows reduced onto its owner on each host,
        reduce-scattered among piece j's owners, broadcast on the host from the owner."""
        count, local, h = int(rows.shape[1]), self.local, self.host
        xp = get_xp(rows)
        ordered = (
            rows
            if self.order is None  # rows in host order
            else xp.concatenate([rows[i : i + 1] for i in self.order])
        )
        flat = ordered.reshape(-1)
        pieces = self._block_pieces(count)
        block = xp.empty(self.local_size * count, rows.dtype)  # my host's rows, reduced
        base = self.offsets[h] * count
        for j in range(self.plan.pieces):
            spans = [p[j] for p in pieces]
            sizes = [b - a for a, b in spans]
            part = xp.concatenate([flat[a:b] for a, b in spans])
            owner = j % self.local_size
            if self.local_size > 1:
                local.reduce(part, dst=owner, op=op, timeout_s=t())
            a, b = spans[h]
            if j in self.cross:
                self.cross[j].reduce_scatter_v(
                    part, sizes, out=block[a - base : b - base], op=op, timeout_s=t()
                )
        if self.local_size > 1:
            for j in range(self.plan.pieces):
                a, b = pieces[h][j]
                local.broadcast(block[a - base : b - base], src=j % self.local_size, timeout_s=t())
        me = self.local_rank
        flat_out[...] = block[me * count : (me + 1) * count]

    # -- broadcast and barrier ----------------------------------------------------------
    def broadcast(self, x: Any, src: int, deadline: Deadline | None) -> Any:
        """``src``'s ``x`` into every rank's ``x``: across the hosts among the ranks of
        ``src``'s local index, then on each host from that rank."""
        t = self._steps(deadline)
        flat = x.reshape(-1)
        if flat.size == 0:
            return x
        topo = self.topo
        index, src_host = topo.local_rank(src), topo.host_of[src]
        cross = self.cross.get(index)  # I am the rank of src's local index on my host
        local_src = index % self.local_size

        def start(c0: int, c1: int) -> Any:
            if cross is None:
                return None, c0, c1
            return cross.broadcast(flat[c0:c1], src=src_host, async_op=True, timeout_s=t()), c0, c1

        def finish(item: Any) -> None:
            work, c0, c1 = item
            if work is not None:
                work.wait(timeout_s=t())
            if self.local_size > 1:
                self.local.broadcast(flat[c0:c1], src=local_src, timeout_s=t())

        self._overlapped(self._segments(int(flat.size), flat.itemsize, 1), start, finish)
        return x

    def barrier(self, deadline: Deadline | None) -> None:
        """The host's barrier, its leaders' across the hosts, the host's again."""
        t = self._steps(deadline)
        if self.local_size > 1:
            self.local.barrier(timeout_s=t())
        if self.local_rank == 0:
            self.cross[0].barrier(timeout_s=t())
        if self.local_size > 1:
            self.local.barrier(timeout_s=t())
