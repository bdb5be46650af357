"""Device windows: device memory every rank of a host can read, over CUDA IPC or its stand-in.

A *window* is a block of device memory one rank allocates and exports as a *handle* plus an
*offset* (the handle names the base of its allocation, as CUDA's does); peers open it once
and keep it in a :class:`HandleCache`. Each rank also exports *interprocess events*, which a
peer's stream waits for (``streamWaitEvent``), so ordering between ranks stays on the GPU.
:class:`IpcDevice` is what the collectives (:mod:`ringcomm.collectives.ipc`) need of a
device; :class:`CupyIpcDevice` does it with CUDA, :class:`StandinIpcDevice` on the host
(``memfd`` segments, windows at non-zero offsets, the stand-in's lazy stream, so a missing
wait or offset shows as wrong bytes on the CPU).

Invariant: :meth:`IpcDevice.complete` returns only once the stream ran everything enqueued
so far, checking ``watch`` (deadline, peer liveness) between looks. Details:
docs/architecture.md, section "device/ipc.py".
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringcomm.device.staging import LazyStream, PerDevice
from ringcomm.device.standin import StandinArray
from ringcomm.ops import ReduceOp, finalize, reduce_in_order, reduce_ufunc
from ringcomm.transport.workspace import open_segment

__all__ = [
    "EVENT_SLOTS",
    "STANDIN_GUARD_BYTES",
    "CupyIpcDevice",
    "HandleCache",
    "IpcDevice",
    "LocalWindow",
    "StandinIpcDevice",
    "ipc_device_for",
]

#: Where a stand-in window starts in its segment: never at the base, so a peer that forgot
#: the offset reads the wrong bytes.
STANDIN_GUARD_BYTES = 4096
#: Interprocess events in one stand-in event segment (two 8-byte words each).
EVENT_SLOTS = 256
#: How long a completion or event wait spins (yielding) before it sleeps between looks.
_SPIN_S = 1e-3
#: cudaErrorNotReady: what cudaEventQuery says while the work before the event runs.
_CUDA_NOT_READY = 600
_SLEEP_S = 5e-5
#: Longest a waiter goes between two calls of its ``watch``.
_WATCH_EVERY_S = 2e-3

Watch = Callable[[], None]


def poll_until(ready: Callable[[], bool], watch: Watch) -> None:
    """Return once ``ready()``; spin (yielding the core) for a while, then sleep briefly
    between looks, calling ``watch()`` (it raises to give up) at least every few ms."""
    if ready():
        return
    start = time.perf_counter()
    next_watch = start + _WATCH_EVERY_S
    while True:
        now = time.perf_counter()
        if now - start < _SPIN_S:
            os.sched_yield()
        else:
            time.sleep(_SLEEP_S)
        if ready():
            return
        if now >= next_watch:
            watch()
            next_watch = time.perf_counter() + _WATCH_EVERY_S


# -- the cache of opened handles -------------------------------------------------------------
class HandleCache:
    """Peers' allocations opened by this process, one mapping per handle, counted.

    ``open(handle, size)`` maps the allocation a handle names once (``opener(handle,
    size)`` returns the mapping: a device array of ``size`` bytes over it) and counts a
    reference; windows are views at their offsets. ``release(handle)`` drops one; the
    mapping is closed (``closer(mapping)``) when none is left. ``drop(handle)`` closes it
    whatever the count (its owner failed: no one may use it again). Thread-safe.
    """

    def __init__(self, opener: Callable[[bytes, int], Any], closer: Callable[[Any], None]) -> None:
        self._opener = opener
        self._closer = closer
        self._maps: dict[bytes, list[Any]] = {}  # handle -> [mapping, references, size]
        self._lock = threading.Lock()
        self.opens = 0
        self.closes = 0
        self.hits = 0

    def open(self, handle: bytes, size: int) -> Any:
        """The mapping of ``handle`` (an allocation of ``size`` bytes), one more reference."""
        with self._lock:
            entry = self._maps.get(handle)
            if entry is not None:
                if entry[2] < size:
                    raise ValueError(
                        f"a handle opened before as {entry[2]} bytes is now said to be {size}"
                    )
                entry[1] += 1
                self.hits += 1
                return entry[0]
            mapping = self._opener(handle, size)
            self._maps[handle] = [mapping, 1, size]
            self.opens += 1
            return mapping

    def release(self, handle: bytes) -> None:
        """One reference fewer; the mapping is closed with the last."""
        with self._lock:
            entry = self._maps.get(handle)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._maps[handle]
        self._close(entry[0])

    def drop(self, handle: bytes) -> None:
        """Close the mapping of ``handle`` now, whatever its references (its owner failed)."""
        with self._lock:
            entry = self._maps.pop(handle, None)
        if entry is not None:
            self._close(entry[0])

    def _close(self, mapping: Any) -> None:
        self.closes += 1
        with contextlib.suppress(Exception):  # best effort: a mapping may already be gone
            self._closer(mapping)

    def __contains__(self, handle: bytes) -> bool:
        return handle in self._maps

    def __len__(self) -> int:
        return len(self._maps)

    def references(self, handle: bytes) -> int:
        entry = self._maps.get(handle)
        return 0 if entry is None else int(entry[1])


class LocalWindow:
    """This rank's window: ``buf`` (a uint8 device array of ``nbytes``), exported as
    ``handle`` + ``offset`` (the allocation holding it is ``size`` bytes)."""

    __slots__ = ("buf", "handle", "keep", "nbytes", "offset", "size")

    def __init__(self, buf: Any, handle: bytes, offset: int, size: int, keep: Any) -> None:
        self.buf = buf
        self.handle = handle
        self.offset = offset
        self.size = size
        self.nbytes = int(buf.nbytes)
        self.keep = keep  # what keeps the allocation alive (freed with the window)


# -- the device interface -----------------------------------------------------------------
class IpcDevice:
    """What window collectives need of a device (one instance per process and device).

    ``kind`` names the implementation (``"cupy"``, ``"standin"``) and ``identity`` the
    physical device, the same string in every process of the host that uses it (ranks
    with equal identities share a GPU). Streams are the caller's; every copy and kernel is
    enqueued on the stream passed and returns at once. Arrays are contiguous views.
    """

    kind = "device"
    identity = ""
    #: Whether the host reads this device's arrays without a stream (the stand-in: its
    #: "device memory" is host memory that code may read directly): then every call
    #: finishes its stream's work before it returns.
    host_reads = False

    def __init__(self) -> None:
        self.cache = HandleCache(self._open_mapping, self._close_mapping)
        self._pinned: np.ndarray | None = None
        #: Collective calls this process ran on this device's windows (all groups).
        self.calls = 0

    # streams and events
    def caller_stream(self) -> Any:
        """The calling thread's current stream (captured at the call)."""
        raise NotImplementedError

    def new_event(self) -> tuple[Any, bytes]:
        """A new interprocess event and its handle."""
        raise NotImplementedError

    def open_event(self, handle: bytes) -> Any:
        raise NotImplementedError

    def close_event(self, event: Any, mine: bool) -> None:
        raise NotImplementedError

    def record(self, stream: Any, event: Any) -> None:
        raise NotImplementedError

    def wait(self, stream: Any, event: Any, watch: Watch) -> Any:
        """Make ``stream`` wait (on the device) for ``event``'s latest record, made by its
        owner before it said so on the host; return a mark for :meth:`event_done`.
        ``watch`` is for the stand-in's emulation."""
        raise NotImplementedError

    def event_done(self, event: Any, mark: Any) -> bool:
        """Whether the record a :meth:`wait` returned ``mark`` for has run (now)."""
        raise NotImplementedError

    def complete(self, stream: Any, watch: Watch) -> None:
        """Return once ``stream`` ran everything enqueued on it so far; ``watch()`` runs
        between looks (it raises to give up: deadline, a failed peer)."""
        raise NotImplementedError

    def abandon(self, stream: Any) -> None:
        """A call failed: what it enqueued need not run (the stand-in drops it)."""

    def quiet(self, stream: Any) -> bool:
        """Whether ``stream`` (None: no stream) has nothing left to run, now."""
        return True

    # memory
    def alloc_window(self, nbytes: int) -> LocalWindow:
        raise NotImplementedError

    def free_window(self, window: LocalWindow) -> None:
        raise NotImplementedError

    def map_window(self, handle: bytes, offset: int, nbytes: int, size: int) -> Any:
        """A peer's window: ``nbytes`` at ``offset`` of the allocation ``handle`` names
        (``size`` bytes), opened once per handle (:attr:`cache`)."""
        mapping = self.cache.open(handle, size)
        return mapping[offset : offset + nbytes]

    def unmap_window(self, handle: bytes, failed: bool = False) -> None:
        if failed:
            self.cache.drop(handle)
        else:
            self.cache.release(handle)

    def _open_mapping(self, handle: bytes, size: int) -> Any:
        raise NotImplementedError

    def _close_mapping(self, mapping: Any) -> None:
        raise NotImplementedError

    def pinned(self, nbytes: int) -> np.ndarray:
        """A reused pinned host buffer of at least ``nbytes`` (grows, never shrinks)."""
        buf = self._pinned
        if buf is None or buf.nbytes < nbytes:
            buf = self._pinned = self.alloc_pinned(
                max(nbytes, 4096, 0 if buf is None else 2 * buf.nbytes)
            )
        return buf[:nbytes]

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        raise NotImplementedError

    # copies and kernels, on a stream
    def copy(self, stream: Any, dst: Any, src: Any) -> None:
        """``dst <- src`` (device arrays of the same bytes, either may be a peer's)."""
        raise NotImplementedError

    def d2h(self, stream: Any, host: np.ndarray, dev: Any) -> None:
        raise NotImplementedError

    def h2d(self, stream: Any, dev: Any, host: np.ndarray) -> None:
        raise NotImplementedError

    def reduce(self, stream: Any, op: ReduceOp, srcs: Sequence[Any], out: Any) -> None:
        """``out <- ((srcs[0] op srcs[1]) op ...)`` (``ringcomm.ops`` semantics); ``out`` may
        be ``srcs[0]`` or ``srcs[1]``; one source: a copy."""
        raise NotImplementedError

    def finalize(self, stream: Any, op: ReduceOp, acc: Any, world_size: int) -> None:
        raise NotImplementedError


def _u8(a: Any) -> Any:
    return a.reshape(-1).view(np.uint8)


# -- the stand-in -----------------------------------------------------------------------------
class _EventPage:
    """A memfd of :data:`EVENT_SLOTS` stand-in events: words ``2i`` (records made, by the
    owner's host) and ``2i + 1`` (records done, by the owner's stream)."""

    def __init__(self, fd: int, owner: bool) -> None:
        self.fd = fd if owner else -1
        self._map = mmap.mmap(fd, EVENT_SLOTS * 16)
        if not owner:
            os.close(fd)
        self.words = memoryview(self._map).cast("Q")
        self.used = 0

    def close(self) -> None:
        self.words.release()
        with contextlib.suppress(BufferError):
            self._map.close()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)


class StandinEvent:
    """One stand-in interprocess event (slot ``index`` of an event page)."""

    __slots__ = ("index", "page")

    def __init__(self, page: _EventPage, index: int) -> None:
        self.page = page
        self.index = index

    @property
    def recorded(self) -> int:
        return int(self.page.words[2 * self.index])

    @property
    def completed(self) -> int:
        return int(self.page.words[2 * self.index + 1])


class StandinIpcDevice(IpcDevice):
    """Windows in memfd segments and events in shared words, on the stand-in's lazy
    stream (module docstring). Handles are ``b"standin-mem:<pid>:<fd>:<size>"`` and
    ``b"standin-event:<pid>:<fd>:<slot>"``; peers open them through ``/proc``."""

    kind = "standin"
    identity = "standin"
    host_reads = True

    def __init__(self) -> None:
        super().__init__()
        # Its own stream, apart from the staging path's (a GPU runs both side by side: one
        # stream here would serialise an asynchronous staged call behind a window wait).
        self._stream = LazyStream()
        self._events: _EventPage | None = None
        self._free_slots: list[int] = []
        self._peer_pages: dict[tuple[int, int], _EventPage] = {}
        self._lock = threading.Lock()

    def caller_stream(self) -> Any:
        return self._stream

    # events
    def new_event(self) -> tuple[StandinEvent, bytes]:
        with self._lock:
            if self._events is None:
                fd = os.memfd_create("ringcomm-standin-events", os.MFD_CLOEXEC)
                os.ftruncate(fd, EVENT_SLOTS * 16)
                self._events = _EventPage(fd, owner=True)
            page = self._events
            if self._free_slots:
                index = self._free_slots.pop()
            elif page.used < EVENT_SLOTS:
                index = page.used
                page.used += 1
            else:
                raise RuntimeError(f"the stand-in has no event slot left (of {EVENT_SLOTS})")
        page.words[2 * index] = page.words[2 * index + 1] = 0
        return StandinEvent(page, index), f"standin-event:{os.getpid()}:{page.fd}:{index}".encode()

    def open_event(self, handle: bytes) -> StandinEvent:
        kind, pid, fd, index = handle.decode().split(":")
        if kind != "standin-event":
            raise ValueError(f"not a stand-in event handle: {handle!r}")
        key = (int(pid), int(fd))
        with self._lock:
            page = self._peer_pages.get(key)
            if page is None:
                page = self._peer_pages[key] = _EventPage(
                    open_segment(key[0], key[1], EVENT_SLOTS * 16), owner=False
                )
        return StandinEvent(page, int(index))

    def close_event(self, event: Any, mine: bool) -> None:
        if mine:
            with self._lock:
                self._free_slots.append(event.index)

    def record(self, stream: Any, event: Any) -> None:
        words, i = event.page.words, 2 * event.index
        mark = int(words[i]) + 1
        words[i] = mark  # the host's record: peers that wait from now on wait for this one

        def done() -> None:
            words[i + 1] = mark

        stream.enqueue(done)

    def wait(self, stream: Any, event: Any, watch: Watch) -> int:
        target = int(event.recorded)  # the latest record its owner made (and then said so)
        words, i = event.page.words, 2 * event.index + 1

        def spin() -> None:
            poll_until(lambda: int(words[i]) >= target, watch)

        stream.enqueue(spin)
        return target

    def event_done(self, event: Any, mark: Any) -> bool:
        return mark is None or int(event.completed) >= int(mark)

    def complete(self, stream: Any, watch: Watch) -> None:
        stream.synchronize()  # (its event waits watch for themselves)

    def abandon(self, stream: Any) -> None:
        with stream.lock:
            stream.queue.clear()
            stream.done_count = stream.queued

    # memory
    def alloc_window(self, nbytes: int) -> LocalWindow:
        size = STANDIN_GUARD_BYTES + nbytes
        fd = os.memfd_create("ringcomm-standin-window", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            seg = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        base = np.frombuffer(seg, np.uint8, size)
        base[:STANDIN_GUARD_BYTES] = 0xEE  # what a peer that ignores the offset reads
        buf = StandinArray(base[STANDIN_GUARD_BYTES:])
        handle = f"standin-mem:{os.getpid()}:{fd}:{size}".encode()
        return LocalWindow(buf, handle, STANDIN_GUARD_BYTES, size, (fd, seg, base))

    def free_window(self, window: LocalWindow) -> None:
        fd, seg, _ = window.keep
        window.keep = None
        window.buf = None
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(BufferError):
            seg.close()

    def _open_mapping(self, handle: bytes, size: int) -> Any:
        kind, pid, fd, their_size = handle.decode().split(":")
        if kind != "standin-mem" or int(their_size) != size:
            raise ValueError(f"not a stand-in window handle of {size} bytes: {handle!r}")
        mine = open_segment(int(pid), int(fd), size)
        try:
            seg = mmap.mmap(mine, size)
        finally:
            os.close(mine)
        return _Mapping(seg, StandinArray(np.frombuffer(seg, np.uint8, size)))

    def _close_mapping(self, mapping: Any) -> None:
        mapping.close()

    def map_window(self, handle: bytes, offset: int, nbytes: int, size: int) -> Any:
        mapping = self.cache.open(handle, size)
        return mapping.array[offset : offset + nbytes]

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    # copies and kernels
    def copy(self, stream: Any, dst: Any, src: Any) -> None:
        d, s = _u8(dst).host, _u8(src).host
        stream.enqueue(lambda: np.copyto(d, s))

    def d2h(self, stream: Any, host: np.ndarray, dev: Any) -> None:
        s = _u8(dev).host
        h = host.reshape(-1).view(np.uint8)
        stream.enqueue(lambda: np.copyto(h, s))

    def h2d(self, stream: Any, dev: Any, host: np.ndarray) -> None:
        d = _u8(dev).host
        h = host.reshape(-1).view(np.uint8)
        stream.enqueue(lambda: np.copyto(d, h))

    def reduce(self, stream: Any, op: ReduceOp, srcs: Sequence[Any], out: Any) -> None:
        hosts = [s.host for s in srcs]
        o = out.host
        if len(hosts) == 1:
            stream.enqueue(lambda: np.copyto(o, hosts[0]))
            return
        ufunc = reduce_ufunc(op, o.dtype)
        silence = o.dtype.kind == "f"
        stream.enqueue(lambda: reduce_in_order(ufunc, hosts, o, silence=silence))

    def finalize(self, stream: Any, op: ReduceOp, acc: Any, world_size: int) -> None:
        a = acc.host
        stream.enqueue(lambda: finalize(op, a, world_size))


class _Mapping:
    """A peer's stand-in segment mapped here (``array``: all of it, as a stand-in array)."""

    __slots__ = ("array", "seg")

    def __init__(self, seg: mmap.mmap, array: StandinArray) -> None:
        self.seg = seg
        self.array = array

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view may outlive the group: its pages stay
            self.seg.close()


# -- CUDA through CuPy ----------------------------------------------------------------------
class _PeerEvent:
    """A peer's interprocess event opened here (``ptr``: what ``Stream.wait_event`` uses)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class CupyIpcDevice(IpcDevice):
    """One CUDA device through CuPy (CUDA IPC; see the module docstring).

    Windows are raw ``cupy.cuda.Memory`` allocations (outside the pool's sub-allocation:
    the handle names the window's own base, offset 0); peers' are opened with
    ``cudaIpcMemLazyEnablePeerAccess`` (a peer on another GPU of the host is reached over
    peer access) and wrapped as ``UnownedMemory`` of this device. Events are
    ``Event(disable_timing=True, interprocess=True)``; a peer's is opened once and waited
    for with ``cudaStreamWaitEvent``. Kernels are CuPy ufuncs run with the stream current.
    """

    kind = "cupy"

    def __init__(self, cp: Any, device_id: int) -> None:
        super().__init__()
        self.cp = cp
        self.device_id = device_id
        self.device = cp.cuda.Device(device_id)
        rt = cp.cuda.runtime
        try:
            bus = str(self.device.pci_bus_id)
        except Exception:  # noqa: BLE001 (old CuPy or a driver without it)
            bus = str(device_id)
        self.identity = f"cuda:{bus}"
        self._rt = rt
        with self.device:
            self._done = cp.cuda.Event(block=False, disable_timing=True)

    def caller_stream(self) -> Any:
        with self.device:
            return self.cp.cuda.get_current_stream()

    def new_event(self) -> tuple[Any, bytes]:
        with self.device:
            event = self.cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
            return event, bytes(self._rt.ipcGetEventHandle(event.ptr))

    def open_event(self, handle: bytes) -> _PeerEvent:
        with self.device:
            return _PeerEvent(int(self._rt.ipcOpenEventHandle(bytes(handle))))

    def close_event(self, event: Any, mine: bool) -> None:
        if not mine:
            with self.device:
                self._rt.eventDestroy(event.ptr)
            event.ptr = 0
        # (ours is a cupy Event: destroyed with it)

    def record(self, stream: Any, event: Any) -> None:
        with self.device:
            self._rt.eventRecord(event.ptr, stream.ptr)

    def wait(self, stream: Any, event: Any, watch: Watch) -> None:
        with self.device:
            self._rt.streamWaitEvent(stream.ptr, event.ptr, 0)

    def event_done(self, event: Any, mark: Any) -> bool:
        with self.device:  # (its latest record: one this rank waited for, or a later one)
            return int(self._rt.eventQuery(event.ptr)) == 0

    def quiet(self, stream: Any) -> bool:
        if stream is None:
            return True
        with self.device:
            return int(self._rt.streamQuery(stream.ptr)) == 0

    def complete(self, stream: Any, watch: Watch) -> None:
        done = self._done
        with self.device:
            self._rt.eventRecord(done.ptr, stream.ptr)
        query = self._rt.eventQuery

        def ready() -> bool:
            status = int(query(done.ptr))
            if status == 0:  # cudaSuccess
                return True
            if status != _CUDA_NOT_READY:  # a fault on the stream: it will never finish
                raise RuntimeError(f"CUDA error {status} on the stream of a device collective")
            return False

        poll_until(ready, watch)

    # memory
    def alloc_window(self, nbytes: int) -> LocalWindow:
        cp = self.cp
        with self.device:
            mem = cp.cuda.memory.Memory(nbytes)
            buf = cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
            handle = bytes(self._rt.ipcGetMemHandle(mem.ptr))
        return LocalWindow(buf, handle, 0, nbytes, mem)

    def free_window(self, window: LocalWindow) -> None:
        window.buf = None
        window.keep = None  # the Memory frees itself (cudaFree) with its last reference

    def _open_mapping(self, handle: bytes, size: int) -> Any:
        cp = self.cp
        with self.device:
            ptr = int(self._rt.ipcOpenMemHandle(bytes(handle)))  # lazy peer access
            mem = cp.cuda.UnownedMemory(ptr, size, None, self.device_id)
            return cp.ndarray((size,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))

    def _close_mapping(self, mapping: Any) -> None:
        with self.device:
            self._rt.ipcCloseMemHandle(int(mapping.data.ptr))

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cp.cuda.alloc_pinned_memory(nbytes)
        return np.ndarray((nbytes,), np.uint8, mem)

    # copies and kernels
    def copy(self, stream: Any, dst: Any, src: Any) -> None:
        n = int(src.nbytes)
        if n:
            with self.device:
                dst.data.copy_from_device_async(src.data, n, stream)

    def d2h(self, stream: Any, host: np.ndarray, dev: Any) -> None:
        n = int(dev.nbytes)
        if n:
            with self.device:
                dev.data.copy_to_host_async(host.ctypes.data, n, stream)

    def h2d(self, stream: Any, dev: Any, host: np.ndarray) -> None:
        n = int(dev.nbytes)
        if n:
            with self.device:
                dev.data.copy_from_host_async(host.ctypes.data, n, stream)

    def reduce(self, stream: Any, op: ReduceOp, srcs: Sequence[Any], out: Any) -> None:
        if out.size == 0:
            return
        if len(srcs) == 1:
            self.copy(stream, out, srcs[0])
            return
        with self.device, stream:
            reduce_in_order(reduce_ufunc(op, out.dtype, self.cp), srcs, out, silence=False)

    def finalize(self, stream: Any, op: ReduceOp, acc: Any, world_size: int) -> None:
        if acc.size:
            with self.device, stream:
                finalize(op, acc, world_size)


# -- which device ------------------------------------------------------------------------------
_DEVICES: PerDevice[IpcDevice] = PerDevice(StandinIpcDevice, CupyIpcDevice)


def ipc_device_for(x: Any) -> IpcDevice:
    """The (process-wide) window device of device array ``x``; TypeError for others."""
    return _DEVICES.of(x)
