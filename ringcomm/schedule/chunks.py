"""Chunk spans: how a buffer of ``nbytes`` is cut into pieces of at most ``chunk_bytes``."""

from __future__ import annotations

__all__ = ["chunk_spans", "num_chunks"]


def _piece_bytes(chunk_bytes: int, itemsize: int) -> int:
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    if itemsize <= 0:
        raise ValueError(f"itemsize must be > 0, got {itemsize}")
    # Whole elements per piece (so a reduction can run on each piece), at least one.
    return max(itemsize, (chunk_bytes // itemsize) * itemsize)


def num_chunks(nbytes: int, chunk_bytes: int, itemsize: int = 1) -> int:
    """Number of pieces ``chunk_spans`` returns (1 for an empty buffer)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    piece = _piece_bytes(chunk_bytes, itemsize)
    return max(1, -(-nbytes // piece))


def chunk_spans(nbytes: int, chunk_bytes: int, itemsize: int = 1) -> list[tuple[int, int]]:
    """``[(offset, length), ...]`` in bytes covering ``[0, nbytes)`` in order.

    Every piece holds whole elements of ``itemsize`` bytes and at most ``chunk_bytes``
    bytes (but at least one element). An empty buffer is one empty piece ``[(0, 0)]``: a
    message is still sent, so the receiver's call completes.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes % max(itemsize, 1) != 0:
        raise ValueError(f"nbytes {nbytes} is not a multiple of itemsize {itemsize}")
    piece = _piece_bytes(chunk_bytes, itemsize)
    if nbytes == 0:
        return [(0, 0)]
    return [(off, min(piece, nbytes - off)) for off in range(0, nbytes, piece)]
