"""Ring schedule: reduce-scatter then all-gather, each ``world_size - 1`` steps.

The buffer of ``count`` elements is cut into ``world_size`` segments (:func:`segment_bounds`).
Every rank sends to its right neighbour ``(rank + 1) % n`` and receives from its left
neighbour ``(rank - 1) % n`` at every step; the functions here only say *which segment*.

Reduce-scatter, step ``k = 0 .. n-2`` on rank ``r``::

    send segment (r - k - 1) % n   # the partial sum received at step k-1 (own data at k=0)
    recv segment (r - k - 2) % n   # reduce the left neighbour's partial sum into it

Segment ``s`` starts as rank ``s+1``'s data at step 0, gains one rank's contribution per step
going right, and reaches rank ``s`` at the last step (``(r - n) % n == r``): after
reduce-scatter rank ``r`` owns the fully reduced segment ``r``, so ``reduce_scatter``
returns ``x[rank]`` as the API promises. The receiver combines ``local (op) incoming``
unless the collective chooses otherwise; either way only the owner computes segment ``r`` and
all-gather copies those bits, so every rank ends with identical bits.

All-gather, step ``k = 0 .. n-2`` on rank ``r``::

    send segment (r - k) % n       # own segment at k=0, then the one received at step k-1
    recv segment (r - k - 1) % n   # overwrite it with the left neighbour's copy

At every step, the segment rank ``r`` sends is the segment rank ``r+1`` receives.

Ring order. Every function also takes ``order``: the ranks in the order the ring visits
them (a permutation of ``range(n)``; None: ``0 .. n-1``), e.g. a group's host-contiguous
:attr:`ringcomm.schedule.topology.Topology.ring_order`, so the ring crosses each host
boundary once whatever the launcher's rank order. The schedule is then the one above for
the rank's *position* ``p`` in ``order`` (right neighbour ``order[p + 1]``), with position
``s``'s segment being segment ``order[s]``: rank ``r`` still owns segment ``r`` after
reduce-scatter (``reduce_scatter`` still returns ``x[rank]``).
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
