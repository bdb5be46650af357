"""Ring schedule: reduce-scatter then all-gather, each ``world_size - 1`` steps (pure).

The buffer is cut into ``world_size`` segments (:func:`segment_bounds`); at every step each
rank sends to its right neighbour and receives from its left one, and the functions here
say only *which segment*. ``order`` (a permutation of the ranks; None: ``0 .. n-1``, e.g.
:attr:`ringcomm.schedule.topology.Topology.ring_order`) is the order the ring visits them.

Invariants: after reduce-scatter rank ``r`` owns the fully reduced segment ``r`` whatever
``order`` (so ``reduce_scatter`` returns ``x[rank]``); only the owner computes a segment and
all-gather copies its bits, so every rank ends with identical bits; at every step the
segment a rank sends is the one its right neighbour receives. The step formulas:
docs/architecture.md, section "schedule/ring.py".
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "all_gather_steps",
    "owned_segment",
    "reduce_scatter_steps",
    "ring_neighbors",
    "ring_position",
    "segment_bounds",
]


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")


def segment_bounds(count: int, world_size: int) -> list[tuple[int, int]]:
    """Element ``(start, stop)`` of each of ``world_size`` segments, covering ``[0, count)``.

    The first ``count % world_size`` segments hold one element more than the others; with
    ``count < world_size`` the last ones are empty (``start == stop``), never missing.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    base, extra = divmod(count, world_size)
    bounds = []
    start = 0
    for segment in range(world_size):
        # Segments before `extra` take one of the leftover elements.
        stop = start + base + (1 if segment < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_position(rank: int, world_size: int, order: Sequence[int] | None = None) -> int:
    """Where ``rank`` is on the ring: its index in ``order`` (``rank`` itself for None)."""
    _check_rank(rank, world_size)
    if order is None:
        return rank
    if len(order) != world_size or sorted(order) != list(range(world_size)):
        raise ValueError(f"order must be a permutation of range({world_size}), got {order}")
    return list(order).index(rank)


def ring_neighbors(
    rank: int, world_size: int, order: Sequence[int] | None = None
) -> tuple[int, int]:
    """``(send_to, recv_from)``: the right and the left neighbour on the ring."""
    p = ring_position(rank, world_size, order)
    right, left = (p + 1) % world_size, (p - 1) % world_size
    return (right, left) if order is None else (order[right], order[left])


def owned_segment(rank: int, world_size: int) -> int:
    """Segment that ``rank`` holds fully reduced after reduce-scatter: ``rank`` itself
    (in any ring order)."""
    _check_rank(rank, world_size)
    return rank


def reduce_scatter_steps(
    rank: int, world_size: int, order: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """``[(send_segment, recv_segment), ...]`` for steps ``0 .. n-2`` (empty when n == 1).

    Send ``send_segment`` right; receive the left neighbour's ``recv_segment`` and reduce it
    into the local one. Afterwards ``owned_segment(rank, n) == rank`` is fully reduced.
    """
    p, n = ring_position(rank, world_size, order), world_size
    steps = [((p - k - 1) % n, (p - k - 2) % n) for k in range(n - 1)]
    return steps if order is None else [(order[a], order[b]) for a, b in steps]


def all_gather_steps(
    rank: int, world_size: int, order: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """``[(send_segment, recv_segment), ...]`` for steps ``0 .. n-2`` (empty when n == 1).

    Starts from the owned segment ``rank``; ``recv_segment`` is overwritten with the copy
    the left neighbour sends. Afterwards every rank holds every segment.
    """
    p, n = ring_position(rank, world_size, order), world_size
    steps = [((p - k) % n, (p - k - 1) % n) for k in range(n - 1)]
    return steps if order is None else [(order[a], order[b]) for a, b in steps]
