"""Partitions for the training engine: pure functions of sizes and ranks, no arrays.

* :func:`split_rows`: ``n`` rows cut into ``parts`` contiguous, near-equal slices (a data
  parallel rank's slice of the global batch, a pipeline micro-batch).
* :func:`bucket_groups`: consecutive layers grouped into gradient buckets of about
  ``bucket_bytes``, filled from the last layer backwards (the order backward produces them,
  as DDP does), so a bucket is ready as soon as backward has passed its first layer.
* :func:`flat_layout`: where each parameter lives in one flat buffer whose *segments* (a
  bucket, or a ZeRO-3 layer) are each padded to a multiple of ``world_size`` elements, so a
  segment reshapes to ``(world_size, piece)`` rows for reduce-scatter/all-gather; rank
  ``r`` owns row ``r`` of every segment (:func:`shard_pieces`).
* :func:`balance_stages`: contiguous layer ranges for pipeline stages that minimise the
  largest stage cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "FlatLayout",
    "ParamSlot",
    "ShardPiece",
    "balance_stages",
    "bucket_groups",
    "flat_layout",
    "shard_pieces",
    "split_offsets",
    "split_rows",
]


def split_offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of the concatenated parts of ``sizes`` starts, and the total last:
    ``split_offsets([2, 0, 3]) == [0, 2, 2, 5]`` (the uneven collectives' segments)."""
    offsets = [0]
    for s in sizes:
        if s < 0:
            raise ValueError(f"sizes must be >= 0, got {list(sizes)}")
        offsets.append(offsets[-1] + s)
    return offsets


def split_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``n`` rows in ``parts`` contiguous slices, sizes differing by
    at most one, the larger ones first (``np.array_split``'s rule). Slices may be empty."""
    if parts <= 0:
        raise ValueError(f"parts must be > 0, got {parts}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    base, extra = divmod(n, parts)
    spans, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        spans.append((start, stop))
        start = stop
    return spans


def bucket_groups(layer_nbytes: Sequence[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """Layers ``[start, stop)`` per bucket, in the order backward completes them (last
    layers first). Walking from the last layer down, a bucket takes layers until adding the
    next would exceed ``bucket_bytes`` (a layer bigger than that gets a bucket of its own).
    Layers without parameters (0 bytes) join the bucket being filled. Empty model: ``[]``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    groups: list[tuple[int, int]] = []
    stop = len(layer_nbytes)
    filled = 0
    for i in range(len(layer_nbytes) - 1, -1, -1):
        nb = layer_nbytes[i]
        if nb < 0:
            raise ValueError(f"layer {i}: negative size {nb}")
        if filled > 0 and filled + nb > bucket_bytes:
            groups.append((i + 1, stop))
            stop, filled = i + 1, 0
        filled += nb
    if stop > 0:
        groups.append((0, stop))
    return groups


class ParamSlot(NamedTuple):
    layer: int
    name: str
    shape: tuple[int, ...]
    offset: int  # element offset in the flat buffer
    size: int  # elements


class FlatLayout(NamedTuple):
    """Where parameters live in a flat buffer. ``segments[k] = (offset, size)`` in elements,
    ``size`` a multiple of ``world_size``; ``segment_layers[k] = (start, stop)``."""

    slots: tuple[ParamSlot, ...]
    segments: tuple[tuple[int, int], ...]
    segment_layers: tuple[tuple[int, int], ...]
    world_size: int
    total: int  # elements, padding included
    numel: int  # parameters, padding excluded

    def layer_slots(self, layer: int) -> list[ParamSlot]:
        return [s for s in self.slots if s.layer == layer]

    def segment_of(self, layer: int) -> int:
        for k, (a, b) in enumerate(self.segment_layers):
            if a <= layer < b:
                return k
        raise ValueError(f"layer {layer} is in no segment")

    @property
    def shard_size(self) -> int:
        """Elements a rank owns: one row of every segment."""
        return sum(size for _, size in self.segments) // self.world_size


def flat_layout(
    param_shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
    segment_layers: Sequence[tuple[int, int]],
    world_size: int,
) -> FlatLayout:
    """Lay out every layer's parameters (``param_shapes[layer] = [(name, shape), ...]``)
    in layer order, one segment per ``segment_layers`` entry (contiguous, covering all
    layers, in any order: they are laid out by layer index), each padded with zeros to a
    multiple of ``world_size`` elements."""
    if world_size <= 0:
        raise ValueError(f"world_size must be > 0, got {world_size}")
    groups = sorted(segment_layers)
    expect = 0
    for a, b in groups:
        if a != expect or b < a:
            raise ValueError(
                f"segments must cover layers 0..{len(param_shapes)} contiguously: {groups}"
            )
        expect = b
    if expect != len(param_shapes):
        raise ValueError(
            f"segments must cover layers 0..{len(param_shapes)} contiguously: {groups}"
        )
    slots: list[ParamSlot] = []
    segments: list[tuple[int, int]] = []
    offset = numel = 0
    for a, b in groups:
        seg_start = offset
        for layer in range(a, b):
            for name, shape in param_shapes[layer]:
                size = 1
                for d in shape:
                    size *= int(d)
                slots.append(ParamSlot(layer, name, tuple(int(d) for d in shape), offset, size))
                offset += size
                numel += size
        used = offset - seg_start
        padded = -(-used // world_size) * world_size
        segments.append((seg_start, padded))
        offset = seg_start + padded
    return FlatLayout(tuple(slots), tuple(segments), tuple(groups), world_size, offset, numel)


class ShardPiece(NamedTuple):
    segment: int
    flat_offset: int  # where rank's row of the segment starts in the flat buffer
    shard_offset: int  # where it starts in the rank's contiguous shard buffer
    size: int  # elements (segment size / world_size)


def shard_pieces(layout: FlatLayout, rank: int) -> list[ShardPiece]:
    """Rank ``rank``'s row of every segment, and where it sits in a contiguous shard buffer
    of ``layout.shard_size`` elements (segments in layout order)."""
    n = layout.world_size
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} not in [0, {n})")
    pieces, shard_off = [], 0
    for k, (off, size) in enumerate(layout.segments):
        row = size // n
        pieces.append(ShardPiece(k, off + rank * row, shard_off, row))
        shard_off += row
    return pieces


def balance_stages(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Split layers ``0..len(costs)`` into ``num_stages`` contiguous non-empty ranges
    ``[(start, stop), ...]`` minimising the largest sum of costs (ties: the earliest cut)."""
    n = len(costs)
    if num_stages <= 0:
        raise ValueError(f"num_stages must be > 0, got {num_stages}")
    if n < num_stages:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ValueError(f"negative cost {c}")
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: minimal max-cost splitting the first i layers into s stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    spans, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        spans.append((j, i))
        i = j
    return spans[::-1]
