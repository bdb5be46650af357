"""Torch tensors as ringcomm arrays, for the torch backend: checks, views, reduce ops.

Every function works on the tensors of the call this thread is making
(:func:`ringcomm.torch_backend.device.current_call`): NumPy arrays on the host, the device's
arrays on a device, always on the tensor's own memory (a contiguous copy where the caller's
tensor is not contiguous, copied back by the call's post step). Data movement carries any
dtype, as raw bytes where ringcomm has no such dtype; reductions take the NumPy dtypes,
bfloat16 (in float32, on a copy) and complex SUM/AVG (as pairs of floats).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch._C._distributed_c10d import ReduceOp

from ringcomm.torch_backend.device import array_of, current_call, tensor_of

__all__ = [
    "Post",
    "Reduction",
    "by_dtype",
    "check_same_dtype",
    "check_tensor",
    "check_world_multiple",
    "contig",
    "copy_back",
    "from_move_view",
    "is_async",
    "move_view",
    "parse_op",
    "reduce_out",
    "reduce_view",
    "rows_view",
    "run_all",
    "splits",
    "timeout_of",
]

#: A step run once the ringcomm operations are done (copy results back, cast, ...).
Post = Callable[[], object]

_RC_OPS = {
    ReduceOp.SUM: "sum",
    ReduceOp.AVG: "avg",
    ReduceOp.PRODUCT: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
}
# bool-only meanings of the bitwise ops (logical AND is MIN, OR is MAX on bool).
_BOOL_BITWISE = {ReduceOp.BAND: "min", ReduceOp.BOR: "max"}
# torch dtypes whose ``tensor.numpy()`` gives a dtype ringcomm carries.
_NUMPY_DTYPES = {
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.float32,
    torch.float64,
}


def check_tensor(t: Any, what: str) -> torch.Tensor:
    """Check a tensor of the current call: a dense tensor on the CPU or on the rank's device,
    on the same device as the call's others (:meth:`ringcomm.torch_backend.device.CallScope.check`)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported")
    return current_call().check(t)


def check_same_dtype(what: str, inp: torch.Tensor, out: torch.Tensor) -> None:
    """TypeError unless the call's input and output tensors have one dtype."""
    if inp.dtype != out.dtype:
        raise TypeError(f"{what}: input dtype {inp.dtype} != output dtype {out.dtype}")


def check_world_multiple(
    what: str, n: int, whole: torch.Tensor, whole_name: str, part: torch.Tensor, part_name: str
) -> None:
    """ValueError unless ``whole`` has world size ``n`` times ``part``'s elements (an
    all-gather's output and input, a reduce-scatter's input and output)."""
    if whole.numel() != part.numel() * n:
        raise ValueError(
            f"{what}: {whole_name} has {whole.numel()} elements, expected world size {n} x "
            f"{part_name}'s {part.numel()}"
        )


def contig(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t`` itself if contiguous, else a contiguous copy (and True: copy results back)."""
    t = t.detach()
    if t.is_contiguous():
        return t, False
    return t.contiguous(), True


def copy_back(dest: torch.Tensor, work: torch.Tensor, copied: bool) -> Post | None:
    """The post step that copies the results in ``work`` (``dest``'s contiguous copy, from
    :func:`contig` or :func:`reduce_out`) into ``dest``; None where nothing was copied."""
    if not copied:
        return None
    return lambda: dest.detach().copy_(work.reshape(dest.shape))


def reduce_out(out: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The contiguous tensor a reduction writes for ``out``: :func:`contig`, but a float32
    one for bfloat16 (ringcomm reduces bfloat16 in float32); and whether it is a copy."""
    o, copied = contig(out)
    if out.dtype == torch.bfloat16:
        return torch.empty(o.shape, dtype=torch.float32, device=o.device), True
    return o, copied


def move_view(t: torch.Tensor) -> Any:
    """The array on contiguous ``t`` for data movement (NumPy, or the call's device array):
    any dtype, as bytes if needed."""
    if t.dtype == torch.bool and current_call().device is not None:
        return array_of(t.view(torch.uint8))  # (DLPack's bool is not everywhere)
    if t.dtype in _NUMPY_DTYPES:
        return array_of(t)
    if t.dtype.is_complex:
        return array_of(torch.view_as_real(t))
    if t.dtype == torch.bfloat16 or t.element_size() == 2:
        return array_of(t.view(torch.int16))
    return array_of(t.reshape(-1).view(torch.uint8))


class Reduction:
    """How one tensor takes part in a reduction: the array to reduce, the ringcomm op,
    and what to do before (pre-scaling) and after (copy back, cast back)."""

    __slots__ = ("array", "flat", "op", "post", "scale", "tensor", "work_tensor")

    def __init__(self, t: torch.Tensor, op: Any, what: str, *, in_place: bool) -> None:
        t = check_tensor(t, what)
        rop, scale = parse_op(op, t.dtype, what)
        work, copied = contig(t)
        if t.dtype == torch.bfloat16:
            work, copied = work.float(), True
        elif t.dtype.is_complex:
            if rop not in ("sum", "avg"):
                raise ValueError(f"{what}: {rop.upper()} is not defined on complex tensors")
        elif t.dtype not in _NUMPY_DTYPES:
            raise TypeError(f"{what}: dtype {t.dtype} cannot be reduced by ringcomm")
        if scale is not None:
            if not in_place and not copied:
                work, copied = work.clone(), True
            work.mul_(scale)
        self.tensor = t
        self.work_tensor = work
        #: What ``array`` views: the real pairs of a complex tensor; bool as uint8 (0/1:
        #: MIN and MAX are still AND and OR) off the CPU.
        self.flat = torch.view_as_real(work) if work.dtype.is_complex else work
        if work.dtype == torch.bool and current_call().device is not None:
            self.flat = work.view(torch.uint8)
        self.array = array_of(self.flat)
        self.op = rop
        self.scale = scale
        self.post = copied and in_place

    def copy_back(self) -> None:
        """Results computed on a copy go back into the caller's tensor."""
        if self.post:
            self.tensor.copy_(self.work_tensor)


def parse_op(op: Any, dtype: torch.dtype, what: str) -> tuple[str, float | None]:
    """(ringcomm op name, pre-scale factor or None) for a torch ReduceOp."""
    kind = op.op if hasattr(op, "op") else op
    if kind == ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError(f"{what}: PREMUL_SUM without a factor")
        if isinstance(factor, torch.Tensor):
            factor = float(factor.item())
        return "sum", float(factor)
    if kind in _RC_OPS:
        return _RC_OPS[kind], None
    if kind in _BOOL_BITWISE and dtype == torch.bool:
        return _BOOL_BITWISE[kind], None
    raise ValueError(
        f"{what}: reduce op {kind} is not supported by the ringcomm backend for dtype {dtype} "
        "(supported: SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM; BAND/BOR on bool)"
    )


def is_async(opts: Any) -> bool:
    """Whether torch will come back for the result later (``asyncOp``, default True).

    ``dist.all_reduce(t)`` and friends set it False and wait on the Work at once: those
    calls run blocking on the caller's thread (ringcomm's fast lane for small messages, no
    thread hand-off); everything else (DDP's hooks, ``async_op=True``) is started and left
    to ringcomm's progress engine.
    """
    return bool(getattr(opts, "asyncOp", True))


def timeout_of(opts: Any, default_s: float) -> float:
    """The call's timeout from torch options (unset: the group's)."""
    t = getattr(opts, "timeout", None)
    if isinstance(t, datetime.timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return default_s


def run_all(posts: list[Post]) -> Post | None:
    """One step running ``posts`` in order (None: nothing to run)."""
    if not posts:
        return None

    def run() -> None:
        for p in posts:
            p()

    return run


def by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, groups in order of first appearance (the
    same on every rank that passes the same dtypes in the same order)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def reduce_view(t: torch.Tensor) -> Any:
    """The array a reduction writes into contiguous ``t``: real pairs of a complex tensor."""
    return array_of(torch.view_as_real(t) if t.dtype.is_complex else t)


def rows_view(t: torch.Tensor) -> Any:
    """:func:`move_view` of contiguous ``t`` as rows: ``(t.shape[0], elements per row)``
    (also with no rows, so every rank agrees on the row shape)."""
    if t.dtype in _NUMPY_DTYPES or t.dtype == torch.bfloat16 or t.element_size() == 2:
        factor = 1
    elif t.dtype.is_complex:
        factor = 2
    else:
        factor = t.element_size()
    per_row = factor * int(np.prod(t.shape[1:], dtype=np.int64))
    return move_view(t).reshape(t.shape[0], per_row)


def from_move_view(row: Any, like: torch.Tensor) -> torch.Tensor:
    """Undo :func:`move_view` for one gathered row (a ringcomm array) shaped like ``like``."""
    t = tensor_of(row, like)
    if like.dtype in _NUMPY_DTYPES:
        return t.reshape(like.shape)
    if like.dtype.is_complex:
        return torch.view_as_complex(t).reshape(like.shape)
    return t.reshape(-1).view(like.dtype).reshape(like.shape)


def splits(sizes: list[int], total: int, n: int, what: str, name: str) -> list[tuple[int, int]]:
    """[start, end) rows per rank from torch's split sizes (empty: equal splits)."""
    if not sizes:
        if total % n:
            raise ValueError(f"{what}: {name} dim 0 ({total}) is not divisible by {n}")
        sizes = [total // n] * n
    if len(sizes) != n or sum(sizes) != total or min(sizes) < 0:
        raise ValueError(
            f"{what}: {name} split sizes {sizes} do not split {total} rows among {n} ranks"
        )
    spans, at = [], 0
    for s in sizes:
        spans.append((at, at + s))
        at += s
    return spans
