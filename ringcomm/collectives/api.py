"""The public collective calls (``ProcessGroup`` methods delegate here, passing their
:class:`~ringcomm.core.group_core.GroupCore`).

Each call: check the arguments on the calling rank (TypeError/ValueError, before anything
is sent), ask :mod:`~ringcomm.collectives.chooser` for its :class:`~ringcomm.collectives.
chooser.Plan`, make its :class:`~ringcomm.core.deadline.Deadline` (``timeout_s`` checked
once, here) and run the plan: hierarchically (the group's hierarchy), on the group's
workspace or device windows, or as a registry algorithm through the progress engine
(blocking, or a ``Work`` with ``async_op=True``). Collectives of one group run one after
another in the order called (the group's serial queue). Device arrays are accepted wherever
NumPy arrays are (outputs allocated on the same device); inputs and outputs of one call are
all host or all on one device. Contracts: docs/contracts.md (Python API); the path of one
call, file by file: docs/architecture.md ("One collective call").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringcomm.collectives.base import Call, Comm
from ringcomm.collectives.checks import (
    call_label,
    check_chunk_bytes,
    check_counts,
    check_flag,
    check_op,
    check_out,
    check_out_apart,
    check_out_or_new,
    check_root,
    check_row_array,
    check_rows,
    empty_like,
    may_share_memory,
    same_memory,
)
from ringcomm.collectives.chooser import (
    hier_fits,
    plan,
    plan_scatter,
    plan_uneven,
    plan_without_workspace,
)
from ringcomm.collectives.ipc import IpcCollectives
from ringcomm.collectives.registry import HIER_ALGO, IPC_ALGO, WORKSPACE_ALGO, get_algorithm
from ringcomm.collectives.staged import PIPELINED, DeviceCall, staged_class
from ringcomm.collectives.workspace import WorkspaceCollectives
from ringcomm.config import ipc_small_bytes, ipc_window_bytes, mps_active
from ringcomm.core.buffers import check_array
from ringcomm.core.deadline import Deadline
from ringcomm.core.flight import E_END, FOLD_MASK, RUNNING, now
from ringcomm.core.group_core import GroupCore, setup_workspace
from ringcomm.core.progress import Op
from ringcomm.core.work import Work
from ringcomm.device.ipc import ipc_device_for
from ringcomm.device.staging import backend_for
from ringcomm.device.xp import is_device_array
from ringcomm.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    PeerFailedError,
    RingcommError,
)
from ringcomm.ops import ReduceOp

__all__ = [
    "all_gather",
    "all_gather_v",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "alloc",
    "barrier",
    "broadcast",
    "check_all_gather",
    "check_broadcast",
    "check_reduce_scatter",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_v",
    "scatter",
]


# -- running ---------------------------------------------------------------------------
#: Errors of a collective that write the flight record (RINGCOMM_TRACE_DIR).
_TRACED = (CommTimeoutError, PeerFailedError, CollectiveMismatchError)


def _run(
    group: GroupCore, call: Call, timeout_s: float | None, async_op: bool, what: str | None = None
) -> Any:
    """Run ``call`` (:func:`_run_call`), recorded by the process's flight recorder; a
    timeout or a failed peer writes the record (``RINGCOMM_TRACE_DIR``)."""
    recorder = group.state.recorder
    if not recorder.enabled:
        return _run_call(group, call, timeout_s, async_op, what)
    # Inline, not recorder.start()/done(): the entry pushed here, ended by storing its end
    # time (its state reads "done" then), folded into the summary when the sequence
    # number is a multiple of FOLD_BATCH (ringcomm.core.flight.FlightRecorder). This is on
    # every collective (~0.5 us a call in a 2-rank job). nbytes None: dtype times shape.
    seq = group.collective_seq + 1
    start_s = now()
    e = [
        group.group_id,
        seq,
        call.name,
        call.dtype,
        call.shape,
        call.nbytes,
        call.algo,
        group.ranks,
        start_s,
        None,
        RUNNING,
    ]
    recorder.push(e)
    try:
        result = _run_call(group, call, timeout_s, async_op, what, start_s)
    except BaseException as exc:
        recorder.end(e, exc)
        if isinstance(exc, _TRACED):
            group.state.dump_trace(
                f"{type(exc).__name__} in op #{group.collective_seq} {call.name}"
            )
        raise
    if async_op and isinstance(result, Work):
        result.add_done_callback(lambda w: _ended(group, e, w, f"op #{seq} {call.name}"))
        return result
    e[E_END] = now()
    if not seq & FOLD_MASK:
        recorder.fold()
    return result


def _ended(group: GroupCore, entry: Any, work: Work, what: str) -> None:
    """An asynchronous collective (``what``) ended (a done callback: no waiting here)."""
    error = work.exception()
    group.state.recorder.end(entry, error)
    if isinstance(error, _TRACED):
        group.state.dump_trace(f"{type(error).__name__} in {what}")


def _run_call(
    group: GroupCore,
    call: Call,
    timeout_s: float | None,
    async_op: bool,
    what: str | None = None,
    start_s: float | None = None,
) -> Any:
    """Check the group's piece size and ``timeout_s`` (once: the call's :class:`Deadline`
    counts from ``start_s``, the flight recorder's start time, or from now) and run
    ``call`` (:func:`_start`)."""
    if what is None:
        what = call_label(group, call.name)
    chunk = call.chunk_bytes or group.chunk_bytes
    if type(chunk) is not int or chunk <= 0 or chunk > group.state.config.max_piece_bytes:
        chunk = check_chunk_bytes(group, what, chunk)
    deadline = _deadline(group, timeout_s, what, start_s)
    group.check_usable(call.name)
    return _start(group, call, chunk, deadline, async_op)


def _deadline(
    group: GroupCore, timeout_s: float | None, what: str, start_s: float | None = None
) -> Deadline:
    try:
        return group.deadline(timeout_s, start_s)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def _start(group: GroupCore, call: Call, chunk: int, deadline: Deadline, async_op: bool) -> Any:
    """Run a checked ``call`` with pieces of ``chunk`` bytes until ``deadline``: on the
    group's workspace or device windows, or as its registry algorithm (device arrays
    staged) through the engine, a blocking one by its fast lane if it has one."""
    group.last_algo = call.algo
    if call.algo == WORKSPACE_ALGO:
        return _run_on_workspace(group, call, chunk, deadline, async_op)
    if call.algo == IPC_ALGO:
        return _run_on_windows(group, call, chunk, deadline, async_op)
    cls = get_algorithm(call.name, call.algo)
    if group.workspace_calls is not None:  # earlier collectives of the group go first
        group.workspace_calls.drain(deadline.timeout_s)
    arr = call.x if call.x is not None else call.out
    device = None
    if arr is not None and type(arr) is not np.ndarray and is_device_array(arr):
        backend = backend_for(arr)
        # The event on the caller's stream, now: staging waits for it before reading.
        device = DeviceCall(backend, backend.caller_event())
        if (call.name, call.algo) not in PIPELINED:
            cls = staged_class(cls)
    comm = Comm(
        progress=group.progress,
        rank=group.rank,
        world_size=group.world_size,
        group_id=group.group_id,
        ranks=group.ranks,
        seq=group.next_collective_seq(),  # after every check: only a call that runs takes one
        chunk_bytes=chunk,
        timeout_s=deadline.timeout_s,
        serial=group.serial,
        plans=group.plans,
        ring_order=group.ring_order,
    )
    op = cls(comm, call, async_op=async_op)
    if device is not None:
        op.device = device  # type: ignore[attr-defined]
    if async_op:
        group.engine_tail = weakref.ref(op)  # a workspace call after it waits for it
        return group.run_until(op, deadline, True)
    # The algorithm's fast lane, if it has one (not with RINGCOMM_LOG=debug: every op then
    # goes through the engine, which logs its start and end).
    if not group.progress.log_ops and op.run_now(deadline.at):
        result = op.result
    else:
        result = group.run_until(op, deadline, False)
    # One outcome: a peer may have failed this call while we consumed what it had sent.
    aborted = group.progress.aborted(group.group_id, comm.seq, op.desc)
    if aborted is not None:
        if group.failed is None:
            group.failed = aborted
        raise aborted
    return result


def _run_hier(
    group: GroupCore, what: str, timeout_s: float | None, run: Callable[[Any, Deadline], Any]
) -> Any:
    """A call planned hierarchical: ``run(hierarchy, deadline)`` (the group's
    :meth:`~ringcomm.core.group_core.GroupCore.hierarchy`, its calls over sub-groups)."""
    deadline = _deadline(group, timeout_s, what)
    result = run(group.hierarchy(), deadline)
    group.last_algo = HIER_ALGO  # (after: its leftover may go flat)
    return result


def _call_on(
    group: GroupCore,
    name: str,
    algo: str,
    x: Any,
    timeout_s: float | None,
    async_op: bool,
    **fields: Any,
) -> Any:
    """Run collective ``name`` on ``x`` (its dtype and shape) as flat algorithm ``algo``;
    ``fields``: the call's other :class:`Call` fields."""
    call = Call(name, algo, x=x, dtype=x.dtype, shape=tuple(x.shape), **fields)
    return _run(group, call, timeout_s, async_op)


@dataclass(slots=True)
class _Begun:
    """A collective call begun: its group, name and label (``what``), the algorithm asked
    for, whether it may run hierarchically (:func:`~ringcomm.collectives.chooser.hier_fits`,
    asked before the arguments are checked) and its ``timeout_s`` (checked when it runs)."""

    group: GroupCore
    name: str
    what: str
    algo: str | None
    hier: bool
    timeout_s: float | None


def _begin(
    group: GroupCore, name: str, algo: str | None, async_op: Any, timeout_s: float | None
) -> _Begun:
    """Begin collective ``name``: only a blocking call may run hierarchically."""
    hier = async_op is False and hier_fits(group, name, algo)
    return _Begun(group, name, call_label(group, name), algo, hier, timeout_s)


def _hier_or_flat(
    b: _Begun,
    x: Any,
    async_op: bool,
    on_hier: Callable[[Any, Deadline, int | None], Any],
    **fields: Any,
) -> Any:
    """Plan call ``b`` on ``x`` and run it: ``on_hier(hierarchy, deadline, segment_bytes)``
    if planned hierarchical, else :func:`_call_on` with the plan's algorithm and piece
    size."""
    group, what = b.group, b.what
    p = plan(group, b.name, b.algo, x.nbytes, type(x) is np.ndarray, what, b.hier)
    if p.algo == HIER_ALGO:
        return _run_hier(group, what, b.timeout_s, lambda h, d: on_hier(h, d, p.segment_bytes))
    return _call_on(
        group, b.name, p.algo, x, b.timeout_s, async_op, chunk_bytes=p.chunk_bytes, **fields
    )


def _workspace_calls(group: GroupCore, timeout_s: float) -> WorkspaceCollectives | None:
    """The group's collectives on its workspace; a sub-group sets the workspace up at its
    first call (all members are in it; within that call's ``timeout_s``); None if that
    found none (all members agree). A setup that fails leaves the group failed."""
    calls = group.workspace_calls
    if calls is None:
        if group.workspace is None and group.workspace_pending:
            group.workspace_pending = False
            try:
                group.workspace = setup_workspace(group, timeout_s)
            except RingcommError as exc:
                if group.failed is None:
                    group.failed = exc
                raise
        if group.workspace is None:
            return None
        calls = group.workspace_calls = WorkspaceCollectives(group, group.workspace)
    return calls  # type: ignore[no-any-return]


def alloc(group: GroupCore, shape: Any, dtype: Any = np.float32) -> np.ndarray:
    """A zeroed NumPy array that the group's collectives use in place (a symmetric
    buffer): on a group with a shared workspace it lives in a window every rank maps, so
    an all_reduce of it copies nothing in or out. Every rank calls it, in the same order,
    with the same shape and dtype. Elsewhere: a plain ``np.zeros``."""
    what = call_label(group, "alloc")
    try:
        dt = np.dtype(dtype)
        dims = (
            (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        )
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what}: shape must be ints and dtype a NumPy dtype: {exc}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"{what}: negative dimension in shape {dims}")
    check_array(np.empty(0, dt), what)  # the supported dtypes
    group.check_usable("alloc")
    calls = _workspace_calls(group, group.timeout_s)
    if calls is None:
        return np.zeros(dims, dt)
    calls.drain(group.timeout_s)
    return calls.alloc(dims, dt)


def _run_on_workspace(
    group: GroupCore, call: Call, chunk: int, deadline: Deadline, async_op: bool
) -> Any:
    calls = _workspace_calls(group, deadline.timeout_s)
    if calls is None:  # a sub-group found it has no workspace after all: as elsewhere
        return _start(group, _without_workspace(group, call), chunk, deadline, async_op)
    seq = group.next_collective_seq()
    return calls.run(call, seq, deadline.timeout_s, async_op, deadline.start)


def _run_on_windows(
    group: GroupCore, call: Call, chunk: int, deadline: Deadline, async_op: bool
) -> Any:
    """A device call on the group's device windows (ringcomm.collectives.ipc), run by its
    workspace; the caller's stream is taken now (an async call runs on the worker)."""
    calls = _workspace_calls(group, deadline.timeout_s)
    if calls is None:  # a sub-group found it has no workspace: staged, as elsewhere
        return _start(group, _without_workspace(group, call), chunk, deadline, async_op)
    ext = calls.extensions.get(IPC_ALGO)
    if ext is None:
        ext = calls.extensions[IPC_ALGO] = IpcCollectives(
            calls, ipc_window_bytes(), ipc_small_bytes(), mps_active()
        )
    arr = call.x if call.x is not None else call.out
    stream = None if arr is None else ipc_device_for(arr).caller_stream()
    seq = group.next_collective_seq()
    return calls.run(call, seq, deadline.timeout_s, async_op, deadline.start, stream)


def _without_workspace(group: GroupCore, call: Call) -> Call:
    arr = call.x if call.x is not None else call.out
    nbytes = 0 if arr is None else int(arr.nbytes)
    return call._replace(algo=plan_without_workspace(group, call.name, nbytes))


# -- checks of the calls that also run hierarchically (ringcomm.collectives.hierarchy, above) --------
def check_reduce_scatter(group: GroupCore, x: Any, out: Any, op: Any) -> tuple[Any, Any, ReduceOp]:
    """reduce_scatter's arguments checked: ``(x, out, op)``, ``out`` allocated if None."""
    what = call_label(group, "reduce_scatter")
    x = check_array(x, what, device=True)
    check_rows(x, group.world_size, what)
    rop = check_op(op, x.dtype, what)
    shape = tuple(x.shape[1:])
    out = check_out_or_new(out, shape, x, what)
    if may_share_memory(out, x) and not same_memory(out, x[group.rank]):
        raise ValueError(f"{what}: out may overlap x only as x[rank] (the in-place form)")
    return x, out, rop


def check_all_gather(group: GroupCore, x: Any, out: Any) -> tuple[Any, Any]:
    """all_gather's arguments checked: ``(x, out)``, ``out`` allocated if None."""
    what = call_label(group, "all_gather")
    x = check_array(x, what, device=True)
    shape = (group.world_size, *x.shape)
    out = check_out_or_new(out, shape, x, what)
    return x, out


def check_broadcast(group: GroupCore, x: Any, src: Any) -> tuple[Any, int]:
    """broadcast's arguments checked: ``(x, src)``."""
    what = call_label(group, "broadcast")
    src = check_root(src, group, what, "src")
    return check_array(x, what, writeable=group.rank != src, device=True), src


# -- the collectives -------------------------------------------------------------------
def all_reduce(
    group: GroupCore,
    x: Any,
    op: ReduceOp | str = "sum",
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
    algo: str | None = None,
) -> Any:
    """Reduce ``x`` over all ranks, in place on every rank; return ``x`` (or a Work).

    A group that spans hosts, with several ranks on one of them, reduces hierarchically
    (:mod:`ringcomm.collectives.hierarchy`) unless ``algo`` (or ``RINGCOMM_ALGO``) names a
    flat algorithm, the call is asynchronous or an integer mean; ``algo="hier"`` asks for
    it (an error on a group it does not fit)."""
    hier = async_op is False and hier_fits(group, "all_reduce", algo)
    what = call_label(group, "all_reduce")
    x = check_array(x, what, writeable=True, device=True)
    dtype = x.dtype
    rop = check_op(op, dtype, what)
    if async_op is not False:
        async_op = check_flag(async_op, what)
    nbytes = x.nbytes
    if hier and rop is ReduceOp.AVG and dtype.kind in "iub":
        hier = False  # integer means: flat
    p = plan(group, "all_reduce", algo, nbytes, type(x) is np.ndarray, what, hier)
    if p.algo == HIER_ALGO:
        return _run_hier(
            group, what, timeout_s, lambda h, d: h.all_reduce(x, rop, d, p.segment_bytes)
        )
    call = Call("all_reduce", p.algo, x, None, rop, None, dtype, x.shape, p.chunk_bytes, nbytes)
    return _run(group, call, timeout_s, async_op, what)


def reduce_scatter(
    group: GroupCore,
    x: Any,
    out: Any = None,
    op: ReduceOp | str = "sum",
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
    algo: str | None = None,
) -> Any:
    """Reduce ``x`` (``x.shape[0] == world_size``) and return this rank's row ``x[rank]``
    of the result (shape ``x.shape[1:]``, in ``out`` if given). ``x`` is not modified.
    Hierarchical on a group spanning hosts, as :func:`all_reduce`."""
    b = _begin(group, "reduce_scatter", algo, async_op, timeout_s)
    x, out, rop = check_reduce_scatter(group, x, out, op)
    async_op = check_flag(async_op, b.what)
    if b.hier and rop is ReduceOp.AVG and x.dtype.kind in "iu":
        b.hier = False  # integer means: flat
    return _hier_or_flat(
        b, x, async_op, lambda h, d, seg: h.reduce_scatter(x, out, rop, d, seg), out=out, op=rop
    )


def all_gather(
    group: GroupCore,
    x: Any,
    out: Any = None,
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
    algo: str | None = None,
) -> Any:
    """Every rank's ``x`` (same shape everywhere) as ``(world_size, *x.shape)``, rank order.
    Hierarchical on a group spanning hosts, as :func:`all_reduce`."""
    b = _begin(group, "all_gather", algo, async_op, timeout_s)
    x, out = check_all_gather(group, x, out)
    async_op = check_flag(async_op, b.what)
    return _hier_or_flat(b, x, async_op, lambda h, d, seg: h.all_gather(x, out, d, seg), out=out)


def broadcast(
    group: GroupCore,
    x: Any,
    src: int = 0,
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
    algo: str | None = None,
) -> Any:
    """``src``'s ``x`` into every rank's ``x`` (in place); return ``x`` (or a Work).
    Hierarchical on a group spanning hosts, as :func:`all_reduce`."""
    b = _begin(group, "broadcast", algo, async_op, timeout_s)
    x, src = check_broadcast(group, x, src)
    async_op = check_flag(async_op, b.what)
    return _hier_or_flat(b, x, async_op, lambda h, d, _seg: h.broadcast(x, src, d), root=src)


def reduce(
    group: GroupCore,
    x: Any,
    dst: int = 0,
    op: ReduceOp | str = "sum",
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
    algo: str | None = None,
) -> Any:
    """Reduce ``x`` over all ranks into ``dst``'s ``x`` (in place there); return ``x``.
    Other ranks' ``x`` is not modified."""
    what = call_label(group, "reduce")
    dst = check_root(dst, group, what, "dst")
    x = check_array(x, what, writeable=group.rank == dst, device=True)
    rop = check_op(op, x.dtype, what)
    async_op = check_flag(async_op, what)
    algo = plan(group, "reduce", algo, x.nbytes, type(x) is np.ndarray, what).algo
    return _call_on(group, "reduce", algo, x, timeout_s, async_op, op=rop, root=dst)


def gather(
    group: GroupCore,
    x: Any,
    dst: int = 0,
    out: Any = None,
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
    algo: str | None = None,
) -> Any:
    """Every rank's ``x`` as ``(world_size, *x.shape)`` on ``dst`` (in ``out`` if given
    there); None on the other ranks (which ignore ``out``)."""
    what = call_label(group, "gather")
    dst = check_root(dst, group, what, "dst")
    x = check_array(x, what, device=True)
    async_op = check_flag(async_op, what)
    if group.rank == dst:
        shape = (group.world_size, *x.shape)
        out = check_out_or_new(out, shape, x, what)
    else:
        out = None
    algo = plan(group, "gather", algo, x.nbytes, type(x) is np.ndarray, what).algo
    return _call_on(group, "gather", algo, x, timeout_s, async_op, out=out, root=dst)


def scatter(
    group: GroupCore,
    x: Any,
    src: int = 0,
    out: Any = None,
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
    algo: str | None = None,
) -> Any:
    """Row ``x[rank]`` of ``src``'s ``x`` (``x.shape[0] == world_size``) on every rank.

    On other ranks ``x`` may be None (dtype and shape then come from ``src``'s message) or
    an array of ``src``'s shape and dtype (checked against it; not written). The row is
    returned, in ``out`` if given (shape ``x.shape[1:]``).

    Device arrays on a group with a workspace go through host copies (a rank passing
    ``x=None`` cannot know where the source's rows live), unless ``algo="ipc"`` (or
    ``RINGCOMM_ALGO=ipc`` on a rank with a device array): then every rank passes a device
    array (``x`` on ``src``, ``x`` or ``out`` elsewhere) and the rows move between device
    windows.
    """
    what = call_label(group, "scatter")
    src = check_root(src, group, what, "src")
    n = group.world_size
    async_op = check_flag(async_op, what)
    dtype: np.dtype[Any] | None = None
    shape: tuple[int, ...] | None = None
    if x is not None or group.rank == src:
        x = check_array(x, what, device=True)
        check_rows(x, n, what)
        dtype, shape = x.dtype, tuple(x.shape)
    if out is not None:
        if dtype is not None and shape is not None:
            out = check_out(out, shape[1:], dtype, what, x)
        else:
            out = check_array(out, f"{what} (out)", writeable=True, device=True)
            dtype, shape = out.dtype, (n, *out.shape)
    elif dtype is not None and shape is not None:  # src, or a rank that passed x
        out = empty_like(x, shape[1:])
    host = (x is None or type(x) is np.ndarray) and (out is None or type(out) is np.ndarray)
    algo = plan_scatter(group, algo, host, x is None and out is None, what).algo
    if algo == WORKSPACE_ALGO and not host:
        # A rank that passed x=None cannot know the source's kind of array: on a group with
        # a workspace every rank takes it, device arrays copied through the host.
        return _scatter_device_on_workspace(group, x, src, out, dtype, shape, timeout_s, async_op)
    call = Call("scatter", algo, x=x, out=out, root=src, dtype=dtype, shape=shape)
    return _run(group, call, timeout_s, async_op)


def _scatter_device_on_workspace(
    group: GroupCore,
    x: Any,
    src: int,
    out: Any,
    dtype: Any,
    shape: Any,
    timeout_s: float | None,
    async_op: bool,
) -> Any:
    """scatter with device arrays (``get()``/``set()``, CuPy's and the stand-in's) on a
    group with a workspace: run on host copies, blocking; a Work that is done if async."""
    x_host = None if x is None else x.get()
    out_host = None if out is None else np.empty(out.shape, out.dtype)
    call = Call(
        "scatter", WORKSPACE_ALGO, x=x_host, out=out_host, root=src, dtype=dtype, shape=shape
    )
    got = _run(group, call, timeout_s, False)
    if out is not None:
        out.set(got)
        got = out
    if not async_op:
        return got
    done = Op(group.progress)
    done.result = got
    done.finish()
    return Work(group.progress, done, None)


def all_to_all(
    group: GroupCore,
    x: Any,
    out: Any = None,
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
    algo: str | None = None,
) -> Any:
    """``out[j]`` is rank ``j``'s ``x[rank]`` (``x.shape[0] == world_size``); return out."""
    what = call_label(group, "all_to_all")
    x = check_array(x, what, device=True)
    check_rows(x, group.world_size, what)
    async_op = check_flag(async_op, what)
    out = check_out_apart(out, tuple(x.shape), x, what, "all_to_all")
    algo = plan(group, "all_to_all", algo, x.nbytes, type(x) is np.ndarray, what).algo
    return _call_on(group, "all_to_all", algo, x, timeout_s, async_op, out=out)


def barrier(
    group: GroupCore,
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
    algo: str | None = None,
) -> Any:
    """Return once every rank of the group has entered the barrier (hierarchically on a
    group spanning hosts, as :func:`all_reduce`)."""
    hier = async_op is False and hier_fits(group, "barrier", algo)
    what = call_label(group, "barrier")
    async_op = check_flag(async_op, what)
    p = plan(group, "barrier", algo, 0, True, what, hier)
    if p.algo == HIER_ALGO:
        return _run_hier(group, what, timeout_s, lambda h, d: h.barrier(d))
    return _run(group, Call("barrier", p.algo), timeout_s, async_op)


# -- uneven collectives (rows of different counts per rank) ------------------------------
def all_gather_v(
    group: GroupCore,
    x: Any,
    sizes: Any = None,
    out: Any = None,
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
) -> Any:
    """Every rank's rows (``x.shape[0]`` may differ per rank) concatenated in rank order:
    ``(sum(sizes), *x.shape[1:])``, in ``out`` if given.

    ``sizes``: every rank's row count (the same list on every rank; ``sizes[rank] ==
    x.shape[0]``). None: the counts are exchanged first (a small all_gather, blocking
    even with ``async_op``). Ranks that disagree on ``sizes``, the dtype or the row shape
    raise ``CollectiveMismatchError``.
    """
    what = call_label(group, "all_gather_v")
    x = check_row_array(x, what)
    async_op = check_flag(async_op, what)
    n = group.world_size
    if sizes is None:
        counts = all_gather(group, np.array([x.shape[0]], np.int64), timeout_s=timeout_s)
        sizes = tuple(int(c) for c in counts.reshape(-1))
    else:
        sizes = check_counts(sizes, n, what, "sizes")
        if sizes[group.rank] != x.shape[0]:
            raise ValueError(
                f"{what}: sizes[{group.rank}] is {sizes[group.rank]} but x has "
                f"{x.shape[0]} rows (shape {x.shape})"
            )
    shape = (sum(sizes), *x.shape[1:])
    out = check_out_or_new(out, shape, x, what)
    algo = plan_uneven(group, "all_gather_v", out.nbytes, type(x) is np.ndarray, what).algo
    call = Call("all_gather_v", algo, x=x, out=out, dtype=x.dtype, shape=(*sizes, *x.shape[1:]))
    return _run(group, call, timeout_s, async_op)


def reduce_scatter_v(
    group: GroupCore,
    x: Any,
    splits: Any,
    out: Any = None,
    op: ReduceOp | str = "sum",
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
) -> Any:
    """Reduce ``x`` (``sum(splits)`` rows, the same ``splits`` on every rank) and return
    this rank's rows of the result, ``splits[rank]`` of them from row
    ``sum(splits[:rank])`` on (shape ``(splits[rank], *x.shape[1:])``, in ``out`` if given;
    ``out`` may not overlap ``x``). ``x`` is not modified."""
    what = call_label(group, "reduce_scatter_v")
    x = check_row_array(x, what)
    splits = check_counts(splits, group.world_size, what, "splits")
    if sum(splits) != x.shape[0]:
        raise ValueError(
            f"{what}: splits {list(splits)} add up to {sum(splits)} rows but x has "
            f"{x.shape[0]} (shape {x.shape})"
        )
    rop = check_op(op, x.dtype, what)
    async_op = check_flag(async_op, what)
    shape = (splits[group.rank], *x.shape[1:])
    out = check_out_apart(out, shape, x, what, "reduce_scatter_v")
    algo = plan_uneven(group, "reduce_scatter_v", x.nbytes, type(x) is np.ndarray, what).algo
    call = Call(
        "reduce_scatter_v", algo, x=x, out=out, op=rop, dtype=x.dtype, shape=(*splits, *x.shape[1:])
    )
    return _run(group, call, timeout_s, async_op)


def all_to_all_v(
    group: GroupCore,
    x: Any,
    input_splits: Any,
    output_splits: Any,
    out: Any = None,
    async_op: bool = False,
    *,
    timeout_s: float | None = None,
) -> Any:
    """Rows ``input_splits[j]`` of ``x`` (in order: the first ``input_splits[0]`` rows go to
    rank 0, the next to rank 1, ...) go to rank ``j``; ``out`` holds ``output_splits[j]``
    rows from each rank ``j`` in rank order (shape ``(sum(output_splits), *x.shape[1:])``;
    ``out`` may not overlap ``x``). Rank ``r``'s ``input_splits[j]`` must equal rank
    ``j``'s ``output_splits[r]``: a rank that receives another count than it expects
    raises ``CollectiveMismatchError`` (and so does every rank of the call)."""
    what = call_label(group, "all_to_all_v")
    x = check_row_array(x, what)
    n, r = group.world_size, group.rank
    ins = check_counts(input_splits, n, what, "input_splits")
    outs = check_counts(output_splits, n, what, "output_splits")
    if sum(ins) != x.shape[0]:
        raise ValueError(
            f"{what}: input_splits {list(ins)} add up to {sum(ins)} rows but x has "
            f"{x.shape[0]} (shape {x.shape})"
        )
    if ins[r] != outs[r]:
        raise ValueError(
            f"{what}: this rank sends itself input_splits[{r}] = {ins[r]} rows but expects "
            f"output_splits[{r}] = {outs[r]}"
        )
    async_op = check_flag(async_op, what)
    shape = (sum(outs), *x.shape[1:])
    out = check_out_apart(out, shape, x, what, "all_to_all_v")
    algo = plan_uneven(group, "all_to_all_v", x.nbytes, type(x) is np.ndarray, what).algo
    call = Call(
        "all_to_all_v", algo, x=x, out=out, dtype=x.dtype, shape=(*ins, *outs, *x.shape[1:])
    )
    return _run(group, call, timeout_s, async_op)
