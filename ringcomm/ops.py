"""Reduce ops: how two buffers are combined, written once over an ``xp`` array module.

The collectives call :func:`reduce_into` on every received piece and :func:`finalize` once
at the end, the same code for NumPy and CuPy (``xp = get_xp(acc)``). Semantics match NCCL:
floats in their own dtype (no widening, NaN propagates, overflow silent; AVG is SUM then
one division by ``world_size``); integers wrap, AVG truncates toward zero; bool SUM/MAX are
OR, PROD/MIN are AND, AVG raises. Any other dtype raises ``TypeError``.

Invariant: ``reduce_into(op, acc, incoming)`` computes ``acc (op) incoming``, and
``incoming_first=True`` the reverse: ops are commutative in value but not always bit for
bit, so algorithms that need identical bits on every rank fix the order. Per-dtype rules
in full: docs/architecture.md, section "ops.py".
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringcomm.device.xp import get_xp
from ringcomm.transport.wire import SUPPORTED_DTYPES  # the one list (the wire's dtypes)

__all__ = [
    "INTEGER_AVG_FUNCTIONS",
    "SUPPORTED_DTYPES",
    "ReduceOp",
    "check_op_dtype",
    "finalize",
    "parse_op",
    "reduce_in_order",
    "reduce_into",
    "reduce_out",
    "reduce_ufunc",
    "reference_reduce",
]


class ReduceOp(str, enum.Enum):
    """The reduce ops; each value is the lower-case string users may pass instead."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    def __str__(self) -> str:
        return self.value


_VALID_OPS = ", ".join(repr(o.value) for o in ReduceOp)

# ufunc name per op, for numbers and for bool. AVG reduces as SUM; finalize divides.
_NUMERIC_UFUNC = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.MAX: "maximum",
    ReduceOp.MIN: "minimum",
    ReduceOp.PROD: "multiply",
}
_BOOL_UFUNC = {
    ReduceOp.SUM: "logical_or",
    ReduceOp.MAX: "logical_or",
    ReduceOp.MIN: "logical_and",
    ReduceOp.PROD: "logical_and",
}


def parse_op(op: ReduceOp | str) -> ReduceOp:
    """``ReduceOp`` from a ``ReduceOp`` or a case-insensitive name (``"sum"``, ``"AVG"``)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op.strip().lower())
        except ValueError:
            pass
    raise ValueError(f"unknown reduce op {op!r}; valid ops: {_VALID_OPS}")


def check_op_dtype(op: ReduceOp | str, dtype: Any) -> None:
    """Raise ``TypeError`` if ``op`` cannot reduce arrays of ``dtype``; else return None.

    Unsupported dtypes (anything outside :data:`SUPPORTED_DTYPES`) and AVG on bool raise.
    An unknown op raises ``ValueError`` (from :func:`parse_op`).
    """
    op = parse_op(op)
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"not a dtype: {dtype!r}") from exc
    if dt not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(f"unsupported dtype {dt.name} for op {op}; supported: {names}")
    if op is ReduceOp.AVG and dt.kind == "b":
        raise TypeError("op avg is not defined for bool arrays (use sum, i.e. logical or)")


def _ufunc_name(op: ReduceOp, dtype: np.dtype[Any]) -> str:
    # Bool maps onto logical ops; AVG has no logical meaning.
    if dtype.kind != "b":
        return _NUMERIC_UFUNC[op]
    if op is ReduceOp.AVG:
        raise TypeError("op avg is not defined for bool arrays (use sum, i.e. logical or)")
    return _BOOL_UFUNC[op]


def reduce_ufunc(op: ReduceOp, dtype: np.dtype[Any], xp: Any = np) -> Any:
    """The ``xp`` ufunc that reduces ``dtype`` arrays with ``op`` (bool: logical ops).

    For hot paths that pick it once per call shape (see :func:`reduce_in_order`).
    """
    return getattr(xp, _ufunc_name(op, dtype))


_NULL_CONTEXT = contextlib.nullcontext()  # reusable


def _float_errors_silenced(xp: Any, dtype: np.dtype[Any]) -> Any:
    # NumPy warns on float overflow/invalid (inf, nan); IEEE results are the contract, so
    # silence it. Integer array wraps never warn. CuPy never warns.
    if xp is np and dtype.kind == "f":
        return np.errstate(over="ignore", invalid="ignore", under="ignore")
    return _NULL_CONTEXT


def _reduce_in_order(ufunc: Any, srcs: Sequence[Any], out: Any) -> None:
    ufunc(srcs[0], srcs[1], out=out)
    for src in srcs[2:]:
        ufunc(out, src, out=out)


# The same with NumPy's float warnings off. From NumPy 2, errstate as a decorator: made once
# (the context manager form builds an errstate per call, a third of the cost of a small
# reduction), and safe from any thread (the state lives in a context variable per call).
# Before NumPy 2 a decorating errstate keeps the saved state on itself: one per call then.
def _reduce_in_order_silently(ufunc: Any, srcs: Sequence[Any], out: Any) -> None:
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        _reduce_in_order(ufunc, srcs, out)


if int(np.__version__.split(".")[0]) >= 2:
    _reduce_in_order_silently = np.errstate(over="ignore", invalid="ignore", under="ignore")(
        _reduce_in_order
    )


def reduce_in_order(ufunc: Any, srcs: Sequence[Any], out: Any, *, silence: bool) -> None:
    """``out <- ((srcs[0] op srcs[1]) op srcs[2]) ...``: rank order, one NumPy ``ufunc``.

    For the hot path of small collectives: the caller picks the ufunc once per call shape
    (:func:`reduce_ufunc`, so bool maps onto logical ops) and nothing is
    checked here. At least two sources of ``out``'s dtype and shape; ``out`` may be
    ``srcs[0]`` or ``srcs[1]`` but no later source (the first step overwrites it).
    ``silence``: the arrays are NumPy floats (overflow and invalid stay silent, as in
    :func:`reduce_into`). AVG is the SUM phase (call :func:`finalize` after).
    """
    if silence:
        _reduce_in_order_silently(ufunc, srcs, out)
    else:
        _reduce_in_order(ufunc, srcs, out)


def reduce_into(
    op: ReduceOp | str, acc: Any, incoming: Any, *, incoming_first: bool = False
) -> None:
    """``acc <- acc (op) incoming`` in place (``incoming (op) acc`` if ``incoming_first``).

    ``acc`` is a writable NumPy or CuPy array; ``incoming`` an array of the same module,
    dtype and size (a read-only view of a received buffer is fine; a different shape of the
    same size is viewed as ``acc.shape``). One ufunc call with ``out=acc``: no temporaries.
    For AVG this is the SUM phase; call :func:`finalize` once all inputs are in.
    The dtype is trusted to be supported: check it once with :func:`check_op_dtype` at the
    collective's entry (this runs per chunk); only AVG on bool raises here.
    """
    op = parse_op(op)
    xp = get_xp(acc)
    # Same dtype and size, or the ufunc would cast or broadcast silently.
    if incoming.dtype != acc.dtype:
        raise TypeError(f"op {op}: incoming dtype {incoming.dtype} != buffer dtype {acc.dtype}")
    if incoming.shape != acc.shape:
        if incoming.size != acc.size:
            raise ValueError(
                f"op {op}: incoming has {incoming.size} elements, buffer has {acc.size}"
            )
        incoming = incoming.reshape(acc.shape)
    left, right = (incoming, acc) if incoming_first else (acc, incoming)
    _reduce_out(xp, op, left, right, acc)


def reduce_out(op: ReduceOp, a: Any, b: Any, out: Any) -> None:
    """``out <- a (op) b``: the out-of-place form of :func:`reduce_into`.

    Same semantics (bool maps onto logical ops, float overflow silent); for callers whose
    inputs must stay untouched (reduce_scatter, inner nodes of a reduce tree), so no copy
    of an input is made first. ``b`` is viewed as ``a``'s shape; nothing else is checked
    (this runs per piece). AVG is the SUM phase (call :func:`finalize` after).
    """
    _reduce_out(get_xp(out), op, a, b.reshape(a.shape), out)


def _reduce_out(xp: Any, op: ReduceOp, a: Any, b: Any, out: Any) -> None:
    with _float_errors_silenced(xp, out.dtype):
        reduce_ufunc(op, out.dtype, xp)(a, b, out=out)


def finalize(op: ReduceOp | str, acc: Any, world_size: int) -> None:
    """Finish a reduction in place: AVG divides the SUM by ``world_size``; other ops: no-op.

    Floats: ``acc /= world_size`` (true division in the buffer's dtype). Integers: division
    truncating toward zero, exact for every value in NumPy and CuPy (integer arithmetic
    only, :data:`INTEGER_AVG_FUNCTIONS`; signed dtypes use one temporary, once per
    collective). Bool: TypeError.
    """
    op = parse_op(op)
    if op is not ReduceOp.AVG:
        return
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_op_dtype(op, acc.dtype)  # bool and unsupported dtypes raise here
    xp = get_xp(acc)
    if acc.dtype.kind == "f":
        with _float_errors_silenced(xp, acc.dtype):
            xp.divide(acc, world_size, out=acc)
    else:
        _truncating_divide(xp, acc, world_size)


#: The only ``xp`` functions the integer AVG path calls (a CPU test pins it down): integer
#: arithmetic and comparisons, whose integer loops are integer code in NumPy and in CuPy.
#: Not ``fmod``/``remainder``-by-C-semantics or any true division: CuPy's ``fmod`` on
#: integers computes ``fmod((double)a, (double)b)``, which is wrong beyond 2**53.
INTEGER_AVG_FUNCTIONS = frozenset({"floor_divide", "add", "less", "multiply", "empty_like"})


def _truncating_divide(xp: Any, acc: Any, divisor: int) -> None:
    """``acc <- trunc(acc / divisor)`` in place for an integer array, ``divisor >= 1``.

    Integer arithmetic only (:data:`INTEGER_AVG_FUNCTIONS`), exact for every value of
    every integer dtype in NumPy and CuPy alike: floor division is truncation for values
    >= 0, and for a negative value ``trunc(a / d) == floor((a + d - 1) / d)``, where
    ``a + d - 1`` cannot overflow (``a < 0`` and ``d - 1 <= max``). Scalars go in as
    NumPy scalars of the array's dtype, so neither module promotes to another type.
    """
    if divisor == 1:
        return
    dtype = acc.dtype
    # A divisor beyond the dtype's range: go through int64 (rare: int8 with > 127 ranks).
    if divisor > np.iinfo(dtype).max:
        wide = acc.astype(np.int64)
        _truncating_divide(xp, wide, divisor)
        acc[...] = wide
        return
    d = dtype.type(divisor)
    if dtype.kind == "u":  # unsigned: floor == truncation
        xp.floor_divide(acc, d, out=acc)
        return
    bias = xp.empty_like(acc)
    xp.less(acc, dtype.type(0), out=bias)  # 1 where negative, else 0 (bool -> int: exact)
    xp.multiply(bias, dtype.type(divisor - 1), out=bias)
    xp.add(acc, bias, out=acc)
    xp.floor_divide(acc, d, out=acc)


# ----------------------------------------------------------------------------- test oracle

_ORACLE_BINARY: dict[ReduceOp, Callable[[Any, Any], Any]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.PROD: np.multiply,
}
_ORACLE_BOOL: dict[ReduceOp, Callable[[Any, Any], Any]] = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.PROD: np.logical_and,
}


def reference_reduce(op: ReduceOp | str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Naive NumPy oracle: ``((a0 op a1) op a2) ...`` in rank order, in a new array.

    Independent of :func:`reduce_into` (no ``out=``, integer AVG truncated through Python
    ints), for tests only. Same semantics as the module docstring.
    """
    op = parse_op(op)
    if not arrays:
        raise ValueError("reference_reduce needs at least one array")
    first = np.asarray(arrays[0])
    check_op_dtype(op, first.dtype)
    for a in arrays[1:]:
        if a.dtype != first.dtype or a.shape != first.shape:
            raise ValueError("reference_reduce: arrays differ in dtype or shape")
    table = _ORACLE_BOOL if first.dtype.kind == "b" else _ORACLE_BINARY
    with np.errstate(all="ignore"):
        result = functools.reduce(table[op], arrays[1:], first.copy())
        result = np.asarray(result, dtype=first.dtype)
        if op is ReduceOp.AVG:
            result = _oracle_average(result, len(arrays))
    return np.asarray(result, dtype=first.dtype)


def _oracle_average(total: np.ndarray, world_size: int) -> np.ndarray:
    # Floats: one true division in the dtype. Integers: Python-int truncation toward zero.
    if total.dtype.kind == "f":
        return np.asarray(total / world_size, dtype=total.dtype)
    quotients = [
        (abs(int(v)) // world_size) * (1 if v >= 0 else -1) for v in total.ravel().tolist()
    ]
    return np.array(quotients, dtype=total.dtype).reshape(total.shape)
