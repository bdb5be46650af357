"""The reducing collectives on the shared workspace (``shm``): all_reduce, reduce_scatter,
reduce.

One rank computes each element, reducing the ranks' buffers in rank order, so every rank
ends with the same bits. all_reduce up to :data:`SMALL_ALL_REDUCE_BYTES`: every rank
reduces every buffer (one sync); above, rank j reduces slice j of every buffer into its own
(a second sync, then every rank copies the W slices out). A rank whose ``x`` lives in a
symmetric window (:meth:`~ringcomm.collectives.workspace.WorkspaceCollectives.alloc`) is
read in place, not copied in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.collectives.base import Call
from ringcomm.collectives.shm_base import Job, ShmEngine, flat_rounds, row_rounds
from ringcomm.collectives.shm_fingerprint import SYM, SYM_OFFSET
from ringcomm.ops import ReduceOp, finalize, reduce_in_order, reduce_ufunc

__all__ = ["SMALL_ALL_REDUCE_BYTES", "all_reduce", "reduce", "reduce_scatter"]

#: all_reduce up to this many bytes: every rank reduces the whole buffer (one sync);
#: above, each rank reduces 1/W of it (two syncs, 1/W of the reads).
SMALL_ALL_REDUCE_BYTES = 64 * 1024


def all_reduce(engine: ShmEngine, job: Job, call: Call) -> Any:
    x = call.x
    assert x is not None and call.op is not None
    n = engine.ws.world_size
    engine.publish(job, call)
    # Small calls copy in even from a window (one sync beats reading in place); every
    # rank decides alike, by the size, which every rank's fingerprint shares.
    small = x.nbytes <= SMALL_ALL_REDUCE_BYTES
    sym, offset = (0, 0) if small else engine.symmetric(x)
    if sym:
        fp = engine.own_fingerprint()
        fp[SYM], fp[SYM_OFFSET] = sym, offset
    if n > 1 and not small and engine.windows:  # a peer's x may be in a window
        return all_reduce_sources(engine, job, call, x)
    if n > 1 and small and x.nbytes <= engine.round_cap(x.itemsize):
        return all_reduce_small(engine, job, call, x)
    return all_reduce_rounds(engine, job, call, x)


def all_reduce_rounds(engine: ShmEngine, job: Job, call: Call, x: np.ndarray) -> Any:
    """all_reduce round by round, every rank's ``x`` copied in (the call is published)."""
    assert call.op is not None
    n, me = engine.ws.world_size, engine.ws.rank
    dtype = x.dtype
    flat = x.reshape(-1)
    ufunc = reduce_ufunc(call.op, dtype)
    silence = dtype.kind == "f"
    avg = call.op is ReduceOp.AVG
    per, rounds = engine.rounds(x.nbytes, dtype.itemsize)
    small = x.nbytes <= SMALL_ALL_REDUCE_BYTES
    for i in range(rounds):
        lo = i * per
        hi = min(lo + per, flat.size)
        c = hi - lo
        views = engine.all_views(engine.next_buffer(), dtype, c)
        np.copyto(views[me], flat[lo:hi])
        engine.sync(job, f"sync 1 of round {i + 1}/{rounds}")
        if i == 0:
            engine.check(job)
        if small:
            if n == 1:
                continue
            reduce_in_order(ufunc, views, flat[lo:hi], silence=silence)
            if avg:
                finalize(call.op, flat[lo:hi], n)
            continue
        bounds = [c * j // n for j in range(n + 1)]
        s, e = bounds[me], bounds[me + 1]
        if e > s and n > 1:
            srcs = [views[me][s:e]] + [views[r][s:e] for r in range(n) if r != me]
            reduce_in_order(ufunc, srcs, views[me][s:e], silence=silence)
        if avg and e > s:
            finalize(call.op, views[me][s:e], n)
        engine.sync(job, f"sync 2 of round {i + 1}/{rounds}")
        for r in range(n):
            s, e = bounds[r], bounds[r + 1]
            if e > s:
                np.copyto(flat[lo + s : lo + e], views[r][s:e])
    return x


def all_reduce_small(engine: ShmEngine, job: Job, call: Call, x: np.ndarray) -> Any:
    """One round: copy in, sync, every rank reduces every buffer in rank order."""
    assert call.op is not None
    b = engine.next_buffer()
    views = engine.all_views(b, x.dtype, x.size)
    flat = x.reshape(-1)
    np.copyto(views[engine.ws.rank], flat)
    engine.sync(job, "sync 1 of round 1/1")
    engine.check(job)
    ufunc = reduce_ufunc(call.op, x.dtype)
    reduce_in_order(ufunc, views, flat, silence=x.dtype.kind == "f")
    if call.op is ReduceOp.AVG:
        finalize(call.op, flat, engine.ws.world_size)
    return x


def _places(engine: ShmEngine, x: np.ndarray) -> list[np.ndarray | None]:
    """Per rank, its ``x`` in its window part (None: copied in), from the fingerprints."""
    fps = engine.fingerprints()
    places: list[np.ndarray | None] = []
    for r in range(engine.ws.world_size):
        w, off = int(fps[r, SYM]), int(fps[r, SYM_OFFSET])
        if w:
            part = engine.windows[w - 1].parts[r]
            places.append(part[off : off + x.nbytes].view(x.dtype))
        else:
            places.append(None)
    return places


def all_reduce_sources(engine: ShmEngine, job: Job, call: Call, x: np.ndarray) -> Any:
    """all_reduce where some ranks' ``x`` lives in a window: those are read in place, not
    copied in; if all are, the whole buffer is one round and no byte is copied in or out of
    the workspace but the reduced slices. Each rank reduces its slice into its own buffer
    (its window part, or its workspace buffer); every rank copies the others' reduced
    slices; a last sync keeps every window part unchanged until no rank reads it any more."""
    assert call.op is not None
    n, me = engine.ws.world_size, engine.ws.rank
    dtype = x.dtype
    flat = x.reshape(-1)
    size = flat.size
    ufunc = reduce_ufunc(call.op, dtype)
    silence = dtype.kind == "f"
    per, rounds = engine.rounds(x.nbytes, dtype.itemsize)
    mine_sym = engine.own_fingerprint()[SYM] != 0
    places: list[np.ndarray | None] = [None] * n  # rank r's x in its window part
    any_sym = False
    i = 0
    while i < rounds:
        lo = i * per
        hi = min(lo + per, size)
        b = engine.next_buffer()
        if not mine_sym:
            np.copyto(engine.view(me, b, dtype, hi - lo), flat[lo:hi])
        engine.sync(job, f"sync 1 of round {i + 1}/{rounds}")
        if i == 0:
            engine.check(job)
            places = _places(engine, x)
            any_sym = any(p is not None for p in places)
            engine.in_place_calls += places[me] is not None
            if all(p is not None for p in places):
                per, rounds, hi = max(size, 1), 1, size  # nothing was copied in
        c = hi - lo
        srcs_all = [
            p[lo:hi] if p is not None else engine.view(r, b, dtype, c) for r, p in enumerate(places)
        ]
        bounds = [c * j // n for j in range(n + 1)]
        s, e = bounds[me], bounds[me + 1]
        if e > s:
            srcs = [srcs_all[me][s:e]] + [srcs_all[r][s:e] for r in range(n) if r != me]
            reduce_in_order(ufunc, srcs, srcs_all[me][s:e], silence=silence)
            if call.op is ReduceOp.AVG:
                finalize(call.op, srcs_all[me][s:e], n)
        engine.sync(job, f"sync 2 of round {i + 1}/{rounds}")
        for r in range(n):
            s, e = bounds[r], bounds[r + 1]
            if e > s and not (r == me and places[me] is not None):
                np.copyto(flat[lo + s : lo + e], srcs_all[r][s:e])
        i += 1
    if any_sym:
        engine.next_buffer()
        engine.sync(job, "the last sync (window parts read)")
    return x


def reduce_scatter(engine: ShmEngine, job: Job, call: Call) -> Any:
    """Copy in (W rows), sync, rank j reduces row j of every buffer."""
    x, out = call.x, call.out
    assert x is not None and out is not None and call.op is not None
    n, me = engine.ws.world_size, engine.ws.rank
    res = out.reshape(-1)
    ufunc = reduce_ufunc(call.op, x.dtype)
    for lo, hi, blocks in row_rounds(engine, job, call, x.reshape(n, -1)):
        if hi == lo:
            continue
        if n == 1:
            np.copyto(res[lo:hi], blocks[0][0])
        else:
            srcs = [blk[me] for blk in blocks]
            reduce_in_order(ufunc, srcs, res[lo:hi], silence=x.dtype.kind == "f")
        if call.op is ReduceOp.AVG:
            finalize(call.op, res[lo:hi], n)
    return out


def reduce(engine: ShmEngine, job: Job, call: Call) -> Any:
    """Copy in, sync, the root reduces every buffer in rank order."""
    x = call.x
    assert x is not None and call.root is not None and call.op is not None
    n = engine.ws.world_size
    flat = x.reshape(-1)
    ufunc = reduce_ufunc(call.op, x.dtype)
    mine = engine.ws.rank == call.root
    for lo, hi, views in flat_rounds(engine, job, call, flat):
        if mine and n > 1:
            reduce_in_order(ufunc, views, flat[lo:hi], silence=x.dtype.kind == "f")
            if call.op is ReduceOp.AVG:
                finalize(call.op, flat[lo:hi], n)
    return x
