"""ringcomm as a ``torch.distributed`` backend (CPU and CUDA tensors), in pure Python.

    import torch.distributed as dist
    import ringcomm.torch_backend  # registers the backend "ringcomm"
    dist.init_process_group("ringcomm")          # env:// (torchrun), tcp://, file://, store=
    model = torch.nn.parallel.DistributedDataParallel(model)   # or fully_shard(model)

The only module of ringcomm that imports torch (an optional extra: ``pip install
ringcomm[torch]``). How it fits into torch.distributed (checked against torch 2.13):

* Registration: ``dist.Backend.register_backend("ringcomm", _create, devices=["cpu",
  "cuda"])`` at import. torch calls :func:`_create` ``(store, rank, world_size, timeout)`` once for the
  default group and once more for every ``new_group`` this rank belongs to (only on
  members); ``store`` is a ``PrefixStore`` unique to the group.
* Rendezvous (one ringcomm group per torch group): rank 0 of the torch group starts a
  ringcomm rendezvous store (:class:`~ringcomm.rendezvous.StoreServer`, a port from the OS,
  ``RINGCOMM_TOKEN`` or a freshly minted token) and publishes ``{addr, port}`` under
  ``ringcomm/store/<n>`` in the torch store (n numbers the instances of the group:
  ``destroy_process_group()`` and ``init_process_group("ringcomm")`` again make the next);
  every rank reads it and calls ``rc.init_process_group(..., host_store=False)``. So
  ringcomm needs no port of its own (torchrun's ``MASTER_PORT`` belongs to torch's
  TCPStore) and works under every torch ``init_method``. The token is not in the torch
  store (which anyone who reaches it can read): a minted one reaches each rank sealed under
  a key exchange on its first contact with the ringcomm store, once per rank
  (ringcomm.rendezvous.security). The address is ``RINGCOMM_MASTER_ADDR``,
  else ``MASTER_ADDR`` (set by torchrun and ``env://``), else 127.0.0.1: on several hosts
  with ``tcp://`` or ``file://`` initialisation, set one of them to rank 0's address.
  Why not one ringcomm group and ``pg.new_group``: torch runs the creator only on a new
  group's members, while ringcomm's ``new_group`` must be called by every rank of the
  parent, in one order; an independent group per torch group needs neither (it costs a
  store, sockets and a progress thread per group).
* :class:`RingcommProcessGroup` subclasses ``dist.ProcessGroup`` (``super().__init__(rank,
  size)``; ``dist._Backend`` cannot be subclassed from Python). Each call turns tensors into
  arrays on their memory (``tensor.numpy()`` for contiguous CPU tensors; CuPy arrays for
  CUDA tensors, below) and returns a
  :class:`RingcommWork`. Where torch will wait at once (``opts.asyncOp`` False: plain
  ``dist.all_reduce(t)`` and friends) the ringcomm call runs blocking on the caller's thread
  (ringcomm's small-message fast lane, no thread hand-off). Otherwise (``async_op=True``,
  DDP's bucket all-reduces from autograd's thread) it is started with ``async_op=True`` and
  returns at once; ringcomm's progress engine moves the bytes.
* Completion: ringcomm's ``Work`` has no completion callback. ``RingcommWork.wait()`` waits
  on the calling thread. A torch ``Future`` (``get_future()``, what DDP's comm hooks chain
  on) must complete with nobody waiting, so the first ``get_future()`` hands the work to
  the group's completion thread, which waits on collectives in issue order (ringcomm
  finishes a group's collectives in that order); point-to-point work, which may finish in
  any order, is polled by a second thread. A failed operation makes ``wait()`` raise and
  fails the future's C++ side (not ``Future.set_exception``, which only stores the
  exception as the value: DDP would read it as tensors and crash), so under DDP the error
  surfaces from ``loss.backward()``.

CUDA tensors (:mod:`ringcomm.torch_backend.device`): a CUDA tensor goes to ringcomm as a CuPy array
on its memory (DLPack, no copy); each call is ordered after the caller's current stream at
the call, the backend's own steps after ringcomm's (copies back, casts) run on that stream,
and ``Work.wait()`` makes the waiter's current stream wait for them (NCCL's semantics); the
future is a CUDA future. Every tensor of one call is on the rank's device (its current
device at the group's first CUDA call) or every one on the CPU; a CUDA tensor must be
contiguous (no hidden copy); else ``ValueError`` naming rank and op, at the call. Several
ranks may share one GPU. A job may mix calls on CPU and on CUDA tensors.

Dtypes: the NumPy ones go as they are. bfloat16 reductions run in float32 on a copy (the
result, rounded back, is the same bytes on every rank); complex SUM/AVG/PREMUL_SUM reduce the
real and imaginary parts as pairs of floats; data movement (broadcast, gathers, all-to-all,
p2p) moves any other dtype as raw bytes. Reduce ops: SUM, AVG, PRODUCT, MIN, MAX map to
ringcomm's; PREMUL_SUM (``dist._make_nccl_premul_sum(f)``, used by FSDP2) multiplies the
input by ``f`` (on a copy where the input is not the output) and sums; BAND and BOR work on
bool tensors (logical AND, OR); other bitwise uses (BXOR, integer BAND/BOR) raise
``ValueError``. ``recv_anysource`` (``dist.recv(t)`` without ``src``) is ringcomm's
``ANY_SOURCE`` receive; the work's ``_source_rank()`` names the sender.

Uneven calls: ``all_gather`` into outputs of different sizes (NCCL's semantics; Gloo
refuses them), ``reduce_scatter`` with inputs of different sizes, ``all_to_all_single`` with
split sizes and ``all_to_all`` with lists of different sizes run on ringcomm's
``all_gather_v`` / ``reduce_scatter_v`` / ``all_to_all_v`` (one collective each, so ranks
whose sizes disagree get ``CollectiveMismatchError`` rather than a hang).

Coalesced calls (``all_gather_coalesced``, ``all_reduce_coalesced``, and what the coalescing
manager ``with dist._coalescing_manager(): ...`` batches: all-reduces, all-gathers into
tensors) run one ringcomm operation per dtype, on the tensors' concatenation. Sparse COO
tensors: ``all_reduce`` with SUM, Gloo's semantics (indices and values gathered, the
result coalesced). ``pg.monitored_barrier(timeout)`` works as Gloo's (``dist.monitored_barrier``
refuses any backend not named gloo). A timeout reaches torch as a ``CommTimeoutError``
whose message starts with torch's words ("Timed out") and carries ringcomm's.

Mixed strings such as ``"cpu:ringcomm,cuda:nccl"`` register only one backend in torch
2.13 (the creator returns a ProcessGroup, which replaces the whole group): use
``"ringcomm"`` for CPU jobs.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from torch.futures import Future

from ringcomm.config import env_master_addr, env_token, security_mode
from ringcomm.core.p2p import ANY_SOURCE
from ringcomm.core.work import Work as RcWork
from ringcomm.errors import CommTimeoutError, RingcommError
from ringcomm.group import ProcessGroup as RcGroup
from ringcomm.group import init_process_group
from ringcomm.rendezvous import StoreServer
from ringcomm.rendezvous.security import job_store
from ringcomm.torch_backend.device import (
    CallScope,
    DeviceBinding,
    array_of,
    current_call,
    start_call,
    tensor_of,
)

__all__ = ["BACKEND_NAME", "RingcommProcessGroup", "RingcommWork"]

#: The name to pass to ``dist.init_process_group`` / ``dist.new_group(backend=...)``.
BACKEND_NAME = "ringcomm"
#: Keys (in the group's torch store) where rank 0 publishes ringcomm's store address, and
#: the counter of ranks done with it at shutdown, per instance of the group (a torch store
#: outlives ``destroy_process_group()``: torchrun's agent store, a ``store=`` passed again).
_STORE_KEY = "ringcomm/store/{}"
_CLOSED_KEY = "ringcomm/closed/{}"
#: Counter (in the group's torch store) of joins: every rank of the n-th instance of the
#: group counts once, so ``(count - 1) // world_size`` numbers the instance.
_JOINS_KEY = "ringcomm/joins"
#: The ringcomm group's namespace in its own store (one store per instance).
_GROUP_NAME = "torch"
#: Longest rank 0 keeps ringcomm's store up at shutdown for the others to check out.
_CHECKOUT_MAX_S = 30.0
#: Tags of monitored barriers in the point-to-point group (far above the all-to-all ones).
_MONITORED_TAG0 = 1 << 40

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


#: A step run once the ringcomm operations are done (copy results back, cast, ...).
_Post = Callable[[], object]


# -- tensors <-> arrays ------------------------------------------------------------------
def _check_cpu(t: Any, what: str) -> torch.Tensor:
    """Check a tensor of the current call: a dense tensor on the CPU or on the rank's device,
    on the same device as the call's others (:meth:`ringcomm.torch_backend.device.CallScope.check`)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported")
    return current_call().check(t)


def _contig(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t`` itself if contiguous, else a contiguous copy (and True: copy results back)."""
    t = t.detach()
    if t.is_contiguous():
        return t, False
    return t.contiguous(), True


def _move_view(t: torch.Tensor) -> Any:
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


class _Reduction:
    """How one tensor takes part in a reduction: the array to reduce, the ringcomm op,
    and what to do before (pre-scaling) and after (copy back, cast back)."""

    __slots__ = ("array", "flat", "op", "post", "scale", "tensor", "work_tensor")

    def __init__(self, t: torch.Tensor, op: Any, what: str, *, in_place: bool) -> None:
        t = _check_cpu(t, what)
        rop, scale = _parse_op(op, t.dtype, what)
        work, copied = _contig(t)
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


def _parse_op(op: Any, dtype: torch.dtype, what: str) -> tuple[str, float | None]:
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


def _async(opts: Any) -> bool:
    """Whether torch will come back for the result later (``asyncOp``, default True).

    ``dist.all_reduce(t)`` and friends set it False and wait on the Work at once: those
    calls run blocking on the caller's thread (ringcomm's fast lane for small messages, no
    thread hand-off); everything else (DDP's hooks, ``async_op=True``) is started and left
    to ringcomm's progress engine.
    """
    return bool(getattr(opts, "asyncOp", True))


def _timeout_s(opts: Any, default_s: float) -> float:
    """The call's timeout from torch options (unset: the group's)."""
    t = getattr(opts, "timeout", None)
    if isinstance(t, datetime.timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return default_s


# -- work ---------------------------------------------------------------------------------
class RingcommWork(dist._Work):  # type: ignore[misc,name-defined]
    """A torch Work over one or more ringcomm operations.

    ``wait()`` blocks (driving ringcomm's progress on this thread) and raises the
    operation's error; ``get_future()`` is completed with the output tensors (or the error)
    by whichever comes first: a ``wait()`` or the group's completion thread.
    """

    def __init__(
        self,
        works: Sequence[RcWork | RingcommWork],
        outputs: list[torch.Tensor],
        post: _Post | None,
        timeout_s: float,
        desc: str,
        on_error: Callable[[BaseException], None] | None = None,
        watch: Callable[[RingcommWork], None] | None = None,
        scope: CallScope | None = None,
    ) -> None:
        super().__init__()
        #: The call's device and stream (None or host: nothing to order).
        self._scope = scope
        self._end: Any = None  # the event after the call's own steps (device calls)
        self._on_error = on_error
        self._watch = watch
        self._works = list(works)
        self._outputs = outputs
        self._post = post
        self._timeout_s = timeout_s
        self._desc = desc
        devices: list[Any] = scope.future_devices() if scope is not None else []
        self._source: Future[Any] = Future(devices=devices)
        self._future: Future[Any] | None = None
        self._lock = threading.Lock()
        self._settled = False
        self._error: BaseException | None = None

    # -- completion (any thread) -----------------------------------------------------
    def _settle(self, limit_s: float | None = None) -> None:
        """Wait for the ringcomm work (at most the call's timeout, or ``limit_s`` if
        shorter: expiry fails the operation), run the post step, complete the future
        (once)."""
        with self._lock:
            if self._settled:
                return
            error: BaseException | None = None
            try:
                wait_s = self._timeout_s if limit_s is None else min(limit_s, self._timeout_s)
                deadline = time.monotonic() + wait_s
                for w in self._works:
                    if isinstance(w, RingcommWork):
                        w.wait()
                    else:
                        cast(RcWork, w).wait(max(deadline - time.monotonic(), 1e-3))
                # (device calls: on the caller's stream, then an event after them)
                with self._on_stream():
                    if self._post is not None:
                        self._post()
                    if self._scope is not None:
                        self._end = self._scope.finish()
            except BaseException as exc:  # noqa: BLE001 (reported through the future)
                error = _torch_wording(exc, f"ringcomm backend: {self._desc}")
            self._error = error
            self._settled = True
        if error is not None and self._on_error is not None:
            self._on_error(error)
        with self._on_stream():  # (a CUDA future records its event on the current stream)
            self._source.set_result(self._outputs)

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return self._scope.on_stream() if self._scope is not None else contextlib.nullcontext()

    def _unwrap(self, fut: Future[Any]) -> Any:
        """The chained future's value; raises the failure (see ``get_future``)."""
        value = fut.value()
        error = self._error
        if error is not None:
            raise RuntimeError(f"ringcomm {self._desc} failed: {type(error).__name__}: {error}")
        return value

    def _ready(self) -> bool:
        """Non-blocking: are the ringcomm operations done (progress made if possible)?"""
        return all(
            w.is_completed() if isinstance(w, RingcommWork) else w.done() for w in self._works
        )

    # -- torch's Work interface ------------------------------------------------------
    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until done; raise the operation's error. ``timeout`` (torch's, a
        timedelta; zero or None: the group's) bounds the wait: on expiry the operation
        fails with ``CommTimeoutError``."""
        limit_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0
        self._settle(limit_s if limit_s > 0 else None)
        if self._error is not None:
            raise self._error
        if self._scope is not None:  # the waiter's stream waits for the result (not the host)
            self._scope.join(self._end)
        return True

    def get_future(self) -> Future[Any]:
        """The future of the output tensors. A failure is a real error of the future (its
        C++ side), so DDP's reducer raises it from ``loss.backward()``: torch's
        ``Future.set_exception`` only stores the exception as the *value* (DDP then reads
        it as tensors and crashes), while an exception raised by a ``then`` callback fails
        the chained future properly."""
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = self._source.then(self._unwrap)
            settled = self._settled
        if not settled and self._watch is not None:
            self._watch(self)  # someone must complete it without a wait(): the completer
        return self._future

    def is_completed(self) -> bool:
        """Done, and (device calls) the steps queued on the caller's stream after it too."""
        if not self._settled and self._ready():
            self._settle()
        return self._settled and (self._end is None or bool(self._end.query()))

    def is_success(self) -> bool:
        return self._settled and self._error is None

    def _source_rank(self) -> int:
        """The sender's group rank of a receive (torch's ``Work._source_rank``; what
        ``dist.recv`` without ``src`` returns). Waits for the receive first."""
        self.wait()
        for w in self._works:
            src = w._source_rank() if isinstance(w, RingcommWork) else w.source
            if src is not None:
                return int(src)
        raise RuntimeError(f"ringcomm backend: {self._desc}: not a receive, no source rank")

    source_rank = _source_rank

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def __repr__(self) -> str:
        state = "pending" if not self._settled else ("failed" if self._error else "done")
        return f"<RingcommWork {self._desc}: {state}>"


def _when_done(work: RingcommWork, fn: Callable[[], None]) -> None:
    """Call ``fn()`` once every ringcomm operation under ``work`` is done (from the thread
    that completes the last one, or here if they all are)."""
    ops: list[RcWork] = []
    stack = [work]
    while stack:
        for w in stack.pop()._works:
            if isinstance(w, RingcommWork):
                stack.append(w)
            else:
                ops.append(cast(RcWork, w))
    if not ops:
        fn()
        return
    left = [len(ops)]
    lock = threading.Lock()

    def one(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    for op in ops:
        op.add_done_callback(one)


class _Completer:
    """Completes the torch futures of one group without anyone calling ``wait()``.

    Collectives: one thread waits on them in issue order (ringcomm finishes a group's
    collectives in that order, so waiting on the oldest never holds up a younger one).
    Point-to-point work may finish in any order: each tells a second thread when it is
    done (:func:`_when_done`, ringcomm's done callbacks), which settles it.
    """

    def __init__(self, name: str) -> None:
        self._colls: collections.deque[RingcommWork | None] = collections.deque()
        self._coll_cv = threading.Condition()
        self._p2p: collections.deque[RingcommWork] = collections.deque()  # done, to settle
        self._p2p_cv = threading.Condition()
        self._closed = False
        self._coll_thread = threading.Thread(
            target=self._coll_main, name=f"ringcomm-torch-{name}", daemon=True
        )
        self._p2p_thread: threading.Thread | None = None
        self._name = name
        self._coll_thread.start()

    def add(self, work: RingcommWork, p2p: bool) -> None:
        if p2p:
            with self._p2p_cv:
                if self._p2p_thread is None:
                    self._p2p_thread = threading.Thread(
                        target=self._p2p_main, name=f"ringcomm-torch-p2p-{self._name}", daemon=True
                    )
                    self._p2p_thread.start()
            _when_done(work, lambda: self._p2p_done(work))
        else:
            with self._coll_cv:
                self._colls.append(work)
                self._coll_cv.notify()

    def _p2p_done(self, work: RingcommWork) -> None:
        """Every ringcomm operation of ``work`` is done (a done callback: no waiting)."""
        with self._p2p_cv:
            self._p2p.append(work)
            self._p2p_cv.notify()

    def _coll_main(self) -> None:
        while True:
            with self._coll_cv:
                while not self._colls:
                    self._coll_cv.wait()
                work = self._colls.popleft()
            if work is None:
                return
            work._settle()

    def _p2p_main(self) -> None:
        while True:
            with self._p2p_cv:
                while not self._p2p and not self._closed:
                    self._p2p_cv.wait()
                if self._closed:
                    return
                work = self._p2p.popleft()
            work._settle()  # (its operations are done: nothing to wait for)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._coll_cv:
            self._colls.append(None)
            self._coll_cv.notify()
        with self._p2p_cv:
            self._closed = True
            self._p2p_cv.notify()
        self._coll_thread.join(timeout_s)
        if self._p2p_thread is not None:
            self._p2p_thread.join(timeout_s)


# -- the process group --------------------------------------------------------------------
class RingcommProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on a ringcomm group (CPU tensors)."""

    def __init__(
        self,
        rc_group: RcGroup,
        timeout_s: float,
        *,
        store_server: StoreServer | None = None,
        torch_store: Any = None,
        instance: int = 0,
    ) -> None:
        super().__init__(rc_group.rank, rc_group.world_size)  # type: ignore[call-arg]
        self._rc = rc_group
        # Point-to-point collectives of ours (uneven all-to-all) use their own tag space.
        p2p = rc_group.new_group(range(rc_group.world_size))
        assert p2p is not None  # every rank is a member
        self._rc_p2p: RcGroup = p2p
        self._p2p_seq = 0
        self._monitored_seq = 0
        self._timeout_s = timeout_s
        self._store_server = store_server
        self._torch_store = torch_store
        self._closed_key = _CLOSED_KEY.format(instance)
        self._group_name = ""
        self._group_desc = ""
        self._completer = _Completer(f"r{rc_group.rank}")
        self._binding = DeviceBinding()  # this rank's device, at its first device call
        self._shut = False
        self._failure: BaseException | None = None  # the first failed operation's error

    # -- identity (torch reads these through its C++ ProcessGroup) -------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def ringcomm_group(self) -> RcGroup:
        """The ringcomm group underneath (for stats or ringcomm calls of your own)."""
        return self._rc

    def __repr__(self) -> str:
        return (
            f"<RingcommProcessGroup rank {self._rc.rank}/{self._rc.world_size} "
            f"{self._group_name!r}>"
        )

    # -- helpers ---------------------------------------------------------------------
    def _what(self, name: str) -> str:
        return f"ringcomm backend rank {self._rc.rank}: {name}"

    def _issue(
        self,
        works: Sequence[Any],
        outputs: list[torch.Tensor],
        post: _Post | None,
        desc: str,
        opts: Any = None,
        p2p: bool = False,
    ) -> RingcommWork:
        # Blocking ringcomm calls returned their results instead of a Work: nothing to wait.
        pending = [w for w in works if isinstance(w, (RcWork, RingcommWork))]
        work = RingcommWork(
            pending,
            outputs,
            post,
            _timeout_s(opts, self._timeout_s),
            desc,
            self._note_failure,
            lambda w: self._completer.add(w, p2p),
            current_call(),
        )
        if not pending:  # ran blocking (torch will wait at once): done now
            work._settle()
        return work

    def _one(self, tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"{what}: expected one tensor per call, got {len(tensors)}")
        return _check_cpu(tensors[0], what)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ringcomm (device calls: ordered after the caller's stream); note a failure
        raised at once (blocking calls) for shutdown."""
        try:
            with current_call().ordered():
                return fn(*args, **kwargs)
        except RingcommError as exc:
            error = _torch_wording(exc, self._what(getattr(fn, "__name__", "call")))
            self._note_failure(error)
            if error is exc:
                raise
            raise error from exc

    def _note_failure(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error

    def _check_usable(self, what: str) -> None:
        """First thing of every call: the group is open; the call's scope starts."""
        if self._shut:
            raise RuntimeError(f"{what}: the process group was shut down")
        start_call(what, self._binding)

    # -- reductions -------------------------------------------------------------------
    def allreduce(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> RingcommWork:
        what = self._what("allreduce")
        self._check_usable(what)
        opts = opts if opts is not None else AllreduceOptions()
        if isinstance(opts, (ReduceOp, ReduceOp.RedOpType)):  # allreduce(tensors, op)
            op, opts = opts, AllreduceOptions()
        else:
            op = opts.reduceOp
        ts = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        if len(ts) == 1 and isinstance(ts[0], torch.Tensor) and ts[0].is_sparse:
            return self._sparse_allreduce(ts[0], op, what, opts)
        t = self._one(ts, what)
        red = _Reduction(t, op, what, in_place=True)
        w = self._call(
            self._rc.all_reduce,
            red.array,
            op=red.op,
            async_op=_async(opts),
            timeout_s=_timeout_s(opts, self._timeout_s),
        )
        return self._issue([w], [t], red.copy_back if red.post else None, "allreduce", opts)

    def _sparse_allreduce(self, t: torch.Tensor, op: Any, what: str, opts: Any) -> RingcommWork:
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
        timeout_s = _timeout_s(opts, self._timeout_s)
        n = self._rc.world_size
        x = t.detach().coalesce()
        idx, vals = x.indices(), x.values().contiguous()
        nnz = int(idx.shape[1])
        meta = np.array([nnz, x.sparse_dim(), x.dense_dim(), *x.shape], dtype=np.int64)
        metas = self._call(self._rc.all_gather, meta, timeout_s=timeout_s)
        for r in range(n):
            if not np.array_equal(metas[r, 1:], meta[1:]):
                raise ValueError(
                    f"{what}: rank {r}'s sparse tensor (sparse/dense dims and shape "
                    f"{metas[r, 1:].tolist()}) does not match this rank's {meta[1:].tolist()}"
                )
        counts = [int(c) for c in metas[:, 0]]
        top = max(counts)
        g_idx = torch.zeros((n, x.sparse_dim(), top), dtype=torch.int64)
        g_vals = torch.zeros((n, top, *vals.shape[1:]), dtype=vals.dtype)
        if top > 0:
            pad_idx = torch.zeros((x.sparse_dim(), top), dtype=torch.int64)
            pad_idx[:, :nnz] = idx
            pad_vals = torch.zeros((top, *vals.shape[1:]), dtype=vals.dtype)
            pad_vals[:nnz] = vals
            self._call(self._rc.all_gather, pad_idx.numpy(), out=g_idx.numpy(), timeout_s=timeout_s)
            self._call(
                self._rc.all_gather,
                _move_view(pad_vals).reshape(-1),
                out=_move_view(g_vals).reshape(n, -1),
                timeout_s=timeout_s,
            )
        all_idx = torch.cat([g_idx[r, :, : counts[r]] for r in range(n)], dim=1)
        all_vals = torch.cat([g_vals[r, : counts[r]] for r in range(n)])
        total = torch.sparse_coo_tensor(all_idx, all_vals, x.shape).coalesce()
        with torch.no_grad():
            t.copy_(total)
        return self._issue([], [t], None, "allreduce (sparse)", opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> RingcommWork:
        """``dist.all_reduce_coalesced`` and the coalescing manager's all-reduces (any mix
        of dtypes): one ringcomm all_reduce per dtype, of the tensors' concatenation (a
        lone tensor of its dtype is reduced in place, without the copy)."""
        what = self._what("allreduce_coalesced")
        self._check_usable(what)
        opts = opts if opts is not None else AllreduceCoalescedOptions()
        reds = [
            _Reduction(_check_cpu(t, what), opts.reduceOp, what, in_place=True) for t in tensors
        ]
        timeout_s = _timeout_s(opts, self._timeout_s)
        groups: dict[tuple[torch.dtype, str], list[_Reduction]] = {}
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
            works.append(
                self._call(
                    self._rc.all_reduce, flat, op=op, async_op=_async(opts), timeout_s=timeout_s
                )
            )

        def post() -> None:
            for cat, members in unpack:
                at = 0
                for m in members:
                    k = m.flat.numel()
                    m.flat.copy_(cat[at : at + k].reshape(m.flat.shape))
                    at += k
            for r in reds:
                r.copy_back()

        return self._issue(works, list(tensors), post, "allreduce_coalesced", opts)

    def reduce(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> RingcommWork:
        what = self._what("reduce")
        self._check_usable(what)
        opts = opts if opts is not None else ReduceOptions()
        t = self._one(tensors, what)
        dst = opts.rootRank
        # Only the root's tensor is written (a pre-scaled input elsewhere is a copy).
        red = _Reduction(t, opts.reduceOp, what, in_place=self._rc.rank == dst)
        w = self._call(
            self._rc.reduce,
            red.array,
            dst=dst,
            op=red.op,
            async_op=_async(opts),
            timeout_s=_timeout_s(opts, self._timeout_s),
        )
        post = red.copy_back if red.post else None
        return self._issue([w], [t], post, "reduce", opts)

    def _reduce_scatter_into(
        self, out: torch.Tensor, inp: torch.Tensor, op: Any, what: str, opts: Any
    ) -> tuple[RcWork, _Post | None]:
        n = self._rc.world_size
        if inp.numel() != out.numel() * n:
            raise ValueError(
                f"{what}: input has {inp.numel()} elements, expected world size {n} x "
                f"output's {out.numel()}"
            )
        if inp.dtype != out.dtype:
            raise TypeError(f"{what}: input dtype {inp.dtype} != output dtype {out.dtype}")
        red = _Reduction(inp, op, what, in_place=False)
        rows = red.array.reshape(n, -1)
        o, o_copied = _contig(out)
        if out.dtype == torch.bfloat16:
            o, o_copied = torch.empty(o.shape, dtype=torch.float32, device=o.device), True
        o_arr = _reduce_view(o)
        w = self._call(
            self._rc.reduce_scatter,
            rows,
            out=o_arr.reshape(rows.shape[1:]),
            op=red.op,
            async_op=_async(opts),
            timeout_s=_timeout_s(opts, self._timeout_s),
        )
        if not o_copied:
            return w, None
        return w, lambda: out.detach().copy_(o.reshape(out.shape))

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> RingcommWork:
        what = self._what("reduce_scatter_tensor")
        self._check_usable(what)
        opts = opts if opts is not None else ReduceScatterOptions()
        out, inp = _check_cpu(output, what), _check_cpu(input, what)
        w, post = self._reduce_scatter_into(out, inp, opts.reduceOp, what, opts)
        return self._issue([w], [out], post, "reduce_scatter_tensor", opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingcommWork:
        what = self._what("reduce_scatter_tensor_coalesced")
        self._check_usable(what)
        opts = opts if opts is not None else ReduceScatterOptions()
        works, posts = [], []
        for out, inp in zip(outputs, inputs, strict=True):
            w, p = self._reduce_scatter_into(
                _check_cpu(out, what), _check_cpu(inp, what), opts.reduceOp, what, opts
            )
            works.append(w)
            if p is not None:
                posts.append(p)
        return self._issue(works, list(outputs), _run_all(posts), "reduce_scatter_coalesced", opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> RingcommWork:
        what = self._what("reduce_scatter")
        self._check_usable(what)
        opts = opts if opts is not None else ReduceScatterOptions()
        out = self._one(outputs, what)
        if len(inputs) != 1 or len(inputs[0]) != self._rc.world_size:
            raise ValueError(f"{what}: expected one list of world-size tensors as input")
        parts = [_check_cpu(p, what) for p in inputs[0]]
        for p in parts:
            if p.dtype != out.dtype:
                raise ValueError(f"{what}: every input must have the output's dtype")
        if any(p.shape != out.shape for p in parts):
            return self._reduce_scatter_uneven(out, parts, opts.reduceOp, what, opts)
        stacked = torch.stack([p.detach() for p in parts])  # one copy: a contiguous (n, ...)
        w, post = self._reduce_scatter_into(out, stacked, opts.reduceOp, what, opts)
        return self._issue([w], [out], post, "reduce_scatter", opts)

    def _reduce_scatter_uneven(
        self, out: torch.Tensor, parts: list[torch.Tensor], op: Any, what: str, opts: Any
    ) -> RingcommWork:
        """``dist.reduce_scatter`` with inputs of different sizes (input ``j`` is rank
        ``j``'s share, as large as rank ``j``'s output): ringcomm's reduce_scatter_v."""
        me = self._rc.rank
        if parts[me].numel() != out.numel():
            raise ValueError(
                f"{what}: input {me} (this rank's share) has {parts[me].numel()} elements, "
                f"the output {out.numel()}"
            )
        splits = [p.numel() for p in parts]
        flat = torch.cat([p.detach().reshape(-1) for p in parts])
        red = _Reduction(flat, op, what, in_place=False)
        rows = red.array.reshape(flat.numel(), -1)  # complex: a row is (real, imag)
        o, o_copied = _contig(out)
        if out.dtype == torch.bfloat16:
            o, o_copied = torch.empty(o.shape, dtype=torch.float32, device=o.device), True
        o_arr = _reduce_view(o)
        w = self._call(
            self._rc.reduce_scatter_v,
            rows,
            splits,
            out=o_arr.reshape(out.numel(), rows.shape[1]),
            op=red.op,
            async_op=_async(opts),
            timeout_s=_timeout_s(opts, self._timeout_s),
        )
        post = (lambda: out.detach().copy_(o.reshape(out.shape))) if o_copied else None
        return self._issue([w], [out], post, "reduce_scatter", opts)

    # -- data movement ----------------------------------------------------------------
    def broadcast(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> RingcommWork:
        what = self._what("broadcast")
        self._check_usable(what)
        opts = opts if opts is not None else BroadcastOptions()
        t = self._one(tensors, what)
        src = opts.rootRank
        c, copied = _contig(t)
        w = self._call(
            self._rc.broadcast,
            _move_view(c),
            src=src,
            async_op=_async(opts),
            timeout_s=_timeout_s(opts, self._timeout_s),
        )
        post = (lambda: t.detach().copy_(c)) if copied and self._rc.rank != src else None
        return self._issue([w], [t], post, "broadcast", opts)

    def _all_gather_into(
        self, out: torch.Tensor, inp: torch.Tensor, what: str, opts: Any
    ) -> tuple[RcWork, _Post | None]:
        n = self._rc.world_size
        if out.numel() != inp.numel() * n:
            raise ValueError(
                f"{what}: output has {out.numel()} elements, expected world size {n} x "
                f"input's {inp.numel()}"
            )
        if inp.dtype != out.dtype:
            raise TypeError(f"{what}: input dtype {inp.dtype} != output dtype {out.dtype}")
        i, _ = _contig(inp)
        o, copied = _contig(out)
        x = _move_view(i).reshape(-1)
        o_arr = _move_view(o).reshape(n, -1)
        w = self._call(
            self._rc.all_gather,
            x,
            out=o_arr,
            async_op=_async(opts),
            timeout_s=_timeout_s(opts, self._timeout_s),
        )
        return w, ((lambda: out.detach().copy_(o)) if copied else None)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> RingcommWork:
        what = self._what("all_gather_into_tensor")
        self._check_usable(what)
        opts = opts if opts is not None else AllgatherOptions()
        out, inp = _check_cpu(output, what), _check_cpu(input, what)
        w, post = self._all_gather_into(out, inp, what, opts)
        return self._issue([w], [out], post, "all_gather_into_tensor", opts)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingcommWork:
        """All-gathers into tensors (the coalescing manager's ``all_gather_into_tensor``):
        one ringcomm all_gather per dtype, of the inputs' concatenation."""
        what = self._what("allgather_into_tensor_coalesced")
        self._check_usable(what)
        opts = opts if opts is not None else AllgatherOptions()
        n = self._rc.world_size
        outs = [_check_cpu(o, what) for o in outputs]
        ins = [_check_cpu(i, what) for i in inputs]
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
                w, p = self._all_gather_into(o, i, what, opts)
                works.append(w)
                if p is not None:
                    posts.append(p)
            return self._issue(works, outs, _run_all(posts), "allgather_coalesced", opts)
        # rank r's copy of input i goes to the r-th 1/n of (contiguous) output i
        dests = [list(o.detach().view(n, -1)) for o in outs]
        works, post = self._gather_batched(ins, dests, what, opts)
        return self._issue(works, outs, post, "allgather_coalesced", opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingcommWork:
        what = self._what("allgather")
        self._check_usable(what)
        opts = opts if opts is not None else AllgatherOptions()
        inp = self._one(inputs, what)
        if len(outputs) != 1 or len(outputs[0]) != self._rc.world_size:
            raise ValueError(f"{what}: expected one list of world-size output tensors")
        outs = [_check_cpu(o, what) for o in outputs[0]]
        for o in outs:
            if o.dtype != inp.dtype:
                raise ValueError(f"{what}: every output must have the input's dtype")
        if any(o.numel() != inp.numel() for o in outs):
            return self._allgather_uneven(outs, inp, what, opts)
        gathered = torch.empty(
            (self._rc.world_size, *inp.shape), dtype=inp.dtype, device=inp.device
        )
        w, _ = self._all_gather_into(gathered, inp, what, opts)

        def post() -> None:
            for o, g in zip(outs, gathered, strict=True):
                o.detach().copy_(g.reshape(o.shape))

        return self._issue([w], outs, post, "allgather", opts)

    def _allgather_uneven(
        self, outs: list[torch.Tensor], inp: torch.Tensor, what: str, opts: Any
    ) -> RingcommWork:
        """``dist.all_gather`` into outputs of different sizes (NCCL's uneven all_gather;
        Gloo refuses it): ringcomm's all_gather_v on the bytes, each rank's count taken
        from its output tensor (ranks that disagree raise CollectiveMismatchError)."""
        me = self._rc.rank
        if outs[me].numel() != inp.numel():
            raise ValueError(
                f"{what}: output {me} (this rank's) has {outs[me].numel()} elements, the "
                f"input {inp.numel()}"
            )
        i, _ = _contig(inp)
        x = _move_view(i).reshape(-1).view(np.uint8)
        size = inp.element_size()
        sizes = [o.numel() * size for o in outs]
        gathered = torch.empty(sum(sizes), dtype=torch.uint8, device=inp.device)
        w = self._call(
            self._rc.all_gather_v,
            x,
            sizes,
            out=array_of(gathered),
            async_op=_async(opts),
            timeout_s=_timeout_s(opts, self._timeout_s),
        )

        def post() -> None:
            for o, part in zip(outs, torch.split(gathered, sizes), strict=True):
                o.detach().copy_(part.view(inp.dtype).reshape(o.shape))

        return self._issue([w], outs, post, "allgather", opts)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingcommWork:
        """``dist.all_gather_coalesced``: ``outputs[r][i]`` receives rank r's ``inputs[i]``
        (torch's layout: one list per *rank*, each as long as ``inputs``). All inputs of one
        dtype go as one ringcomm all_gather of their concatenation."""
        what = self._what("allgather_coalesced")
        self._check_usable(what)
        opts = opts if opts is not None else AllgatherOptions()
        n = self._rc.world_size
        if len(outputs) != n or any(len(outs) != len(inputs) for outs in outputs):
            raise ValueError(
                f"{what}: expected {n} output lists (one per rank) of {len(inputs)} tensors "
                f"(one per input), got {[len(outs) for outs in outputs]}"
            )
        ins = [_check_cpu(t, what) for t in inputs]
        for r, outs in enumerate(outputs):
            for i, (o, inp) in enumerate(zip(outs, ins, strict=True)):
                _check_cpu(o, what)
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise ValueError(
                        f"{what}: output [{r}][{i}] ({o.dtype}, {o.numel()} elements) does "
                        f"not match input {i} ({inp.dtype}, {inp.numel()} elements)"
                    )
        # per input i: the n tensors that receive it, in rank order
        dests = [[outputs[r][i] for r in range(n)] for i in range(len(ins))]
        works, post = self._gather_batched(ins, dests, what, opts)
        flat = [o for outs in outputs for o in outs]
        return self._issue(works, flat, post, "allgather_coalesced", opts)

    def _gather_batched(
        self,
        inputs: list[torch.Tensor],
        dests: list[list[torch.Tensor]],
        what: str,
        opts: Any,
    ) -> tuple[list[RcWork], _Post | None]:
        """All-gather ``inputs`` (one ringcomm all_gather per dtype, of the inputs'
        concatenation); the post step writes rank r's copy of input i into
        ``dests[i][r]`` (any shape with input i's element count)."""
        n = self._rc.world_size
        works: list[RcWork] = []
        steps: list[_Post] = []
        for idx in _by_dtype(inputs):
            parts = [inputs[i].detach().reshape(-1) for i in idx]
            flat = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
            gathered = torch.empty((n, flat.numel()), dtype=flat.dtype, device=flat.device)
            w, _ = self._all_gather_into(gathered, flat, what, opts)
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
        return works, _run_all(steps)

    def gather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingcommWork:
        what = self._what("gather")
        self._check_usable(what)
        opts = opts if opts is not None else GatherOptions()
        inp = self._one(inputs, what)
        dst = opts.rootRank
        i, _ = _contig(inp)
        w = self._call(
            self._rc.gather,
            _move_view(i),
            dst=dst,
            async_op=_async(opts),
            timeout_s=_timeout_s(opts, self._timeout_s),
        )
        outs: list[torch.Tensor] = []
        post = None
        if self._rc.rank == dst:
            if len(outputs) != 1 or len(outputs[0]) != self._rc.world_size:
                raise ValueError(f"{what}: the root needs one list of world-size outputs")
            outs = [_check_cpu(o, what) for o in outputs[0]]

            def post() -> None:
                got = w.wait(0.001) if isinstance(w, RcWork) else w
                for o, row in zip(outs, got, strict=True):
                    o.detach().copy_(_from_move_view(row, inp))

        return self._issue([w], outs, post, "gather", opts)

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> RingcommWork:
        what = self._what("scatter")
        self._check_usable(what)
        opts = opts if opts is not None else ScatterOptions()
        out = self._one(outputs, what)
        src = opts.rootRank
        x = None
        if self._rc.rank == src:
            if len(inputs) != 1 or len(inputs[0]) != self._rc.world_size:
                raise ValueError(f"{what}: the root needs one list of world-size inputs")
            x = _move_view(torch.stack([_check_cpu(p, what).detach() for p in inputs[0]]))
        o, copied = _contig(out)
        w = self._call(
            self._rc.scatter,
            x,
            src=src,
            out=_move_view(o),
            async_op=_async(opts),
            timeout_s=_timeout_s(opts, self._timeout_s),
        )
        post = (lambda: out.detach().copy_(o)) if copied else None
        return self._issue([w], [out], post, "scatter", opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> RingcommWork:
        what = self._what("all_to_all_single")
        self._check_usable(what)
        opts = opts if opts is not None else AllToAllOptions()
        out, inp = _check_cpu(output, what), _check_cpu(input, what)
        n = self._rc.world_size
        if inp.dtype != out.dtype:
            raise TypeError(f"{what}: input dtype {inp.dtype} != output dtype {out.dtype}")
        if not output_split_sizes and not input_split_sizes:
            if inp.shape[0] % n or out.shape != inp.shape:
                raise ValueError(
                    f"{what}: equal splits need dim 0 divisible by {n} and matching shapes"
                )
            i, _ = _contig(inp)
            o, copied = _contig(out)
            w = self._call(
                self._rc.all_to_all,
                _move_view(i).reshape(n, -1),
                out=_move_view(o).reshape(n, -1),
                async_op=_async(opts),
                timeout_s=_timeout_s(opts, self._timeout_s),
            )
            post = (lambda: out.detach().copy_(o)) if copied else None
            return self._issue([w], [out], post, "all_to_all_single", opts)
        # Uneven splits: ringcomm's all_to_all_v on rows of dim 0.
        in_rows = _splits(input_split_sizes, inp.shape[0], n, what, "input")
        out_rows = _splits(output_split_sizes, out.shape[0], n, what, "output")
        if inp.shape[1:] != out.shape[1:]:
            raise ValueError(
                f"{what}: input rows {tuple(inp.shape[1:])} and output rows "
                f"{tuple(out.shape[1:])} differ"
            )
        i, _ = _contig(inp)
        o, copied = _contig(out)
        w = self._call(
            self._rc.all_to_all_v,
            _rows_view(i),
            [b - a for a, b in in_rows],
            [b - a for a, b in out_rows],
            out=_rows_view(o),
            async_op=_async(opts),
            timeout_s=_timeout_s(opts, self._timeout_s),
        )
        post = (lambda: out.detach().copy_(o)) if copied else None
        return self._issue([w], [out], post, "all_to_all_single", opts)

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingcommWork:
        what = self._what("all_to_all")
        self._check_usable(what)
        opts = opts if opts is not None else AllToAllOptions()
        n = self._rc.world_size
        if len(outputs) != n or len(inputs) != n:
            raise ValueError(f"{what}: expected {n} input and {n} output tensors")
        ins = [_check_cpu(t, what).detach() for t in inputs]
        outs = [_check_cpu(t, what) for t in outputs]
        same = all(t.shape == ins[0].shape and t.dtype == ins[0].dtype for t in ins + outs)
        if same:
            x = torch.stack(ins)
            y = torch.empty_like(x)
            w = self._call(
                self._rc.all_to_all,
                _move_view(x).reshape(n, -1),
                out=_move_view(y).reshape(n, -1),
                async_op=_async(opts),
                timeout_s=_timeout_s(opts, self._timeout_s),
            )

            def post() -> None:
                for o, row in zip(outs, y, strict=True):
                    o.detach().copy_(row)

            return self._issue([w], outs, post, "all_to_all", opts)
        flat_in = torch.cat([t.reshape(-1) for t in ins])
        flat_out = torch.empty(
            sum(t.numel() for t in outs), dtype=outs[0].dtype, device=outs[0].device
        )
        inner = self.alltoall_base(
            flat_out, flat_in, [t.numel() for t in outs], [t.numel() for t in ins], opts
        )

        def post_uneven() -> None:
            for o, part in zip(outs, torch.split(flat_out, [t.numel() for t in outs]), strict=True):
                o.detach().copy_(part.reshape(o.shape))

        return self._issue([inner], outs, post_uneven, "all_to_all", opts)

    def barrier(self, opts: Any = None) -> RingcommWork:
        what = self._what("barrier")
        self._check_usable(what)
        opts = opts if opts is not None else BarrierOptions()
        w = self._call(
            self._rc.barrier, async_op=_async(opts), timeout_s=_timeout_s(opts, self._timeout_s)
        )
        return self._issue([w], [], None, "barrier", opts)

    def monitored_barrier(
        self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """Gloo's monitored barrier (``pg.monitored_barrier(timeout)``; torch's
        ``dist.monitored_barrier`` itself refuses every backend not named gloo): every
        other rank checks in with rank 0 and waits for its answer; rank 0 waits for each
        (in rank order, within ``timeout`` in all) and names the first rank that did not
        come (``wait_all_ranks``: all of them) in a ``RuntimeError`` worded as Gloo's."""
        what = self._what("monitored_barrier")
        self._check_usable(what)
        timeout_s = (
            timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else self._timeout_s
        )
        n, me = self._rc.world_size, self._rc.rank
        if n == 1:
            return
        self._monitored_seq += 1
        tag = _MONITORED_TAG0 + self._monitored_seq
        ms = int(timeout_s * 1000)
        wait_s = max(timeout_s, 1e-3)
        if me != 0:
            try:
                self._rc_p2p.send(np.zeros(1, np.uint8), dst=0, tag=tag, timeout_s=wait_s)
                self._rc_p2p.recv(np.zeros(1, np.uint8), src=0, tag=tag, timeout_s=wait_s)
            except RingcommError as exc:
                raise RuntimeError(
                    f"Rank {me} successfully reached monitoredBarrier, but received errors "
                    "while waiting for send/recv from rank 0. Please check rank 0 logs for "
                    f"faulty rank. ({type(exc).__name__}: {exc})"
                ) from exc
            return
        deadline = time.monotonic() + timeout_s
        works = {r: self._rc_p2p.irecv(np.zeros(1, np.uint8), src=r, tag=tag) for r in range(1, n)}
        failed: list[int] = []
        for r, w in works.items():
            left = deadline - time.monotonic()
            if left <= 0 and not w.done():
                waiting = [q for q, wq in works.items() if q >= r and not wq.done()]
                raise RuntimeError(
                    f"Rank 0 timed out in monitoredBarrier after {ms} ms; ranks not yet "
                    f"checked in: {waiting}"
                )
            try:
                w.wait(max(left, 1e-3))
            except RingcommError as exc:
                if not wait_all_ranks:
                    raise RuntimeError(
                        f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {ms} ms "
                        f"({type(exc).__name__}: {exc})"
                    ) from exc
                failed.append(r)
        if failed:
            raise RuntimeError(
                f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass "
                f"monitoredBarrier in {ms} ms"
            )
        for r in range(1, n):
            self._rc_p2p.send(np.zeros(1, np.uint8), dst=r, tag=tag, timeout_s=wait_s)

    # -- point-to-point ----------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> RingcommWork:
        what = self._what("send")
        self._check_usable(what)
        t = self._one(tensors, what)
        c, _ = _contig(t)
        w = self._call(self._rc.isend, _move_view(c), dst=dst, tag=tag)
        return self._issue([w], [t], None, f"send to {dst} tag {tag}", None, p2p=True)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> RingcommWork:
        what = self._what("recv")
        self._check_usable(what)
        t = self._one(tensors, what)
        c, copied = _contig(t)
        w = self._call(self._rc.irecv, _move_view(c), src=src, tag=tag)
        post = (lambda: t.detach().copy_(c)) if copied else None
        return self._issue([w], [t], post, f"recv from {src} tag {tag}", None, p2p=True)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> RingcommWork:
        """``dist.recv(t)`` / ``dist.irecv(t)`` without ``src``: the next message with
        ``tag`` from any rank (ringcomm's ``ANY_SOURCE``); the work's ``_source_rank()``
        is the sender's group rank (what ``dist.recv`` returns)."""
        what = self._what("recv")
        self._check_usable(what)
        t = self._one(tensors, what)
        c, copied = _contig(t)
        w = self._call(self._rc.irecv, _move_view(c), src=ANY_SOURCE, tag=tag)
        post = (lambda: t.detach().copy_(c)) if copied else None
        return self._issue([w], [t], post, f"recv from any source tag {tag}", None, p2p=True)

    # -- shutting down -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close the ringcomm group (called by ``dist.destroy_process_group``); idempotent."""
        if self._shut:
            return
        self._shut = True
        self._completer.close()
        self._rc_p2p.close()
        self._rc.close()
        store, server = self._torch_store, self._store_server
        if store is None or self._rc.world_size == 1:
            return
        closed, left = self._closed_key, self._closed_key + "/left"
        limit = datetime.timedelta(seconds=min(self._timeout_s, _CHECKOUT_MAX_S))
        try:
            # Best effort: torch's store may be gone already (its host exited).
            with contextlib.suppress(Exception):
                if int(store.add(closed, 1)) >= self._rc.world_size:
                    store.set(closed + "/all", b"1")
                if self._failure is None:
                    # Not after a failure, when a rank may be gone for good (bounded anyway).
                    if server is not None:  # keep serving until every rank is done with it
                        store.wait([closed + "/all"], limit)
                        server.close()
                        store.set(left, b"1")
                    else:
                        # Leave after rank 0: where rank 0 hosts torch's store (env://), a
                        # rank that re-initialises first would reach the old one, then lose it.
                        store.wait([left], limit)
        finally:
            if server is not None:
                server.close()

    def abort(self) -> None:
        """Shut down without waiting for the other ranks to check out."""
        self._note_failure(RuntimeError("the process group was aborted"))
        self.shutdown()

    def __del__(self) -> None:  # best effort: never leave sockets or threads behind
        if getattr(self, "_shut", True):
            return
        self._shut = True
        # try/except, not contextlib.suppress: at interpreter teardown the module's globals
        # (contextlib among them) may be None already.
        try:
            self._completer.close(0.1)
            self._rc.close()
        except Exception:  # noqa: BLE001, S110 (best effort in a finaliser)
            pass
        if self._store_server is not None:
            try:
                self._store_server.close()
            except Exception:  # noqa: BLE001, S110 (best effort in a finaliser)
                pass


def _torch_wording(error: BaseException, what: str) -> BaseException:
    """``error`` as torch reports it. torch's callers (its own test suite among them) tell a
    timeout by the words " Timed out " (Gloo: "Timed out waiting 1000ms for recv ...";
    NCCL's watchdog: "Watchdog caught collective operation timeout"): a ringcomm
    ``CommTimeoutError`` gets a new ``CommTimeoutError`` (same type, chained) whose message
    starts with torch's words and goes on with ringcomm's whole message (rank, peer, op,
    tag, the progress of each rank). Any other error is returned as it is."""
    if not isinstance(error, CommTimeoutError) or " Timed out " in str(error):
        return error
    mapped = CommTimeoutError(f"{what}: Timed out ({error})")
    mapped.__cause__ = error
    return mapped


def _run_all(posts: list[_Post]) -> _Post | None:
    if not posts:
        return None

    def run() -> None:
        for p in posts:
            p()

    return run


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, groups in order of first appearance (the
    same on every rank that passes the same dtypes in the same order)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _reduce_view(t: torch.Tensor) -> Any:
    """The array a reduction writes into contiguous ``t``: real pairs of a complex tensor."""
    return array_of(torch.view_as_real(t) if t.dtype.is_complex else t)


def _rows_view(t: torch.Tensor) -> Any:
    """:func:`_move_view` of contiguous ``t`` as rows: ``(t.shape[0], elements per row)``
    (also with no rows, so every rank agrees on the row shape)."""
    if t.dtype in _NUMPY_DTYPES or t.dtype == torch.bfloat16 or t.element_size() == 2:
        factor = 1
    elif t.dtype.is_complex:
        factor = 2
    else:
        factor = t.element_size()
    per_row = factor * int(np.prod(t.shape[1:], dtype=np.int64))
    return _move_view(t).reshape(t.shape[0], per_row)


def _from_move_view(row: Any, like: torch.Tensor) -> torch.Tensor:
    """Undo :func:`_move_view` for one gathered row (a ringcomm array) shaped like ``like``."""
    t = tensor_of(row, like)
    if like.dtype in _NUMPY_DTYPES:
        return t.reshape(like.shape)
    if like.dtype.is_complex:
        return torch.view_as_complex(t).reshape(like.shape)
    return t.reshape(-1).view(like.dtype).reshape(like.shape)


def _splits(sizes: list[int], total: int, n: int, what: str, name: str) -> list[tuple[int, int]]:
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


# -- rendezvous ---------------------------------------------------------------------------
def _bind_host(addr: str) -> str:
    """Where to listen: ``addr`` itself if it is one of ours, else every interface."""
    try:
        ip = socket.gethostbyname(addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return ip
    except OSError:
        return "0.0.0.0"


def _create(
    store: Any, rank: int, world_size: int, timeout: datetime.timedelta
) -> RingcommProcessGroup:
    """torch's creator: form a ringcomm group for this torch group (see the module doc)."""
    timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 1800.0
    label = f"ringcomm backend rank {rank}"
    if world_size == 1:
        rc_group = init_process_group(0, 1, master_port=0, timeout_s=timeout_s, env={})
        return RingcommProcessGroup(rc_group, timeout_s)
    server: StoreServer | None = None
    env = os.environ  # torch calls us without a config: the settings are the process's
    try:
        instance = (int(store.add(_JOINS_KEY, 1)) - 1) // world_size
        key = _STORE_KEY.format(instance)
        security = security_mode(env)
        token = None if security == "none" else env_token(env)
        if rank == 0:
            addr = env_master_addr(env)
            server = job_store(_bind_host(addr), 0, token, security, world_size, _GROUP_NAME,
                               world_from=f"the torch group of {world_size} ranks")  # fmt: skip
            token = server.token
            info: dict[str, Any] = {"addr": addr, "port": server.port}  # never the token
            store.set(key, json.dumps(info))
        else:
            info = json.loads(bytes(store.get(key)).decode())
        rc_group = init_process_group(
            rank,
            world_size,
            master_addr=info["addr"],
            master_port=int(info["port"]),
            token=token,
            timeout_s=timeout_s,
            host_store=False,
            env=env,
            group_name=_GROUP_NAME,  # a store of its own
        )
    except BaseException as exc:
        if server is not None:
            server.close()
        if isinstance(exc, RingcommError):
            raise RingcommError(f"{label}: forming the ringcomm group failed: {exc}") from exc
        raise
    return RingcommProcessGroup(
        rc_group, timeout_s, store_server=server, torch_store=store, instance=instance
    )


def _register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])


_register()
