"""The torch backend's reductions: all-reduce (dense, sparse, coalesced), reduce and the
reduce-scatters, as functions of a :class:`~ringcomm.torch_backend.core.BackendCore`.

Each takes torch's arguments and options and returns the call's :class:`RingcommWork`.
Tensors are reduced in place where they can be (:class:`~ringcomm.torch_backend.tensors.Reduction`
says when a copy is needed, and the post step copies back); calls of several tensors run
one ringcomm operation per dtype; uneven reduce-scatters run on ``reduce_scatter_v``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch._C._distributed_c10d import (
    AllreduceCoalescedOptions,
    AllreduceOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
)

from ringcomm.core.work import Work as RcWork
from ringcomm.torch_backend.core import BackendCore
from ringcomm.torch_backend.device import array_of
from ringcomm.torch_backend.tensors import (
    Post,
    Reduction,
    check_same_dtype,
    check_tensor,
    check_world_multiple,
    copy_back,
    move_view,
    reduce_out,
    reduce_view,
    run_all,
)
from ringcomm.torch_backend.work import RingcommWork

__all__ = [
    "allreduce",
    "allreduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced",
]


def allreduce(g: BackendCore, tensors: list[torch.Tensor], opts: Any = None) -> RingcommWork:
    what, opts = g.start_with("allreduce", opts, AllreduceOptions)
    if isinstance(opts, (ReduceOp, ReduceOp.RedOpType)):  # allreduce(tensors, op)
        op, opts = opts, AllreduceOptions()
    else:
        op = opts.reduceOp
    ts = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    if len(ts) == 1 and isinstance(ts[0], torch.Tensor) and ts[0].is_sparse:
        return _sparse_allreduce(g, ts[0], op, what, opts)
    t = g.one(ts, what)
    red = Reduction(t, op, what, in_place=True)
    w = g.call_with(opts, g.rc.all_reduce, red.array, op=red.op)
    return g.issue([w], [t], red.copy_back if red.post else None, "allreduce", opts)


def _sparse_allreduce(
    g: BackendCore, t: torch.Tensor, op: Any, what: str, opts: Any
) -> RingcommWork:
    """SUM of sparse COO tensors, Gloo's way: every rank's (coalesced) indices and
    values are gathered (counts first, then both padded to the largest count: ringcomm's
    all_gather takes one shape), concatenated in rank order and coalesced (duplicate
    indices summed); ``t`` becomes the coalesced sum. Runs blocking on the caller's
    thread even for ``async_op=True`` (the three gathers depend on each other); the
    returned Work is complete."""
    if t.device.type != "cpu":
        raise ValueError(f"{what}: the ringcomm backend takes CPU tensors, got {t.device}")
    if t.layout != torch.sparse_coo:
        raise ValueError(f"{what}: sparse layout {t.layout} is not supported (COO only)")
    if (op.op if hasattr(op, "op") else op) != ReduceOp.SUM:
        raise ValueError(f"{what}: sparse tensors are reduced with SUM only (as by Gloo)")
    timeout_s = g.timeout_of(opts)
    n = g.rc.world_size
    x = t.detach().coalesce()
    idx, vals = x.indices(), x.values().contiguous()
    nnz = int(idx.shape[1])
    meta = np.array([nnz, x.sparse_dim(), x.dense_dim(), *x.shape], dtype=np.int64)
    metas = g.call(g.rc.all_gather, meta, timeout_s=timeout_s)
    for r in range(n):
        if not np.array_equal(metas[r, 1:], meta[1:]):
            raise ValueError(
                f"{what}: rank {r}'s sparse tensor (sparse/dense dims and shape "
                f"{metas[r, 1:].tolist()}) does not match this rank's {meta[1:].tolist()}"
            )
    counts = [int(c) for c in metas[:, 0]]
    top = max(counts)
    got_idx = torch.zeros((n, x.sparse_dim(), top), dtype=torch.int64)
    got_vals = torch.zeros((n, top, *vals.shape[1:]), dtype=vals.dtype)
    if top > 0:
        pad_idx = torch.zeros((x.sparse_dim(), top), dtype=torch.int64)
        pad_idx[:, :nnz] = idx
        pad_vals = torch.zeros((top, *vals.shape[1:]), dtype=vals.dtype)
        pad_vals[:nnz] = vals
        g.call(g.rc.all_gather, pad_idx.numpy(), out=got_idx.numpy(), timeout_s=timeout_s)
        g.call(
            g.rc.all_gather,
            move_view(pad_vals).reshape(-1),
            out=move_view(got_vals).reshape(n, -1),
            timeout_s=timeout_s,
        )
    all_idx = torch.cat([got_idx[r, :, : counts[r]] for r in range(n)], dim=1)
    all_vals = torch.cat([got_vals[r, : counts[r]] for r in range(n)])
    total = torch.sparse_coo_tensor(all_idx, all_vals, x.shape).coalesce()
    with torch.no_grad():
        t.copy_(total)
    return g.issue([], [t], None, "allreduce (sparse)", opts)


def allreduce_coalesced(
    g: BackendCore, tensors: list[torch.Tensor], opts: Any = None
) -> RingcommWork:
    """``dist.all_reduce_coalesced`` and the coalescing manager's all-reduces (any mix
    of dtypes): one ringcomm all_reduce per dtype, of the tensors' concatenation (a
    lone tensor of its dtype is reduced in place, without the copy)."""
    what, opts = g.start_with("allreduce_coalesced", opts, AllreduceCoalescedOptions)
    reds = [Reduction(check_tensor(t, what), opts.reduceOp, what, in_place=True) for t in tensors]
    groups: dict[tuple[torch.dtype, str], list[Reduction]] = {}
    for r in reds:  # in order of first appearance: the same on every rank
        groups.setdefault((r.flat.dtype, r.op), []).append(r)
    works, unpack = [], []
    for (_, op), members in groups.items():
        if len(members) == 1:
            flat = members[0].array
        else:
            cat = torch.cat([m.flat.reshape(-1) for m in members])
            unpack.append((cat, members))
            flat = array_of(cat)
        works.append(g.call_with(opts, g.rc.all_reduce, flat, op=op))

    def post() -> None:
        for cat, members in unpack:
            at = 0
            for m in members:
                k = m.flat.numel()
                m.flat.copy_(cat[at : at + k].reshape(m.flat.shape))
                at += k
        for r in reds:
            r.copy_back()

    return g.issue(works, list(tensors), post, "allreduce_coalesced", opts)


def reduce(g: BackendCore, tensors: list[torch.Tensor], opts: Any = None) -> RingcommWork:
    what, opts = g.start_with("reduce", opts, ReduceOptions)
    t = g.one(tensors, what)
    dst = opts.rootRank
    # Only the root's tensor is written (a pre-scaled input elsewhere is a copy).
    red = Reduction(t, opts.reduceOp, what, in_place=g.rc.rank == dst)
    w = g.call_with(opts, g.rc.reduce, red.array, dst=dst, op=red.op)
    post = red.copy_back if red.post else None
    return g.issue([w], [t], post, "reduce", opts)


def _reduce_scatter_into(
    g: BackendCore, out: torch.Tensor, inp: torch.Tensor, op: Any, what: str, opts: Any
) -> tuple[RcWork, Post | None]:
    n = g.rc.world_size
    check_world_multiple(what, n, inp, "input", out, "output")
    check_same_dtype(what, inp, out)
    red = Reduction(inp, op, what, in_place=False)
    rows = red.array.reshape(n, -1)
    o, o_copied = reduce_out(out)
    o_arr = reduce_view(o)
    w = g.call_with(opts, g.rc.reduce_scatter, rows, out=o_arr.reshape(rows.shape[1:]), op=red.op)
    return w, copy_back(out, o, o_copied)


def reduce_scatter_single(
    g: BackendCore, output: torch.Tensor, input: torch.Tensor, opts: Any = None
) -> RingcommWork:
    what, opts = g.start_with("reduce_scatter_tensor", opts, ReduceScatterOptions)
    out, inp = check_tensor(output, what), check_tensor(input, what)
    w, post = _reduce_scatter_into(g, out, inp, opts.reduceOp, what, opts)
    return g.issue([w], [out], post, "reduce_scatter_tensor", opts)


def reduce_scatter_tensor_coalesced(
    g: BackendCore, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
) -> RingcommWork:
    what, opts = g.start_with("reduce_scatter_tensor_coalesced", opts, ReduceScatterOptions)
    works, posts = [], []
    for out, inp in zip(outputs, inputs, strict=True):
        w, p = _reduce_scatter_into(
            g, check_tensor(out, what), check_tensor(inp, what), opts.reduceOp, what, opts
        )
        works.append(w)
        if p is not None:
            posts.append(p)
    return g.issue(works, list(outputs), run_all(posts), "reduce_scatter_coalesced", opts)


def reduce_scatter(
    g: BackendCore, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
) -> RingcommWork:
    what, opts = g.start_with("reduce_scatter", opts, ReduceScatterOptions)
    out = g.one(outputs, what)
    if len(inputs) != 1 or len(inputs[0]) != g.rc.world_size:
        raise ValueError(f"{what}: expected one list of world-size tensors as input")
    parts = [check_tensor(p, what) for p in inputs[0]]
    for p in parts:
        if p.dtype != out.dtype:
            raise ValueError(f"{what}: every input must have the output's dtype")
    if any(p.shape != out.shape for p in parts):
        return _reduce_scatter_uneven(g, out, parts, opts.reduceOp, what, opts)
    stacked = torch.stack([p.detach() for p in parts])  # one copy: a contiguous (n, ...)
    w, post = _reduce_scatter_into(g, out, stacked, opts.reduceOp, what, opts)
    return g.issue([w], [out], post, "reduce_scatter", opts)


def _reduce_scatter_uneven(
    g: BackendCore, out: torch.Tensor, parts: list[torch.Tensor], op: Any, what: str, opts: Any
) -> RingcommWork:
    """``dist.reduce_scatter`` with inputs of different sizes (input ``j`` is rank
    ``j``'s share, as large as rank ``j``'s output): ringcomm's reduce_scatter_v."""
    me = g.rc.rank
    if parts[me].numel() != out.numel():
        raise ValueError(
            f"{what}: input {me} (this rank's share) has {parts[me].numel()} elements, "
            f"the output {out.numel()}"
        )
    splits = [p.numel() for p in parts]
    flat = torch.cat([p.detach().reshape(-1) for p in parts])
    red = Reduction(flat, op, what, in_place=False)
    rows = red.array.reshape(flat.numel(), -1)  # complex: a row is (real, imag)
    o, o_copied = reduce_out(out)
    o_arr = reduce_view(o)
    w = g.call_with(
        opts,
        g.rc.reduce_scatter_v,
        rows,
        splits,
        out=o_arr.reshape(out.numel(), rows.shape[1]),
        op=red.op,
    )
    post = copy_back(out, o, o_copied)
    return g.issue([w], [out], post, "reduce_scatter", opts)
