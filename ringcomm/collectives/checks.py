"""Argument checks of the collective calls (on the calling rank, before anything is sent:
TypeError/ValueError naming the rank and the call) and the array helpers they share."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.core.buffers import check_array, check_peer
from ringcomm.core.group_core import GroupCore
from ringcomm.device.staging import backend_for
from ringcomm.device.xp import get_xp
from ringcomm.ops import ReduceOp, check_op_dtype, parse_op

__all__ = [
    "call_label",
    "check_chunk_bytes",
    "check_counts",
    "check_flag",
    "check_op",
    "check_out",
    "check_out_apart",
    "check_out_or_new",
    "check_root",
    "check_row_array",
    "check_rows",
    "empty_like",
    "may_share_memory",
    "memory_kind",
    "same_memory",
]


def call_label(group: GroupCore, name: str) -> str:
    return f"rank {group.rank}: {name}"


# (op as passed, dtype) -> ReduceOp, for pairs that passed check_op (ops passed as a
# ReduceOp or a plain str): the check is pure, and the same few pairs come back call after
# call. Bounded (emptied when full).
CHECKED_OPS: dict[tuple[Any, np.dtype[Any]], ReduceOp] = {}
CHECKED_OPS_MAX = 256


def check_op(op: Any, dtype: np.dtype[Any], what: str) -> ReduceOp:
    cacheable = type(op) is ReduceOp or type(op) is str
    if cacheable:
        rop = CHECKED_OPS.get((op, dtype))
        if rop is not None:
            return rop
    try:
        rop = parse_op(op)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    try:
        check_op_dtype(rop, dtype)
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None
    if cacheable:
        if len(CHECKED_OPS) >= CHECKED_OPS_MAX:
            CHECKED_OPS.clear()
        CHECKED_OPS[op, dtype] = rop
    return rop


def check_flag(value: Any, what: str, name: str = "async_op") -> bool:
    if value is False or value is True:
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}: {name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_rows(x: np.ndarray, n: int, what: str, name: str = "x") -> None:
    if x.ndim == 0 or x.shape[0] != n:
        raise ValueError(
            f"{what}: {name}.shape[0] must equal the world size {n}, got shape {x.shape}"
        )


def check_out(
    out: Any, shape: tuple[int, ...], dtype: np.dtype[Any], what: str, like: Any = None
) -> Any:
    out = check_array(out, f"{what} (out)", writeable=True, device=True)
    if like is not None and memory_kind(out) != memory_kind(like):
        raise TypeError(
            f"{what}: out is a {type(out).__name__} but x is a {type(like).__name__} "
            "(host and device arrays cannot be mixed in one call)"
        )
    if out.dtype != dtype:
        raise TypeError(f"{what}: out has dtype {out.dtype}, expected {dtype}")
    if out.shape != shape:
        raise ValueError(f"{what}: out has shape {out.shape}, expected {shape}")
    return out


def check_out_or_new(out: Any, shape: tuple[int, ...], x: Any, what: str) -> Any:
    """``out`` checked (:func:`check_out`, of ``x``'s dtype and memory), or a new array of
    ``shape`` like ``x`` if None."""
    return empty_like(x, shape) if out is None else check_out(out, shape, x.dtype, what, x)


def check_out_apart(out: Any, shape: tuple[int, ...], x: Any, what: str, name: str) -> Any:
    """:func:`check_out_or_new` for a call that is not in place (``name``): a given ``out``
    must not overlap ``x``."""
    if out is None:
        return empty_like(x, shape)
    out = check_out(out, shape, x.dtype, what, x)
    if may_share_memory(out, x):
        raise ValueError(f"{what}: out must not overlap x ({name} is not in place)")
    return out


def memory_kind(x: Any) -> Any:
    """What memory ``x`` lives in: "host", or its device backend."""
    return "host" if type(x) is np.ndarray else backend_for(x)


def empty_like(like: Any, shape: tuple[int, ...]) -> Any:
    """A new array of ``shape`` and ``like``'s dtype, in the memory ``like`` lives in."""
    if type(like) is np.ndarray:
        return np.empty(shape, like.dtype)
    device = getattr(like, "device", None)  # CuPy: allocate on like's device
    if device is not None:
        with device:
            return get_xp(like).empty(shape, like.dtype)
    return get_xp(like).empty(shape, like.dtype)


def may_share_memory(a: Any, b: Any) -> bool:
    if type(a) is np.ndarray:
        return bool(np.may_share_memory(a, b))
    return backend_for(a).may_share_memory(a, b)


def same_memory(a: Any, b: Any) -> bool:
    if type(a) is not np.ndarray:
        return backend_for(a).same_memory(a, b)
    return bool(
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.nbytes == b.nbytes
    )


def check_root(root: Any, group: GroupCore, what: str, name: str) -> int:
    return check_peer(root, group.world_size, what, name)


def check_chunk_bytes(group: GroupCore, what: str, chunk: Any = None) -> int:
    chunk = group.chunk_bytes if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk <= 0:
        raise ValueError(f"{what}: pg.chunk_bytes must be a positive int, got {chunk!r}")
    limit = group.state.config.max_piece_bytes
    if chunk > limit:
        raise ValueError(
            f"{what}: chunk_bytes={chunk} is above this group's largest piece ({limit} bytes, "
            "what its receive sockets accept; RINGCOMM_CHUNK_BYTES raises it)"
        )
    return int(chunk)


def check_counts(value: Any, n: int, what: str, name: str) -> tuple[int, ...]:
    """``n`` row counts (ints >= 0) from a sequence (list, tuple, 1-d integer array)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise TypeError(
                f"{what}: {name} must be a sequence of ints, got an array {value.dtype}[{value.shape}]"
            )
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(
            f"{what}: {name} must be a sequence of {n} ints, got {type(value).__name__}"
        )
    counts = []
    for c in value:
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            raise TypeError(
                f"{what}: {name} must hold ints, got {type(c).__name__} in {list(value)!r}"
            )
        counts.append(int(c))
    if len(counts) != n:
        raise ValueError(
            f"{what}: {name} must have one count per rank ({n}), got {len(counts)}: {counts}"
        )
    if any(c < 0 for c in counts):
        raise ValueError(f"{what}: {name} must be >= 0, got {counts}")
    return tuple(counts)


def check_row_array(x: Any, what: str, *, writeable: bool = False) -> Any:
    x = check_array(x, what, writeable=writeable, device=True)
    if x.ndim == 0:
        raise ValueError(f"{what}: x must have at least one dimension (rows), got a 0-d array")
    return x
