"""Which server holds which part of which key: pure functions, no sockets.

A *slicer* maps ``(key, nelem, itemsize)`` to :class:`Piece` s, contiguous element ranges of
the key's flat array, each held by one server (ps-lite's ``Slicer``; any object with
``slice(key, nelem, itemsize, num_servers)`` will do). Small arrays live whole on one
server: :class:`HashSlicer` (default) picks ``blake2b(key) % num_servers``,
:class:`RangeSlicer` cuts the key space into equal ranges. Arrays of at least
``split_min_bytes`` are split over *all* servers by :func:`split_even`.

Invariants: placement is stable across processes and runs (no salted ``hash``); server
``i`` of ``S`` gets elements ``[i*n//S, (i+1)*n//S)``, so pieces differ by at most one.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Protocol

__all__ = [
    "DEFAULT_SPLIT_MIN_BYTES",
    "HashSlicer",
    "Piece",
    "RangeSlicer",
    "Slicer",
    "check_key",
    "split_even",
]

#: Arrays of at least this many bytes are split over every server.
DEFAULT_SPLIT_MIN_BYTES = 1 << 20
#: Keys are non-negative integers below this (they travel in an int64 header field).
KEY_LIMIT = 1 << 62


class Piece(NamedTuple):
    """Elements ``[start, stop)`` of a key's flat array live on ``server``."""

    server: int
    start: int
    stop: int

    @property
    def nelem(self) -> int:
        return self.stop - self.start


class Slicer(Protocol):
    def slice(self, key: int, nelem: int, itemsize: int, num_servers: int) -> list[Piece]:
        """The pieces of ``key`` (``nelem`` elements of ``itemsize`` bytes), in element
        order, covering ``[0, nelem)`` exactly; no two pieces on one server."""


def check_key(key: object) -> int:
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < KEY_LIMIT:
        raise ValueError(f"ps: a key must be an int in [0, 2**62), got {key!r}")
    return key


def split_even(nelem: int, num_servers: int) -> list[Piece]:
    """``nelem`` elements cut into ``num_servers`` contiguous near-equal pieces (empty
    pieces dropped: an array smaller than the server count uses fewer servers)."""
    if num_servers < 1:
        raise ValueError(f"ps: num_servers must be >= 1, got {num_servers}")
    if nelem < 0:
        raise ValueError(f"ps: nelem must be >= 0, got {nelem}")
    pieces = []
    for i in range(num_servers):
        start, stop = i * nelem // num_servers, (i + 1) * nelem // num_servers
        if stop > start:
            pieces.append(Piece(i, start, stop))
    return pieces


class _SplittingSlicer:
    """Shared rule: split at ``split_min_bytes``; otherwise whole on :meth:`home`."""

    def __init__(self, split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES) -> None:
        if split_min_bytes < 1:
            raise ValueError(f"ps: split_min_bytes must be >= 1, got {split_min_bytes}")
        self.split_min_bytes = split_min_bytes

    def home(self, key: int, num_servers: int) -> int:
        raise NotImplementedError

    def slice(self, key: int, nelem: int, itemsize: int, num_servers: int) -> list[Piece]:
        check_key(key)
        if num_servers < 1:
            raise ValueError(f"ps: num_servers must be >= 1, got {num_servers}")
        if nelem * itemsize >= self.split_min_bytes and num_servers > 1 and nelem > 1:
            return split_even(nelem, num_servers)
        return [Piece(self.home(key, num_servers), 0, nelem)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(split_min_bytes={self.split_min_bytes})"


class HashSlicer(_SplittingSlicer):
    """Small keys on ``blake2b(key) % num_servers``; large arrays split over all."""

    def home(self, key: int, num_servers: int) -> int:
        digest = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=8).digest()
        return int.from_bytes(digest, "little") % num_servers


class RangeSlicer(_SplittingSlicer):
    """Small keys by range: server ``key * num_servers // key_space``."""

    def __init__(
        self, split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES, key_space: int = 1 << 16
    ) -> None:
        super().__init__(split_min_bytes)
        if not 1 <= key_space <= KEY_LIMIT:
            raise ValueError(f"ps: key_space must be in [1, 2**62], got {key_space}")
        self.key_space = key_space

    def home(self, key: int, num_servers: int) -> int:
        if key >= self.key_space:
            raise ValueError(
                f"ps: key {key} is outside the range slicer's key space [0, {self.key_space})"
            )
        return key * num_servers // self.key_space
