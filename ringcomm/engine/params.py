"""Flat contiguous parameter and gradient buffers, and views into them.

A :class:`~ringcomm.schedule.partition.FlatLayout` says where each parameter lives; a
buffer is one 1-D array of ``layout.total`` elements (or one segment of it), and each
layer's parameters are reshaped *views* of it, so buckets and shards are views, not copies.

Initialisation is deterministic per layer: layer ``i`` draws from
``numpy.random.default_rng([seed, i])`` on the host, whatever the strategy, world size or
device, so every strategy starts from bit-identical parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ringcomm.engine.nn import Layer, Params
from ringcomm.schedule.partition import FlatLayout

__all__ = ["BufferPool", "export_params", "init_layer", "layer_views", "param_shapes", "to_host"]


def param_shapes(layers: Sequence[Layer]) -> list[list[tuple[str, tuple[int, ...]]]]:
    return [layer.param_shapes() for layer in layers]


def layer_views(layout: FlatLayout, buf: Any, layer: int, base: int = 0) -> Params:
    """Views of ``layer``'s parameters in ``buf``, whose element 0 is element ``base`` of the
    layout (``base`` = the segment offset when ``buf`` holds one segment only)."""
    return {
        s.name: buf[s.offset - base : s.offset - base + s.size].reshape(s.shape)
        for s in layout.layer_slots(layer)
    }


def init_layer(layers: Sequence[Layer], layer: int, views: Params, seed: int) -> None:
    """Fill ``layer``'s parameter views deterministically from ``(seed, layer)``."""
    if views:
        layers[layer].init(np.random.default_rng([seed, layer]), views)


def to_host(x: Any) -> np.ndarray:
    """A NumPy copy of ``x`` (NumPy or CuPy)."""
    return np.array(x.get() if hasattr(x, "get") else x, copy=True)


def export_params(
    layers: Sequence[Layer], layout: FlatLayout, buf: Any, only: Sequence[int] | None = None
) -> dict[str, np.ndarray]:
    """Host copies ``{"<layer>.<name>": array}`` of the parameters of ``only`` (default all
    layers) from a full flat buffer."""
    out = {}
    for i in range(len(layers)) if only is None else only:
        for name, v in layer_views(layout, buf, i).items():
            out[f"{i}.{name}"] = to_host(v)
    return out


class BufferPool:
    """Reusable flat work buffers (ZeRO-2 gradient buckets, ZeRO-3 gathered layers).

    ``acquire(n)`` hands out the first ``n`` elements of a free slot (slots are made on
    demand, each ``slot_size`` elements); ``release(view)`` returns it. Why not allocate and
    drop: an array passed to a ringcomm collective is only freed by Python's cyclic garbage
    collector once the operation is done (the completed operation sits in a reference
    cycle), so dropped buffers would pile up until the next full collection. Reusing a few
    slots bounds the memory regardless; the strategy's in-flight limits bound the slots.
    """

    def __init__(self, xp: Any, slot_size: int, dtype: Any) -> None:
        self.xp, self.slot_size, self.dtype = xp, int(slot_size), dtype
        self.free: list[Any] = []
        self.slots = 0
        self._busy: dict[int, Any] = {}

    def acquire(self, n: int, zero: bool = False) -> Any:
        if n > self.slot_size:
            raise ValueError(f"buffer of {n} elements asked from a pool of {self.slot_size}")
        if self.free:
            slot = self.free.pop()
        else:
            slot = self.xp.empty(self.slot_size, self.dtype)
            self.slots += 1
        view = slot[:n]
        if zero:
            view[...] = 0
        self._busy[id(view)] = slot
        return view

    def release(self, view: Any) -> None:
        self.free.append(self._busy.pop(id(view)))

    @property
    def nbytes(self) -> int:
        return int(self.slots * self.slot_size * self.dtype.itemsize)
