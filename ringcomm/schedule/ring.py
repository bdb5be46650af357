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
"""

from __future__ import annotations

__all__ = [
    "all_gather_steps",
    "owned_segment",
    "reduce_scatter_steps",
    "ring_neighbors",
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


def ring_neighbors(rank: int, world_size: int) -> tuple[int, int]:
    """``(send_to, recv_from)``: the right and the left neighbour on the ring."""
    _check_rank(rank, world_size)
    return (rank + 1) % world_size, (rank - 1) % world_size


def owned_segment(rank: int, world_size: int) -> int:
    """Segment that ``rank`` holds fully reduced after reduce-scatter: ``rank`` itself."""
    _check_rank(rank, world_size)
    return rank


def reduce_scatter_steps(rank: int, world_size: int) -> list[tuple[int, int]]:
    """``[(send_segment, recv_segment), ...]`` for steps ``0 .. n-2`` (empty when n == 1).

    Send ``send_segment`` right; receive the left neighbour's ``recv_segment`` and reduce it
    into the local one. Afterwards ``owned_segment(rank, n) == rank`` is fully reduced.
    """
    _check_rank(rank, world_size)
    n = world_size
    return [((rank - k - 1) % n, (rank - k - 2) % n) for k in range(n - 1)]


def all_gather_steps(rank: int, world_size: int) -> list[tuple[int, int]]:
    """``[(send_segment, recv_segment), ...]`` for steps ``0 .. n-2`` (empty when n == 1).

    Starts from the owned segment ``rank``; ``recv_segment`` is overwritten with the copy
    the left neighbour sends. Afterwards every rank holds every segment.
    """
    _check_rank(rank, world_size)
    n = world_size
    return [((rank - k) % n, (rank - k - 1) % n) for k in range(n - 1)]
