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

from ringcomm.schedule.partition import FlatLayout

from .nn import Layer, Params

__all__ = ["export_params", "init_layer", "layer_views", "param_shapes", "to_host"]


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
