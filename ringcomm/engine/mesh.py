"""A device mesh: the world's ranks as a ``dp x pp x tp`` grid and a group per axis.

``DeviceMesh(pg, dp=D, pp=P, tp=T)`` (torch's ``DeviceMesh`` is the anchor) places world
rank ``r = (d * P + p) * T + t`` at ``(d, p, t)``: tp is the fastest axis, dp the slowest.
Each axis has one sub-group per line of the grid along it; a rank keeps its own as
:class:`AxisGroup` s, which forward the collectives and p2p and count, per axis, the payload
and the bytes this rank sends under the ring algorithms.

Invariant: ``new_group`` is collective, so :func:`mesh_groups` lists every sub-group in one
deterministic order (axes ``dp, pp, tp``, lines row-major; an axis of size 1 makes none)
and every rank creates them all in that order. Details: docs/architecture.md, section
"engine/mesh.py".
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["AXES", "AxisGroup", "DeviceMesh", "mesh_groups"]

#: The mesh's axes, slowest first.
AXES = ("dp", "pp", "tp")


def mesh_groups(dp: int, pp: int, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every sub-group of the mesh as ``(axis, world ranks)``, in the order every rank
    creates them (axes of size 1 have none)."""
    dims = {"dp": dp, "pp": pp, "tp": tp}
    out = []
    for axis in AXES:
        if dims[axis] == 1:
            continue
        others = [a for a in AXES if a != axis]
        for fixed in itertools.product(*(range(dims[a]) for a in others)):
            coords = dict(zip(others, fixed))
            ranks = []
            for i in range(dims[axis]):
                coords[axis] = i
                ranks.append((coords["dp"] * pp + coords["pp"]) * tp + coords["tp"])
            out.append((axis, tuple(ranks)))
    return out


class AxisGroup:
    """One axis's sub-group of this rank (``pg`` None: a group of one, every call a no-op
    or a refusal), with byte counters (see the module docstring)."""

    def __init__(self, axis: str, pg: Any, as_comm: Any = None) -> None:
        self.axis, self.pg = axis, pg
        self.size = pg.world_size if pg is not None else 1
        self.rank = pg.rank if pg is not None else 0
        self.as_comm = as_comm if as_comm is not None else (lambda a: a)
        self.payload_bytes = 0
        self.sent_bytes = 0.0

    def all_reduce(self, x: Any, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce ``x`` in place over the axis; returns ``x`` (``async_op``: a Work, or
        None for a group of one)."""
        if self.size == 1:
            return None if async_op else x
        n = self.size
        self.payload_bytes += int(x.nbytes)
        self.sent_bytes += 2 * (n - 1) / n * x.nbytes
        work = self.pg.all_reduce(self.as_comm(x), op=op, async_op=async_op)
        return work if async_op else x

    def reduce_scatter(self, x: Any, out: Any) -> Any:
        """``out`` = this rank's row of the sum of ``x`` (``x.shape[0] == size``)."""
        n = self.size
        self.payload_bytes += int(x.nbytes)
        self.sent_bytes += (n - 1) / n * x.nbytes
        self.pg.reduce_scatter(self.as_comm(x), out=self.as_comm(out))
        return out

    def all_gather(self, x: Any, out: Any) -> Any:
        """``out`` = ``(size, *x.shape)``, every rank's ``x`` in rank order."""
        self.payload_bytes += int(x.nbytes)
        self.sent_bytes += (self.size - 1) * x.nbytes
        self.pg.all_gather(self.as_comm(x), out=self.as_comm(out))
        return out

    def isend(self, x: Any, dst: int, tag: int) -> Any:
        self.payload_bytes += int(x.nbytes)
        self.sent_bytes += x.nbytes
        return self.pg.isend(self.as_comm(x), dst=dst, tag=tag)

    def recv(self, x: Any, src: int, tag: int) -> Any:
        return self.pg.recv(self.as_comm(x), src=src, tag=tag)

    def workspace_bytes(self) -> int:
        """The group's own count of its collectives' inputs on the shared workspace."""
        return int(self.pg.stats()["workspace_bytes"]) if self.pg is not None else 0

    def close(self) -> None:
        if self.pg is not None:
            self.pg.close()


class DeviceMesh:
    """``dp x pp x tp`` over ``pg`` (``pg`` None: the 1x1x1 mesh of a single process).

    ``coords`` is this rank's ``{"dp": d, "pp": p, "tp": t}``; ``self.dp``, ``self.pp``,
    ``self.tp`` its :class:`AxisGroup` s; :meth:`rank_of` the world rank at coordinates.
    Collective: every rank of ``pg`` builds the mesh with the same sizes."""

    def __init__(self, pg: Any, dp: int = 1, pp: int = 1, tp: int = 1, as_comm: Any = None):
        world = pg.world_size if pg is not None else 1
        if min(dp, pp, tp) < 1 or dp * pp * tp != world:
            raise ValueError(
                f"mesh dp {dp} x pp {pp} x tp {tp} = {dp * pp * tp} does not match the "
                f"{world} ranks"
            )
        self.shape = {"dp": dp, "pp": pp, "tp": tp}
        rank = pg.rank if pg is not None else 0
        self.coords = {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}
        mine: dict[str, Any] = {}
        for axis, ranks in mesh_groups(dp, pp, tp):
            sub = pg.new_group(ranks)  # collective: every rank, every group, this order
            if sub is not None:
                mine[axis] = sub
        self.dp = AxisGroup("dp", mine.get("dp"), as_comm)
        self.pp = AxisGroup("pp", mine.get("pp"), as_comm)
        self.tp = AxisGroup("tp", mine.get("tp"), as_comm)

    def rank_of(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        return (dp * self.shape["pp"] + pp) * self.shape["tp"] + tp

    def axes(self) -> dict[str, AxisGroup]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    def close(self) -> None:
        for g in self.axes().values():
            g.close()
