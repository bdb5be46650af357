"""The torch backend's data movement: broadcast, the all-gathers, gather, scatter, the
all-to-alls and barrier, as functions of a :class:`~ringcomm.torch_backend.core.BackendCore`.

Any dtype moves, as raw bytes where ringcomm has no such dtype
(:func:`~ringcomm.torch_backend.tensors.move_view`). Outputs of different sizes (uneven
all-gathers and all-to-alls) run on ringcomm's ``all_gather_v`` / ``all_to_all_v``: one
collective each, so ranks whose sizes disagree get ``CollectiveMismatchError``, not a hang.
Calls of several tensors run one ringcomm all_gather per dtype, of their concatenation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ScatterOptions,
)

from ringcomm.core.work import Work as RcWork
from ringcomm.torch_backend.core import BackendCore
from ringcomm.torch_backend.device import array_of
from ringcomm.torch_backend.tensors import (
    Post,
    by_dtype,
    check_same_dtype,
    check_tensor,
    check_world_multiple,
    contig,
    copy_back,
    from_move_view,
    move_view,
    rows_view,
    run_all,
    splits,
)
from ringcomm.torch_backend.work import RingcommWork

__all__ = [
    "allgather",
    "allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "barrier",
    "broadcast",
    "gather",
    "scatter",
]


def broadcast(g: BackendCore, tensors: list[torch.Tensor], opts: Any = None) -> RingcommWork:
    what, opts = g.start_with("broadcast", opts, BroadcastOptions)
    t = g.one(tensors, what)
    src = opts.rootRank
    c, copied = contig(t)
    w = g.call_with(opts, g.rc.broadcast, move_view(c), src=src)
    post = copy_back(t, c, copied and g.rc.rank != src)
    return g.issue([w], [t], post, "broadcast", opts)


def _all_gather_into(
    g: BackendCore, out: torch.Tensor, inp: torch.Tensor, what: str, opts: Any
) -> tuple[RcWork, Post | None]:
    n = g.rc.world_size
    check_world_multiple(what, n, out, "output", inp, "input")
    check_same_dtype(what, inp, out)
    i, _ = contig(inp)
    o, copied = contig(out)
    x = move_view(i).reshape(-1)
    o_arr = move_view(o).reshape(n, -1)
    w = g.call_with(opts, g.rc.all_gather, x, out=o_arr)
    return w, copy_back(out, o, copied)


def allgather_base(
    g: BackendCore, output: torch.Tensor, input: torch.Tensor, opts: Any = None
) -> RingcommWork:
    what, opts = g.start_with("all_gather_into_tensor", opts, AllgatherOptions)
    out, inp = check_tensor(output, what), check_tensor(input, what)
    w, post = _all_gather_into(g, out, inp, what, opts)
    return g.issue([w], [out], post, "all_gather_into_tensor", opts)


def allgather_into_tensor_coalesced(
    g: BackendCore, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
) -> RingcommWork:
    """All-gathers into tensors (the coalescing manager's ``all_gather_into_tensor``):
    one ringcomm all_gather per dtype, of the inputs' concatenation."""
    what, opts = g.start_with("allgather_into_tensor_coalesced", opts, AllgatherOptions)
    n = g.rc.world_size
    outs = [check_tensor(o, what) for o in outputs]
    ins = [check_tensor(i, what) for i in inputs]
    if len(outs) != len(ins):
        raise ValueError(f"{what}: {len(outs)} outputs for {len(ins)} inputs")
    for o, i in zip(outs, ins, strict=True):
        if o.numel() != i.numel() * n or o.dtype != i.dtype:
            raise ValueError(
                f"{what}: output ({o.dtype}, {o.numel()} elements) is not world size "
                f"{n} x input ({i.dtype}, {i.numel()} elements)"
            )
    if len(ins) == 1 or not all(o.is_contiguous() for o in outs):
        works, posts = [], []
        for o, i in zip(outs, ins, strict=True):
            w, p = _all_gather_into(g, o, i, what, opts)
            works.append(w)
            if p is not None:
                posts.append(p)
        return g.issue(works, outs, run_all(posts), "allgather_coalesced", opts)
    # rank r's copy of input i goes to the r-th 1/n of (contiguous) output i
    dests = [list(o.detach().view(n, -1)) for o in outs]
    works, post = _gather_batched(g, ins, dests, what, opts)
    return g.issue(works, outs, post, "allgather_coalesced", opts)


def allgather(
    g: BackendCore, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
) -> RingcommWork:
    what, opts = g.start_with("allgather", opts, AllgatherOptions)
    inp = g.one(inputs, what)
    if len(outputs) != 1 or len(outputs[0]) != g.rc.world_size:
        raise ValueError(f"{what}: expected one list of world-size output tensors")
    outs = [check_tensor(o, what) for o in outputs[0]]
    for o in outs:
        if o.dtype != inp.dtype:
            raise ValueError(f"{what}: every output must have the input's dtype")
    if any(o.numel() != inp.numel() for o in outs):
        return _allgather_uneven(g, outs, inp, what, opts)
    gathered = torch.empty((g.rc.world_size, *inp.shape), dtype=inp.dtype, device=inp.device)
    w, _ = _all_gather_into(g, gathered, inp, what, opts)

    def post() -> None:
        for o, row in zip(outs, gathered, strict=True):
            o.detach().copy_(row.reshape(o.shape))

    return g.issue([w], outs, post, "allgather", opts)


def _allgather_uneven(
    g: BackendCore, outs: list[torch.Tensor], inp: torch.Tensor, what: str, opts: Any
) -> RingcommWork:
    """``dist.all_gather`` into outputs of different sizes (NCCL's uneven all_gather;
    Gloo refuses it): ringcomm's all_gather_v on the bytes, each rank's count taken
    from its output tensor (ranks that disagree raise CollectiveMismatchError)."""
    me = g.rc.rank
    if outs[me].numel() != inp.numel():
        raise ValueError(
            f"{what}: output {me} (this rank's) has {outs[me].numel()} elements, the "
            f"input {inp.numel()}"
        )
    i, _ = contig(inp)
    x = move_view(i).reshape(-1).view(np.uint8)
    size = inp.element_size()
    sizes = [o.numel() * size for o in outs]
    gathered = torch.empty(sum(sizes), dtype=torch.uint8, device=inp.device)
    w = g.call_with(opts, g.rc.all_gather_v, x, sizes, out=array_of(gathered))

    def post() -> None:
        for o, part in zip(outs, torch.split(gathered, sizes), strict=True):
            o.detach().copy_(part.view(inp.dtype).reshape(o.shape))

    return g.issue([w], outs, post, "allgather", opts)


def allgather_coalesced(
    g: BackendCore, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
) -> RingcommWork:
    """``dist.all_gather_coalesced``: ``outputs[r][i]`` receives rank r's ``inputs[i]``
    (torch's layout: one list per *rank*, each as long as ``inputs``). All inputs of one
    dtype go as one ringcomm all_gather of their concatenation."""
    what, opts = g.start_with("allgather_coalesced", opts, AllgatherOptions)
    n = g.rc.world_size
    if len(outputs) != n or any(len(outs) != len(inputs) for outs in outputs):
        raise ValueError(
            f"{what}: expected {n} output lists (one per rank) of {len(inputs)} tensors "
            f"(one per input), got {[len(outs) for outs in outputs]}"
        )
    ins = [check_tensor(t, what) for t in inputs]
    for r, outs in enumerate(outputs):
        for i, (o, inp) in enumerate(zip(outs, ins, strict=True)):
            check_tensor(o, what)
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise ValueError(
                    f"{what}: output [{r}][{i}] ({o.dtype}, {o.numel()} elements) does "
                    f"not match input {i} ({inp.dtype}, {inp.numel()} elements)"
                )
    # per input i: the n tensors that receive it, in rank order
    dests = [[outputs[r][i] for r in range(n)] for i in range(len(ins))]
    works, post = _gather_batched(g, ins, dests, what, opts)
    flat = [o for outs in outputs for o in outs]
    return g.issue(works, flat, post, "allgather_coalesced", opts)


def _gather_batched(
    g: BackendCore,
    inputs: list[torch.Tensor],
    dests: list[list[torch.Tensor]],
    what: str,
    opts: Any,
) -> tuple[list[RcWork], Post | None]:
    """All-gather ``inputs`` (one ringcomm all_gather per dtype, of the inputs'
    concatenation); the post step writes rank r's copy of input i into
    ``dests[i][r]`` (any shape with input i's element count)."""
    n = g.rc.world_size
    works: list[RcWork] = []
    steps: list[Post] = []
    for idx in by_dtype(inputs):
        parts = [inputs[i].detach().reshape(-1) for i in idx]
        flat = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
        gathered = torch.empty((n, flat.numel()), dtype=flat.dtype, device=flat.device)
        w, _ = _all_gather_into(g, gathered, flat, what, opts)
        works.append(w)

        def unpack(idx: list[int] = idx, gathered: torch.Tensor = gathered) -> None:
            at = 0
            for i in idx:
                k = inputs[i].numel()
                for r in range(n):
                    d = dests[i][r]
                    d.detach().copy_(gathered[r, at : at + k].reshape(d.shape))
                at += k

        steps.append(unpack)
    return works, run_all(steps)


def gather(
    g: BackendCore, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
) -> RingcommWork:
    what, opts = g.start_with("gather", opts, GatherOptions)
    inp = g.one(inputs, what)
    dst = opts.rootRank
    i, _ = contig(inp)
    w = g.call_with(opts, g.rc.gather, move_view(i), dst=dst)
    outs: list[torch.Tensor] = []
    post = None
    if g.rc.rank == dst:
        if len(outputs) != 1 or len(outputs[0]) != g.rc.world_size:
            raise ValueError(f"{what}: the root needs one list of world-size outputs")
        outs = [check_tensor(o, what) for o in outputs[0]]

        def post() -> None:
            got = w.wait(0.001) if isinstance(w, RcWork) else w
            for o, row in zip(outs, got, strict=True):
                o.detach().copy_(from_move_view(row, inp))

    return g.issue([w], outs, post, "gather", opts)


def scatter(
    g: BackendCore, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
) -> RingcommWork:
    what, opts = g.start_with("scatter", opts, ScatterOptions)
    out = g.one(outputs, what)
    src = opts.rootRank
    x = None
    if g.rc.rank == src:
        if len(inputs) != 1 or len(inputs[0]) != g.rc.world_size:
            raise ValueError(f"{what}: the root needs one list of world-size inputs")
        x = move_view(torch.stack([check_tensor(p, what).detach() for p in inputs[0]]))
    o, copied = contig(out)
    w = g.call_with(opts, g.rc.scatter, x, src=src, out=move_view(o))
    post = copy_back(out, o, copied)
    return g.issue([w], [out], post, "scatter", opts)


def alltoall_base(
    g: BackendCore,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    opts: Any = None,
) -> RingcommWork:
    what, opts = g.start_with("all_to_all_single", opts, AllToAllOptions)
    out, inp = check_tensor(output, what), check_tensor(input, what)
    n = g.rc.world_size
    check_same_dtype(what, inp, out)
    if not output_split_sizes and not input_split_sizes:
        if inp.shape[0] % n or out.shape != inp.shape:
            raise ValueError(
                f"{what}: equal splits need dim 0 divisible by {n} and matching shapes"
            )
        i, _ = contig(inp)
        o, copied = contig(out)
        w = g.call_with(
            opts, g.rc.all_to_all, move_view(i).reshape(n, -1), out=move_view(o).reshape(n, -1)
        )
        post = copy_back(out, o, copied)
        return g.issue([w], [out], post, "all_to_all_single", opts)
    # Uneven splits: ringcomm's all_to_all_v on rows of dim 0.
    in_rows = splits(input_split_sizes, inp.shape[0], n, what, "input")
    out_rows = splits(output_split_sizes, out.shape[0], n, what, "output")
    if inp.shape[1:] != out.shape[1:]:
        raise ValueError(
            f"{what}: input rows {tuple(inp.shape[1:])} and output rows "
            f"{tuple(out.shape[1:])} differ"
        )
    i, _ = contig(inp)
    o, copied = contig(out)
    w = g.call_with(
        opts,
        g.rc.all_to_all_v,
        rows_view(i),
        [b - a for a, b in in_rows],
        [b - a for a, b in out_rows],
        out=rows_view(o),
    )
    post = copy_back(out, o, copied)
    return g.issue([w], [out], post, "all_to_all_single", opts)


def alltoall(
    g: BackendCore, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
) -> RingcommWork:
    what, opts = g.start_with("all_to_all", opts, AllToAllOptions)
    n = g.rc.world_size
    if len(outputs) != n or len(inputs) != n:
        raise ValueError(f"{what}: expected {n} input and {n} output tensors")
    ins = [check_tensor(t, what).detach() for t in inputs]
    outs = [check_tensor(t, what) for t in outputs]
    same = all(t.shape == ins[0].shape and t.dtype == ins[0].dtype for t in ins + outs)
    if same:
        x = torch.stack(ins)
        y = torch.empty_like(x)
        w = g.call_with(
            opts, g.rc.all_to_all, move_view(x).reshape(n, -1), out=move_view(y).reshape(n, -1)
        )

        def post() -> None:
            for o, row in zip(outs, y, strict=True):
                o.detach().copy_(row)

        return g.issue([w], outs, post, "all_to_all", opts)
    flat_in = torch.cat([t.reshape(-1) for t in ins])
    flat_out = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype, device=outs[0].device)
    inner = alltoall_base(
        g, flat_out, flat_in, [t.numel() for t in outs], [t.numel() for t in ins], opts
    )

    def post_uneven() -> None:
        for o, part in zip(outs, torch.split(flat_out, [t.numel() for t in outs]), strict=True):
            o.detach().copy_(part.reshape(o.shape))

    return g.issue([inner], outs, post_uneven, "all_to_all", opts)


def barrier(g: BackendCore, opts: Any = None) -> RingcommWork:
    _, opts = g.start_with("barrier", opts, BarrierOptions)
    w = g.call_with(opts, g.rc.barrier)
    return g.issue([w], [], None, "barrier", opts)
