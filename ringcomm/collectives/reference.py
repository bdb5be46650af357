"""Naive collectives over point-to-point, kept as a test oracle (slow on purpose).

Everything goes through rank 0: the others send it their data with ``pg.send``, rank 0
combines with :func:`ringcomm.ops.reference_reduce` (rank order, no ``out=``) and sends the
result back. Independent of the algorithms under test except for ``send``/``recv``. Tags
come from a range user code is unlikely to use (``REFERENCE_TAG`` and up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ringcomm.ops import ReduceOp, parse_op, reference_reduce

if TYPE_CHECKING:
    from ringcomm.group import ProcessGroup

__all__ = [
    "REFERENCE_TAG",
    "naive_all_gather",
    "naive_all_reduce",
    "naive_broadcast",
    "naive_reduce_scatter",
]

REFERENCE_TAG = (1 << 62) + 0x5EF


def _gather_to_0(pg: ProcessGroup, x: np.ndarray) -> list[np.ndarray] | None:
    if pg.rank != 0:
        pg.send(np.ascontiguousarray(x), 0, REFERENCE_TAG)
        return None
    parts = [np.array(x, copy=True)]
    for src in range(1, pg.world_size):
        buf = np.empty_like(parts[0])
        pg.recv(buf, src, REFERENCE_TAG)
        parts.append(buf)
    return parts


def naive_broadcast(pg: ProcessGroup, x: np.ndarray, src: int = 0) -> np.ndarray:
    """A new array with ``src``'s ``x`` on every rank (sent directly to each rank)."""
    out = np.array(x, copy=True)
    if pg.rank == src:
        for dst in range(pg.world_size):
            if dst != src:
                pg.send(out, dst, REFERENCE_TAG + 1)
    else:
        pg.recv(out, src, REFERENCE_TAG + 1)
    return out


def naive_all_reduce(pg: ProcessGroup, x: np.ndarray, op: ReduceOp | str = "sum") -> np.ndarray:
    """A new array: ``reference_reduce(op, [x of rank 0, 1, ...])`` on every rank."""
    parts = _gather_to_0(pg, x)
    result = reference_reduce(parse_op(op), parts) if parts is not None else np.empty_like(x)
    return naive_broadcast(pg, result, 0)


def naive_reduce_scatter(pg: ProcessGroup, x: np.ndarray, op: ReduceOp | str = "sum") -> Any:
    """Row ``rank`` of :func:`naive_all_reduce` of ``x`` (``x.shape[0] == world_size``)."""
    return naive_all_reduce(pg, x, op)[pg.rank].copy()


def naive_all_gather(pg: ProcessGroup, x: np.ndarray) -> np.ndarray:
    """``(world_size, *x.shape)``: every rank's ``x`` in rank order, on every rank."""
    parts = _gather_to_0(pg, x)
    stacked = np.stack(parts) if parts is not None else np.empty((pg.world_size, *x.shape), x.dtype)
    return naive_broadcast(pg, stacked, 0)
