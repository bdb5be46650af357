"""Staging device memory through pinned host buffers: backends, a buffer pool, stagers.

Sockets read and write host memory only, so a collective on device arrays (CuPy, or the
stand-in ``ringcomm.device.standin``) moves every byte through pinned host buffers, the
copy of piece k+1 overlapping the send of piece k. :class:`DeviceBackend` (streams, events,
async copies, kernels) has :class:`CupyBackend` and :class:`HostStandinBackend` (a *lazy*
stream: queued work runs only when an event after it is waited on, so a missing wait shows
as wrong bytes on the CPU); :class:`StagingPool` reuses and bounds the pinned buffers;
:data:`HOST_STAGER` and :class:`DeviceStager` are what algorithms reach their data through.

Invariants: a stager's stream first waits for the caller's stream; a buffer is sent only
after its copy's event, and returns to the pool only after every copy touching it and the
transport's tracker are done; an op completes only after its stream is synchronised.
Details: docs/architecture.md, section "device/staging.py".
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from ringcomm.config import DEFAULT_STAGING_MAX_BYTES, staging_max_bytes
from ringcomm.device.standin import StandinArray, set_read_barrier
from ringcomm.device.xp import cupy_or_none, is_cupy_array
from ringcomm.errors import CommTimeoutError
from ringcomm.ops import ReduceOp, finalize, reduce_into, reduce_out

__all__ = [
    "DEFAULT_MAX_STAGING_BYTES",
    "HOST_STAGER",
    "MIN_SLOT_BYTES",
    "CupyBackend",
    "DeviceBackend",
    "DeviceStager",
    "HostStager",
    "HostStandinBackend",
    "LazyStream",
    "PerDevice",
    "Slot",
    "StagingPool",
    "backend_for",
    "size_class",
]

#: Smallest staging buffer (pieces below this share one size class).
MIN_SLOT_BYTES = 64 * 1024
#: Most pinned bytes one pool keeps (beyond: wait for a buffer to come back).
DEFAULT_MAX_STAGING_BYTES = DEFAULT_STAGING_MAX_BYTES
#: How long a pool waits between looks at busy buffers.
_POLL_S = 0.00005

T = TypeVar("T")

Send = Callable[..., Any]  # (*args, payload) -> tracker or None


def size_class(nbytes: int) -> int:
    """Capacity of the staging buffer that holds ``nbytes``: a power of two >= 64 KiB."""
    cap = MIN_SLOT_BYTES
    while cap < nbytes:
        cap <<= 1
    return cap


def _u8(a: Any) -> Any:
    """Flat uint8 view of a contiguous (device or host) array."""
    return a.reshape(-1).view(np.uint8)


# -- backends --------------------------------------------------------------------------
class DeviceBackend:
    """What staging needs from a device. One instance per device, shared by all calls.

    Arrays passed in are contiguous views: ``dev`` arguments device arrays of this backend,
    ``host`` arguments NumPy arrays (pinned staging memory). Every copy and kernel is
    enqueued on ``stream`` and returns at once; ``record`` returns an event whose ``done``
    (property) and ``synchronize()`` say when everything enqueued before it finished.
    ``max_staging_bytes`` bounds its pool; None: the process's setting
    (:func:`ringcomm.config.staging_max_bytes`: ``RINGCOMM_STAGING_MAX_BYTES``, else 1 GiB).
    """

    name = "device"

    def __init__(self, max_staging_bytes: int | None = None) -> None:
        if max_staging_bytes is None:
            max_staging_bytes = staging_max_bytes()
        self.pool = StagingPool(self.alloc_pinned, max_staging_bytes)

    # streams and events
    def stream(self) -> Any:
        """The backend's staging stream (one per device, shared, in order)."""
        raise NotImplementedError

    def record(self, stream: Any) -> Any:
        raise NotImplementedError

    def caller_event(self) -> Any:
        """An event on the calling thread's current stream (None: the caller's work is
        synchronous). Taken at the call, waited for by the staging stream at start."""
        raise NotImplementedError

    def wait_event(self, stream: Any, event: Any) -> None:
        raise NotImplementedError

    def synchronize(self, stream: Any) -> None:
        raise NotImplementedError

    # memory
    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        raise NotImplementedError

    def empty(self, nbytes: int) -> Any:
        """Device scratch of ``nbytes`` bytes (uint8)."""
        raise NotImplementedError

    def d2h(self, stream: Any, host: np.ndarray, dev: Any) -> None:
        raise NotImplementedError

    def h2d(self, stream: Any, dev: Any, host: np.ndarray) -> None:
        raise NotImplementedError

    def d2d(self, stream: Any, dst: Any, src: Any) -> None:
        raise NotImplementedError

    # kernels (ringcomm.ops semantics, on the device)
    def reduce_into(self, stream: Any, op: ReduceOp, acc: Any, incoming: Any) -> None:
        raise NotImplementedError

    def reduce_out(self, stream: Any, op: ReduceOp, a: Any, b: Any, out: Any) -> None:
        raise NotImplementedError

    def finalize(self, stream: Any, op: ReduceOp, acc: Any, world_size: int) -> None:
        raise NotImplementedError

    def may_share_memory(self, a: Any, b: Any) -> bool:
        raise NotImplementedError

    def same_memory(self, a: Any, b: Any) -> bool:
        raise NotImplementedError


class _LazyStream:
    """The stand-in's stream: queued functions run in order, only when waited for."""

    __slots__ = ("done_count", "lock", "queue", "queued")

    def __init__(self) -> None:
        self.queue: collections.deque[Callable[[], None]] = collections.deque()
        self.queued = 0
        self.done_count = 0
        self.lock = threading.RLock()

    def enqueue(self, fn: Callable[[], None]) -> None:
        with self.lock:
            self.queue.append(fn)
            self.queued += 1

    def run_one(self) -> None:
        with self.lock:
            if self.queue:
                fn = self.queue.popleft()
                self.done_count += 1
                fn()

    def run_until(self, mark: int) -> None:
        with self.lock:
            while self.done_count < mark and self.queue:
                self.run_one()

    def synchronize(self) -> None:
        self.run_until(self.queued)


#: The stand-in's stream, for other stand-in devices (ringcomm.device.ipc: its own stream,
#: apart from staging's, as a GPU runs a caller's stream and a staging stream side by side).
LazyStream = _LazyStream


class _LazyEvent:
    """Done once its stream ran everything queued before it. Asking ``done`` while it is
    not lets the stream make one step (so polling loops progress, but a single look
    right after the copy was enqueued says "not yet", as a GPU would)."""

    __slots__ = ("mark", "stream")

    def __init__(self, stream: _LazyStream | None, mark: int) -> None:
        self.stream = stream
        self.mark = mark

    @property
    def done(self) -> bool:
        stream = self.stream
        if stream is None or stream.done_count >= self.mark:
            return True
        stream.run_one()
        return False

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.mark)


class HostStandinBackend(DeviceBackend):
    """NumPy arrays (inside :class:`~ringcomm.device.standin.StandinArray`) as device memory.

    Copies are real ``numpy.copyto`` copies through the same staging buffers, and kernels
    the same ``ringcomm.ops`` calls, but run by a lazy stream (see the module docstring).
    """

    name = "host-standin"

    def __init__(self, max_staging_bytes: int | None = None) -> None:
        super().__init__(max_staging_bytes)
        self._stream = _LazyStream()

    def stream(self) -> _LazyStream:
        return self._stream

    def record(self, stream: _LazyStream) -> _LazyEvent:
        return _LazyEvent(stream, stream.queued)

    def caller_event(self) -> None:
        return None  # the stand-in's users write their arrays synchronously (NumPy)

    def wait_event(self, stream: _LazyStream, event: Any) -> None:
        if event is not None:
            stream.enqueue(event.synchronize)

    def synchronize(self, stream: _LazyStream) -> None:
        stream.synchronize()

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def empty(self, nbytes: int) -> StandinArray:
        return StandinArray(np.empty(nbytes, np.uint8))

    def d2h(self, stream: _LazyStream, host: np.ndarray, dev: StandinArray) -> None:
        src = dev.host
        stream.enqueue(lambda: np.copyto(host, src))

    def h2d(self, stream: _LazyStream, dev: StandinArray, host: np.ndarray) -> None:
        dst = dev.host
        stream.enqueue(lambda: np.copyto(dst, host))

    def d2d(self, stream: _LazyStream, dst: StandinArray, src: StandinArray) -> None:
        d, s = dst.host, src.host
        stream.enqueue(lambda: np.copyto(d, s))

    def reduce_into(self, stream: _LazyStream, op: ReduceOp, acc: Any, incoming: Any) -> None:
        a, b = acc.host, incoming.host
        stream.enqueue(lambda: reduce_into(op, a, b))

    def reduce_out(self, stream: _LazyStream, op: ReduceOp, a: Any, b: Any, out: Any) -> None:
        x, y, o = a.host, b.host, out.host
        stream.enqueue(lambda: reduce_out(op, x, y, o))

    def finalize(self, stream: _LazyStream, op: ReduceOp, acc: Any, world_size: int) -> None:
        a = acc.host
        stream.enqueue(lambda: finalize(op, a, world_size))

    def may_share_memory(self, a: Any, b: Any) -> bool:
        return bool(np.may_share_memory(a.host, b.host))

    def same_memory(self, a: Any, b: Any) -> bool:
        ha, hb = a.host, b.host
        return bool(
            ha.__array_interface__["data"][0] == hb.__array_interface__["data"][0]
            and ha.nbytes == hb.nbytes
        )


class CupyBackend(DeviceBackend):
    """CuPy on one device: a non-blocking staging stream, events, pinned host memory.

    Copies are ``MemoryPointer.copy_to_host_async``/``copy_from_host_async``/
    ``copy_from_device_async`` on the staging stream; kernels are CuPy ufuncs with
    ``out=`` run with the staging stream current; pinned buffers come from
    ``cupy.cuda.alloc_pinned_memory`` (what ``cupyx.empty_pinned`` uses).
    """

    name = "cupy"

    def __init__(self, cp: Any, device_id: int, max_staging_bytes: int | None = None) -> None:
        self.cp = cp
        self.device = cp.cuda.Device(device_id)
        with self.device:
            self._stream = cp.cuda.Stream(non_blocking=True)
        super().__init__(max_staging_bytes)

    def stream(self) -> Any:
        return self._stream

    def record(self, stream: Any) -> Any:
        event = self.cp.cuda.Event(block=False, disable_timing=True)
        with self.device:
            event.record(stream)
        return event

    def caller_event(self) -> Any:
        with self.device:
            return self.record(self.cp.cuda.get_current_stream())

    def wait_event(self, stream: Any, event: Any) -> None:
        if event is not None:
            with self.device:
                stream.wait_event(event)

    def synchronize(self, stream: Any) -> None:
        with self.device:
            stream.synchronize()

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cp.cuda.alloc_pinned_memory(nbytes)
        return np.ndarray((nbytes,), np.uint8, mem)

    def empty(self, nbytes: int) -> Any:
        with self.device, self._stream:  # from the pool's arena of our stream
            return self.cp.empty(nbytes, self.cp.uint8)

    def d2h(self, stream: Any, host: np.ndarray, dev: Any) -> None:
        if host.nbytes == 0:
            return
        with self.device:
            dev.data.copy_to_host_async(ctypes.c_void_p(host.ctypes.data), host.nbytes, stream)

    def h2d(self, stream: Any, dev: Any, host: np.ndarray) -> None:
        if host.nbytes == 0:
            return
        with self.device:
            dev.data.copy_from_host_async(ctypes.c_void_p(host.ctypes.data), host.nbytes, stream)

    def d2d(self, stream: Any, dst: Any, src: Any) -> None:
        if src.nbytes == 0:
            return
        with self.device:
            dst.data.copy_from_device_async(src.data, src.nbytes, stream)

    def reduce_into(self, stream: Any, op: ReduceOp, acc: Any, incoming: Any) -> None:
        with self.device, stream:
            reduce_into(op, acc, incoming)

    def reduce_out(self, stream: Any, op: ReduceOp, a: Any, b: Any, out: Any) -> None:
        with self.device, stream:
            reduce_out(op, a, b, out)

    def finalize(self, stream: Any, op: ReduceOp, acc: Any, world_size: int) -> None:
        with self.device, stream:
            finalize(op, acc, world_size)

    def may_share_memory(self, a: Any, b: Any) -> bool:
        return bool(self.cp.may_share_memory(a, b))

    def same_memory(self, a: Any, b: Any) -> bool:
        return bool(a.data.ptr == b.data.ptr and a.nbytes == b.nbytes)


class PerDevice(Generic[T]):
    """One object per device, made on first use and kept for the process.

    The device of an array is the stand-in (``StandinArray``) or a CuPy device (by id);
    ``make_standin()`` or ``make_cupy(cupy, device_id)`` makes its object, once, under a lock.
    """

    def __init__(self, make_standin: Callable[[], T], make_cupy: Callable[[Any, int], T]) -> None:
        self.make_standin = make_standin
        self.make_cupy = make_cupy
        self._objects: dict[Any, T] = {}
        self._lock = threading.Lock()

    def of(self, x: Any) -> T:
        """The object of device array ``x``'s device; TypeError for other arrays."""
        if isinstance(x, StandinArray):
            key: Any = "standin"
        elif is_cupy_array(x):
            key = ("cupy", int(x.device.id))
        else:
            raise TypeError(f"not a device array: {type(x).__name__}")
        obj = self._objects.get(key)
        if obj is None:
            with self._lock:
                obj = self._objects.get(key)
                if obj is None:
                    obj = self._make(key)
                    self._objects[key] = obj
        return obj

    def _make(self, key: Any) -> T:
        if key == "standin":
            return self.make_standin()
        cp = cupy_or_none()
        assert cp is not None  # the array is a cupy array
        return self.make_cupy(cp, key[1])


def _standin_backend() -> DeviceBackend:
    backend = HostStandinBackend()
    # the process's stand-in stream: get() reads after the work queued on it
    set_read_barrier(backend.stream().synchronize)
    return backend


_BACKENDS: PerDevice[DeviceBackend] = PerDevice(_standin_backend, CupyBackend)


def backend_for(x: Any) -> DeviceBackend:
    """The (process-wide, cached) backend of device array ``x``; TypeError for others."""
    return _BACKENDS.of(x)


# -- the pool --------------------------------------------------------------------------
class Slot:
    """One pinned staging buffer (``buf``: uint8, ``capacity`` bytes)."""

    __slots__ = ("buf", "capacity", "waits")

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.capacity = buf.nbytes
        self.waits: tuple[Any, ...] = ()


class StagingPool:
    """Pinned staging buffers, reused across calls (never reallocated per call).

    ``acquire(nbytes)`` hands out a buffer of at least ``nbytes``; ``release(slot, *waits)``
    gives it back, to be handed out again only once every ``wait`` (CUDA events of copies
    that read or write it, libzmq trackers of sends from it) is done. Above ``max_bytes``
    allocated, ``acquire`` waits for a buffer to come back (bounded by its deadline; the
    waits complete on their own: the GPU, and libzmq's I/O thread, which never waits on
    us). Thread-safe.
    """

    def __init__(self, alloc: Callable[[int], np.ndarray], max_bytes: int) -> None:
        self._alloc = alloc
        self.max_bytes = max_bytes
        self._free: dict[int, list[Slot]] = {}
        self._retiring: list[Slot] = []
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.allocations = 0  # buffers ever allocated
        self.acquires = 0
        self.waited = 0  # acquires that had to wait for a busy buffer

    @property
    def busy_count(self) -> int:
        """Buffers released but still waiting on a copy or a send."""
        return len(self._retiring)

    def _reclaim(self) -> None:
        still = []
        for slot in self._retiring:
            if all(w.done for w in slot.waits):
                slot.waits = ()
                self._free.setdefault(slot.capacity, []).append(slot)
            else:
                still.append(slot)
        self._retiring = still

    def try_acquire(self, nbytes: int) -> Slot | None:
        """A buffer of at least ``nbytes`` if one is free or may be allocated, else None."""
        cap = size_class(nbytes)
        with self._lock:
            if self._retiring:
                self._reclaim()
            free = self._free.get(cap)
            if free:
                self.acquires += 1
                return free.pop()
            if self.allocated_bytes + cap > self.max_bytes and self.allocated_bytes:
                # Trade free buffers of other sizes in rather than exceed the bound.
                for other, slots in self._free.items():
                    while slots and self.allocated_bytes + cap > self.max_bytes:
                        slots.pop()
                        self.allocated_bytes -= other
                if self.allocated_bytes + cap > self.max_bytes and self.allocated_bytes:
                    return None
            self.allocated_bytes += cap
            self.allocations += 1
            self.acquires += 1
            return Slot(self._alloc(cap))

    def acquire(self, nbytes: int, deadline: float, what: str = "staging") -> Slot:
        """A buffer of at least ``nbytes``, waiting (until ``deadline``, a
        ``time.monotonic()`` instant) for one to come back if the pool is at its bound."""
        slot = self.try_acquire(nbytes)
        if slot is not None:
            return slot
        self.waited += 1
        while True:
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"{what}: no staging buffer of {size_class(nbytes)} bytes came back in "
                    f"time ({len(self._retiring)} busy, {self.allocated_bytes} of "
                    f"{self.max_bytes} bytes allocated)"
                )
            time.sleep(_POLL_S)
            slot = self.try_acquire(nbytes)
            if slot is not None:
                return slot

    def release(self, slot: Slot, *waits: Any) -> None:
        pending = tuple(w for w in waits if w is not None)  # looked at again in acquire
        with self._lock:
            if pending:
                slot.waits = pending
                self._retiring.append(slot)
            else:
                self._free.setdefault(slot.capacity, []).append(slot)


# -- stagers: the buffer interface of the algorithms ------------------------------------
class HostStager:
    """NumPy arrays: nothing is staged. Sends go zero-copy from the array itself,
    incoming pieces are reduced or copied straight from the received frame (today's hot
    path, one method call per piece). Stateless: :data:`HOST_STAGER` serves every call."""

    staged = False

    @staticmethod
    def bytes_of(a: np.ndarray) -> memoryview:
        """The flat bytes of ``a`` that :meth:`send` takes slices of (a memoryview)."""
        return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]

    def send(self, src: memoryview, send: Send, *args: Any) -> Any:
        """``send(*args, src)`` now (``src``: a slice of :meth:`bytes_of`); its tracker."""
        return send(*args, src)

    def forward(self, src: memoryview, payload: Any, send: Send, *args: Any) -> Any:
        """Send on a piece just copied into ``src`` (from the array, zero-copy)."""
        return send(*args, src)

    def pump(self, keep: int = 0) -> None:
        """(Nothing is ever queued.)"""

    def reduce_into(self, op: ReduceOp, acc: np.ndarray, payload: Any) -> None:
        reduce_into(op, acc, np.frombuffer(payload, acc.dtype))

    def reduce_out(self, op: ReduceOp, a: np.ndarray, payload: Any, out: np.ndarray) -> None:
        reduce_out(op, a, np.frombuffer(payload, a.dtype), out)

    def copy_in(self, dst: np.ndarray, payload: Any) -> None:
        dst[...] = np.frombuffer(payload, dst.dtype).reshape(dst.shape)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src

    def finalize(self, op: ReduceOp, acc: np.ndarray, world_size: int) -> None:
        finalize(op, acc, world_size)

    def sync(self) -> None:
        """(Everything happened on the call.)"""

    def abandon(self) -> None:
        """(Nothing to give back.)"""


HOST_STAGER = HostStager()


class DeviceStager:
    """The staged path of one call on device arrays (see the module docstring).

    Sends are queued in order (one FIFO per call, so pieces leave in the order the
    algorithm asked for them, which the receiving inboxes rely on): :meth:`send` enqueues
    the device->host copy and queues the piece; :meth:`forward` queues a received payload
    as is (its bytes are the piece: no copy back from the device); :meth:`pump` sends
    queued pieces, waiting for each one's copy, keeping the newest ``keep`` queued so the
    caller can receive the next piece while their copies run. An algorithm pumps with
    ``keep=0`` after the last piece of every message, so no message waits on a later one.
    """

    staged = True

    def __init__(
        self, backend: DeviceBackend, ready_event: Any, deadline: float, what: str
    ) -> None:
        self.backend = backend
        self.pool = backend.pool
        self.stream = backend.stream()
        self.deadline = deadline
        self.what = what
        self._queue: collections.deque[tuple[Slot | None, Any, Any, Send, tuple[Any, ...]]] = (
            collections.deque()
        )
        self._scratch: Any = None
        # Nothing we enqueue may read the caller's arrays before their producer finished.
        backend.wait_event(self.stream, ready_event)

    # -- sending -------------------------------------------------------------------------
    def acquire(self, nbytes: int) -> Slot:
        """A staging slot of at least ``nbytes`` from the pool, waiting for one until the
        call's deadline; the caller releases it (``pool.release``)."""
        return self.pool.acquire(nbytes, self.deadline, self.what)

    _acquire = acquire  # (the name collectives/staged.py still uses)

    @staticmethod
    def bytes_of(a: Any) -> Any:
        """The flat bytes of device array ``a`` (a uint8 device view) :meth:`send` slices."""
        return _u8(a)

    def send(self, src: Any, send: Send, *args: Any) -> None:
        """Queue ``send(*args, staged copy of src)``; ``src`` a slice of :meth:`bytes_of`."""
        nbytes = src.nbytes
        slot = self.pool.try_acquire(nbytes)
        if slot is None:  # the pool is at its bound: send what is queued, then wait
            self.pump(0)
            slot = self.acquire(nbytes)
        host = slot.buf[:nbytes]
        self.backend.d2h(self.stream, host, _u8(src))
        self._queue.append((slot, self.backend.record(self.stream), host, send, args))

    def forward(self, src: Any, payload: Any, send: Send, *args: Any) -> None:
        """Queue ``send(*args, payload)``: the received bytes themselves, no device copy."""
        self._queue.append((None, None, payload, send, args))

    def pump(self, keep: int = 0) -> None:
        queue, pool = self._queue, self.pool
        while len(queue) > keep:
            slot, event, payload, send, args = queue.popleft()
            if event is not None:
                event.synchronize()  # the copy into the staging buffer is finished
            try:
                tracker = send(*args, memoryview(payload))
            except BaseException:
                if slot is not None:
                    pool.release(slot)
                raise
            if slot is not None:
                pool.release(slot, tracker)  # back once libzmq let go of it

    # -- receiving -----------------------------------------------------------------------
    def _stage_in(self, payload: Any) -> tuple[Slot, np.ndarray]:
        nbytes = len(payload)
        slot = self.acquire(nbytes)
        host = slot.buf[:nbytes]
        host[...] = np.frombuffer(payload, np.uint8)
        return slot, host

    def _upload(self, dev_u8: Any, payload: Any) -> None:
        slot, host = self._stage_in(payload)
        self.backend.h2d(self.stream, dev_u8, host)
        self.pool.release(slot, self.backend.record(self.stream))

    def _scratch_for(self, nbytes: int, dtype: Any) -> Any:
        # One scratch buffer per call: everything runs on one stream, so the upload of
        # piece k+1 into it is ordered after the kernel that read piece k.
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = self.backend.empty(max(nbytes, MIN_SLOT_BYTES))
        return self._scratch[:nbytes]

    def reduce_into(self, op: ReduceOp, acc: Any, payload: Any) -> None:
        scratch = self._scratch_for(len(payload), acc.dtype)
        self._upload(scratch, payload)
        self.backend.reduce_into(self.stream, op, acc, scratch.view(acc.dtype))

    def reduce_out(self, op: ReduceOp, a: Any, payload: Any, out: Any) -> None:
        scratch = self._scratch_for(len(payload), a.dtype)
        self._upload(scratch, payload)
        self.backend.reduce_out(self.stream, op, a, scratch.view(a.dtype), out)

    def copy_in(self, dst: Any, payload: Any) -> None:
        self._upload(_u8(dst), payload)

    def copy(self, dst: Any, src: Any) -> None:
        self.backend.d2d(self.stream, _u8(dst), _u8(src))

    def finalize(self, op: ReduceOp, acc: Any, world_size: int) -> None:
        if op is ReduceOp.AVG:
            self.backend.finalize(self.stream, op, acc, world_size)

    # -- whole buffers (rooted and small collectives, p2p receive) -----------------------
    def to_host(self, dev: Any) -> tuple[Slot, np.ndarray]:
        """A pinned host copy of all of ``dev`` (waited for); the caller releases the slot."""
        nbytes = dev.nbytes
        slot = self.acquire(nbytes)
        host = slot.buf[:nbytes]
        self.backend.d2h(self.stream, host, _u8(dev))
        self.backend.record(self.stream).synchronize()
        return slot, host

    def upload(self, dev: Any, host: np.ndarray) -> Any:
        """Enqueue ``host`` -> ``dev`` (same nbytes); return the event after it."""
        self.backend.h2d(self.stream, _u8(dev), host.reshape(-1).view(np.uint8))
        return self.backend.record(self.stream)

    # -- completion ----------------------------------------------------------------------
    def sync(self) -> None:
        """Everything sent and every write into the caller's arrays finished."""
        self.pump(0)
        self.backend.synchronize(self.stream)

    def abandon(self) -> None:
        """The call failed: give queued staging buffers back (once their copies finish)."""
        while self._queue:
            slot, event, _, _, _ = self._queue.popleft()
            if slot is not None:
                self.pool.release(slot, event)
