"""Tensor parallelism's building blocks: the conjugate pairs and sharded parameters.

The pairs (Megatron-LM's ``mappings.py``), each forward beside its backward, over the group
``tp.group`` (an :class:`~ringcomm.engine.mesh.AxisGroup` passed explicitly: no global
parallel state): :class:`CopyToTP` (*f*), :class:`ReduceFromTP` (*g*), and under sequence
parallelism :class:`GatherFromSequence` and :class:`ReduceScatterToSequence` (sequence is
axis 1 of ``(batch, seq, features)``); :func:`enter_tp`/:func:`exit_tp` pick a
:class:`TPContext`'s pair. A :class:`ParamSpec` gives a parameter's master shape and split.

Invariants: with a group of one rank every pair is the identity; every rank draws the
same seeded *master* weights and keeps its slice (:func:`shard`), so a tp run starts from
exactly ``single``'s parameters (:func:`unshard` puts them back together). Where each pair
goes: docs/architecture.md, section "engine/tp.py".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ringcomm.device.xp import get_xp

__all__ = [
    "CopyToTP",
    "GatherFromSequence",
    "ParamSpec",
    "ReduceFromTP",
    "ReduceScatterToSequence",
    "TPContext",
    "enter_tp",
    "exit_tp",
    "local_shape",
    "shard",
    "unshard",
]


class TPContext(NamedTuple):
    """This rank's place in its tensor-parallel group: the group (None: no tp), this
    rank's index in it and its size, and whether sequence parallelism is on."""

    group: Any = None
    rank: int = 0
    size: int = 1
    sequence_parallel: bool = False

    @classmethod
    def of(cls, group: Any, sequence_parallel: bool = False) -> TPContext:
        if group is None or group.size == 1:
            return cls()
        return cls(group, group.rank, group.size, sequence_parallel)


# -- the conjugate pairs ---------------------------------------------------------------
# Each collective below is the identity on a group of one rank; a pair names, forward
# beside backward, the two it runs.
def _identity(tp: TPContext, x: Any) -> Any:
    return x


def _all_reduce(tp: TPContext, x: Any) -> Any:
    """The sum of ``x`` over the group."""
    if tp.size == 1:
        return x
    return tp.group.all_reduce(get_xp(x).ascontiguousarray(x))


def _gather_seq(tp: TPContext, x: Any) -> Any:
    """``(b, s, d)`` shards -> ``(b, T*s, d)``, rank t's shard at sequence block t."""
    if tp.size == 1:
        return x
    xp = get_xp(x)
    b, s, d = x.shape
    out = xp.empty((tp.size, b, s, d), x.dtype)
    tp.group.all_gather(xp.ascontiguousarray(x), out=out)
    return out.transpose(1, 0, 2, 3).reshape(b, tp.size * s, d)


def _reduce_scatter_seq(tp: TPContext, x: Any) -> Any:
    """``(b, S, d)`` partial sums -> this rank's sequence block ``(b, S/T, d)`` of the sum."""
    if tp.size == 1:
        return x
    xp = get_xp(x)
    b, S, d = x.shape
    rows = xp.ascontiguousarray(x.reshape(b, tp.size, S // tp.size, d).transpose(1, 0, 2, 3))
    out = xp.empty((b, S // tp.size, d), x.dtype)
    tp.group.reduce_scatter(rows, out=out)
    return out


class CopyToTP:
    """f: identity forward, all_reduce (sum) of the input gradient backward."""

    forward = staticmethod(_identity)
    backward = staticmethod(_all_reduce)


class ReduceFromTP:
    """g: all_reduce (sum) of the partial outputs forward, identity backward."""

    forward = staticmethod(_all_reduce)
    backward = staticmethod(_identity)


class GatherFromSequence:
    """f under sequence parallelism: all_gather along the sequence forward,
    reduce_scatter along it backward."""

    forward = staticmethod(_gather_seq)
    backward = staticmethod(_reduce_scatter_seq)


class ReduceScatterToSequence:
    """g under sequence parallelism: reduce_scatter along the sequence forward,
    all_gather backward."""

    forward = staticmethod(_reduce_scatter_seq)
    backward = staticmethod(_gather_seq)


def enter_tp(tp: TPContext) -> type[CopyToTP | GatherFromSequence]:
    """The pair before a column-parallel layer: f, or all_gather under sequence parallel."""
    return GatherFromSequence if tp.sequence_parallel else CopyToTP


def exit_tp(tp: TPContext) -> type[ReduceFromTP | ReduceScatterToSequence]:
    """The pair after a row-parallel layer: g, or reduce_scatter under sequence parallel."""
    return ReduceScatterToSequence if tp.sequence_parallel else ReduceFromTP


# -- sharded parameters ----------------------------------------------------------------
class ParamSpec(NamedTuple):
    """A parameter: its master ``shape``; ``dim``, the master axis split over the tp ranks
    (None: replicated on every rank); ``view`` and ``split``, when the split is not one
    contiguous block of ``dim`` (fused QKV: ``(d, 3, heads, head_dim)`` split on the
    heads axis), the master reshaped to ``view`` and split on its axis ``split``.
    ``sp_reduce``: a replicated parameter whose gradient each rank computes from its
    sequence shard only under sequence parallelism (LayerNorms, biases after a g,
    positions), so it is all-reduced over the tp group."""

    name: str
    shape: tuple[int, ...]
    dim: int | None = None
    view: tuple[int, ...] | None = None
    split: int | None = None
    sp_reduce: bool = False

    def views(self) -> tuple[tuple[int, ...], int]:
        if self.dim is None:
            raise ValueError(f"{self.name} is replicated")
        if self.view is None:
            return self.shape, self.dim
        assert self.split is not None
        return self.view, self.split


def local_shape(spec: ParamSpec, size: int) -> tuple[int, ...]:
    """This rank's shape of ``spec`` over ``size`` tp ranks."""
    if spec.dim is None or size == 1:
        return spec.shape
    view, axis = spec.views()
    if view[axis] % size:
        raise ValueError(f"{spec.name}: {view[axis]} does not split over {size} ranks")
    shape = list(spec.shape)
    shape[spec.dim] //= size
    return tuple(shape)


def shard(spec: ParamSpec, master: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s slice of the host ``master`` array."""
    if spec.dim is None or size == 1:
        return master
    view, axis = spec.views()
    n = view[axis] // size
    index = (slice(None),) * axis + (slice(rank * n, (rank + 1) * n),)
    return master.reshape(view)[index].reshape(local_shape(spec, size))


def unshard(spec: ParamSpec, pieces: Sequence[np.ndarray]) -> np.ndarray:
    """The master array from every rank's slice, in rank order (the inverse of :func:`shard`)."""
    if spec.dim is None or len(pieces) == 1:
        return np.asarray(pieces[0])
    view, axis = spec.views()
    local_view = list(view)
    local_view[axis] //= len(pieces)
    parts = [np.asarray(p).reshape(local_view) for p in pieces]
    return np.concatenate(parts, axis=axis).reshape(spec.shape)
