"""Finished operations let go of the caller's arrays (no reference cycle, no leftovers).

With the cyclic garbage collector disabled, an array passed to any p2p call or collective
(blocking or asynchronous, fast lane or regular path, host or stand-in device array) must
be freed as soon as the caller drops it (and the Work) after the call completed: by
reference counting alone. A Work the caller keeps holds only its result. Every rank of one
spawned job runs every case; a case reports the names of arrays still alive.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm.device.standin import standin_array

W = 3
SMALL = 16  # elements: inline, fast lane for a blocking direct all_reduce
LARGE = 1 << 16  # elements: zero-copy pieces (chunk_bytes below cuts several)


def _mk(kind: str, a: np.ndarray) -> Any:
    return a if kind == "host" else standin_array(a)


def _alive(refs: dict[str, weakref.ref[Any]], grace_s: float = 2.0) -> list[str]:
    """Names still alive after ``grace_s``. Not zero: the thread that completed an op
    (the progress thread, or another caller) may still be returning up its stack, whose
    frames refer to the op, when the waiting caller wakes. A cycle or a leftover
    reference (with the cyclic collector disabled) never goes."""
    give_up_at = time.monotonic() + grace_s
    while True:
        left = sorted(name for name, r in refs.items() if r() is not None)
        if not left or time.monotonic() >= give_up_at:
            return left
        time.sleep(0.001)


def _collective_cases(
    pg: rc.ProcessGroup, kind: str, n: int
) -> list[tuple[str, Callable[..., Any]]]:
    """(name, fn(async_op) -> (arrays passed, Work or None)) for every collective."""
    w = pg.world_size
    rank = pg.rank

    def arr(*shape: int) -> Any:
        return _mk(kind, np.ones(shape, np.float32))

    def ar(algo: str) -> Callable[[bool], Any]:
        def fn(async_op: bool) -> Any:
            x = arr(n)
            return [x], pg.all_reduce(x, async_op=async_op, algo=algo)

        return fn

    def bc(algo: str) -> Callable[[bool], Any]:
        def fn(async_op: bool) -> Any:
            x = arr(n)
            return [x], pg.broadcast(x, src=1, async_op=async_op, algo=algo)

        return fn

    def rs(async_op: bool) -> Any:
        x, out = arr(w, n), arr(n)
        return [x, out], pg.reduce_scatter(x, out=out, async_op=async_op)

    def ag(async_op: bool) -> Any:
        x, out = arr(n), arr(w, n)
        return [x, out], pg.all_gather(x, out=out, async_op=async_op)

    def red(async_op: bool) -> Any:
        x = arr(n)
        return [x], pg.reduce(x, dst=2, async_op=async_op)

    def gat(async_op: bool) -> Any:
        x = arr(n)
        return [x], pg.gather(x, dst=0, async_op=async_op)

    def sca(async_op: bool) -> Any:
        x = arr(w, n) if rank == 1 else None
        out = arr(n)
        return [a for a in (x, out) if a is not None], pg.scatter(
            x, src=1, out=out, async_op=async_op
        )

    def a2a(async_op: bool) -> Any:
        x, out = arr(w, n), arr(w, n)
        return [x, out], pg.all_to_all(x, out=out, async_op=async_op)

    return [
        ("all_reduce/ring", ar("ring")),
        ("all_reduce/rd", ar("rd")),
        ("all_reduce/direct", ar("direct")),
        ("broadcast/chain", bc("chain")),
        ("broadcast/tree", bc("tree")),
        ("reduce_scatter", rs),
        ("all_gather", ag),
        ("reduce", red),
        ("gather", gat),
        ("scatter", sca),
        ("all_to_all", a2a),
    ]


def _release_job(pg: rc.ProcessGroup) -> list[str]:
    """Every case on this rank; returns 'case: names still alive' for each failure."""
    pg.chunk_bytes = 64 * 1024  # LARGE float32 messages go in several zero-copy pieces
    failures: list[str] = []
    gc.collect()
    gc.disable()
    try:
        for kind in ("host", "standin"):
            for n in (SMALL, LARGE):
                for name, fn in _collective_cases(pg, kind, n):
                    for async_op in (False, True):
                        refs: dict[str, weakref.ref[Any]] = {}
                        arrays, work = fn(async_op)
                        if async_op:
                            work.wait()
                        for i, a in enumerate(arrays):
                            refs[f"arg{i}"] = weakref.ref(a)
                        result = work if not async_op else work.wait()
                        if result is not None and not isinstance(result, (list, tuple)):
                            refs["result"] = weakref.ref(result)
                        del arrays, work, result, a
                        left = _alive(refs)
                        if left:
                            failures.append(f"{kind} n={n} {name} async={async_op}: {left}")
                        pg.barrier()
                failures += _p2p_cases(pg, kind, n)
        # A kept Work holds only its result: isend's buffer goes, irecv's result stays.
        if pg.rank < 2:
            peer = 1 - pg.rank
            x = _mk("host", np.ones(LARGE, np.float32))
            ref = weakref.ref(x)
            work = pg.isend(x, peer, tag=90) if pg.rank == 0 else pg.irecv(x, peer, tag=90)
            work.wait()
            del x
            if pg.rank == 0 and _alive({"x": ref}):
                failures.append("a kept isend Work still holds its buffer")
            if pg.rank == 1 and ref() is None:
                failures.append("a kept irecv Work lost its result")
            del work
            if _alive({"x": ref}):
                failures.append("the buffer outlived its Work")
    finally:
        gc.enable()
    return failures


def _p2p_cases(pg: rc.ProcessGroup, kind: str, n: int) -> list[str]:
    """send/recv/isend/irecv between ranks 0 and 1 (rank 2 only joins the barriers)."""
    failures = []
    rank = pg.rank
    for tag, asynchronous in ((1, False), (2, True)):
        for sender in (0, 1):
            if rank < 2:
                x = _mk(kind, np.ones(n, np.float32))
                ref = weakref.ref(x)
                peer = 1 - rank
                if rank == sender:
                    work = pg.isend(x, peer, tag=tag) if asynchronous else pg.send(x, peer, tag=tag)
                else:
                    work = pg.irecv(x, peer, tag=tag) if asynchronous else pg.recv(x, peer, tag=tag)
                if asynchronous:
                    work.wait()
                del x, work
                if _alive({"x": ref}):
                    what = (
                        ("isend" if asynchronous else "send")
                        if rank == sender
                        else ("irecv" if asynchronous else "recv")
                    )
                    failures.append(f"{kind} n={n} {what}: buffer alive")
            pg.barrier()
    return failures


@pytest.mark.timeout(120)
def test_finished_ops_release_caller_arrays(no_child_processes: None) -> None:
    per_rank = rc.spawn(_release_job, W, timeout_s=100)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not failures, "\n".join(failures)
