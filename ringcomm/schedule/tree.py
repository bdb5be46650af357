"""Broadcast/reduce trees with any root: a binomial tree and a chain (for pipelining).

Both work on the relative rank ``vrank = (rank - root) % n`` (the root is vrank 0). Binomial
tree (MPICH's): the parent of ``vrank`` clears its lowest set bit; :func:`binomial_children`
lists the children largest subtree first, so a broadcast finishes in ``ceil(log2 n)``
rounds. Chain: ``root, root+1, ..., root-1`` (mod n), for pipelined broadcasts.

Invariant: a reduce receives its children in ``reversed(children)`` order and combines
``local (op) incoming``, evaluating one fixed bracketing in vrank order: the same bits on
every run. Details: docs/architecture.md, section "schedule/tree.py".
"""

from __future__ import annotations

from collections.abc import Sequence

from ringcomm.schedule.ring import ring_position

__all__ = ["binomial_children", "binomial_parent", "binomial_rounds", "chain_neighbors"]


def _check(rank: int, world_size: int, root: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if not 0 <= root < world_size:
        raise ValueError(f"root {root} out of range for world_size {world_size}")


def binomial_parent(rank: int, world_size: int, root: int) -> int | None:
    """The rank ``rank`` receives from in a binomial broadcast; ``None`` for the root."""
    _check(rank, world_size, root)
    vrank = (rank - root) % world_size
    if vrank == 0:
        return None
    parent_vrank = vrank & (vrank - 1)  # clear the lowest set bit
    return (parent_vrank + root) % world_size


def binomial_children(rank: int, world_size: int, root: int) -> list[int]:
    """The ranks ``rank`` sends to in a binomial broadcast, largest subtree first."""
    _check(rank, world_size, root)
    vrank = (rank - root) % world_size
    # Masks below the lowest set bit of vrank (all of them for the root).
    limit = vrank & -vrank if vrank else 1 << (world_size - 1).bit_length()
    children = []
    mask = limit >> 1
    while mask:
        if vrank + mask < world_size:
            children.append((vrank + mask + root) % world_size)
        mask >>= 1
    return children


def binomial_rounds(world_size: int) -> int:
    """Rounds a binomial broadcast takes, one send per rank per round: ``ceil(log2 n)``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return (world_size - 1).bit_length()


def chain_neighbors(
    rank: int, world_size: int, root: int, order: Sequence[int] | None = None
) -> tuple[int | None, int | None]:
    """``(prev, next)`` along the chain ``root, root+1, ..., root-1``; None at the ends.

    ``order``: the ranks in ring order (a permutation; None: ``0 .. n-1``, see
    :mod:`ringcomm.schedule.ring`): the chain then runs from ``root`` along ``order``,
    wrapping around (``root``'s position, the next position, ...)."""
    _check(rank, world_size, root)
    if order is None:
        vrank = (rank - root) % world_size
        prev = None if vrank == 0 else (rank - 1) % world_size
        nxt = None if vrank == world_size - 1 else (rank + 1) % world_size
        return prev, nxt
    p, q = ring_position(rank, world_size, order), ring_position(root, world_size, order)
    vrank = (p - q) % world_size
    prev = None if vrank == 0 else order[(p - 1) % world_size]
    nxt = None if vrank == world_size - 1 else order[(p + 1) % world_size]
    return prev, nxt
