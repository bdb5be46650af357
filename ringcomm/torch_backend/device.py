"""Device tensors for the ringcomm torch backend: which tensors are device tensors, their
ringcomm arrays without a copy (DLPack), and the stream order of one call.

A backend call on device tensors runs in a :class:`CallScope`: at the call, every tensor
is checked (one device, the rank's; contiguous; errors name rank and op) and the caller's
current stream taken; each ringcomm call is made with that stream as the array library's
current stream (:meth:`CallScope.ordered`), so ringcomm's device work waits for the kernel
that produced the tensors; ringcomm completes an operation only once its writes are done,
and the backend's steps after it run on the caller's stream, then an event is recorded
there (:meth:`CallScope.finish`); ``Work.wait()`` makes the waiter's current stream wait
for that event (:meth:`CallScope.join`: NCCL's semantics) and the future is a CUDA future.

:class:`CudaDevice`: CUDA tensors as CuPy arrays, torch's streams as CuPy's
(``ExternalStream``). :class:`StandinTensorDevice` (CPU tests): CPU tensors posing as
device tensors, as ringcomm's stand-in device arrays, with logging fake streams. A rank's
device is its current device at the group's first call on device tensors.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.dlpack

from ringcomm.device.standin import StandinArray
from ringcomm.device.xp import cupy_or_none

__all__ = [
    "CallScope",
    "CudaDevice",
    "DeviceBinding",
    "FakeEvent",
    "FakeStream",
    "StandinTensorDevice",
    "TensorDevice",
    "array_of",
    "current_call",
    "device_of",
    "start_call",
    "stop_standin",
    "tensor_of",
    "use_standin",
]


class TensorDevice:
    """What the backend needs of one kind of device tensor (one instance per process)."""

    name = "device"

    def claims(self, t: torch.Tensor) -> bool:
        raise NotImplementedError

    def index(self, t: torch.Tensor) -> int:
        """The device index of ``t``."""
        raise NotImplementedError

    def current_index(self) -> int:
        """This thread's current device (what a rank binds to at its first device call)."""
        raise NotImplementedError

    def label(self, index: int) -> str:
        return f"{self.name}:{index}"

    def array(self, t: torch.Tensor) -> Any:
        """The ringcomm array on ``t``'s memory (no copy, no synchronisation)."""
        raise NotImplementedError

    def tensor(self, a: Any) -> torch.Tensor:
        """A tensor on ringcomm's result array ``a`` (no copy where the device allows)."""
        raise NotImplementedError

    def current_stream(self, index: int) -> Any:
        raise NotImplementedError

    def ordered(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Within: ringcomm orders its device work after ``stream``'s work so far."""
        raise NotImplementedError

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Within: torch's and the array library's work of this thread goes on ``stream``."""
        raise NotImplementedError

    def record(self, stream: Any) -> Any:
        """An event after everything queued on ``stream`` so far (``.query()``: done?)."""
        raise NotImplementedError

    def wait(self, stream: Any, event: Any) -> None:
        """``stream``'s later work waits for ``event`` (the host does not)."""
        raise NotImplementedError

    def future_devices(self, index: int) -> list[torch.device]:
        """The devices of a torch Future carrying this device's tensors."""
        return []


class CudaDevice(TensorDevice):
    """CUDA tensors: CuPy arrays through DLPack, torch's streams as CuPy's."""

    name = "cuda"

    @staticmethod
    def _cupy() -> Any:
        cp = cupy_or_none()
        if cp is None:
            raise RuntimeError(
                "the ringcomm backend needs CuPy for CUDA tensors (pip install 'ringcomm[gpu]')"
            )
        return cp

    def claims(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def index(self, t: torch.Tensor) -> int:
        return int(t.device.index if t.device.index is not None else torch.cuda.current_device())

    def current_index(self) -> int:
        return int(torch.cuda.current_device())

    def array(self, t: torch.Tensor) -> Any:
        # (tensor.__dlpack__ wants the tensor's device current.) With torch's current
        # stream as CuPy's, CuPy hands that stream to tensor.__dlpack__, which then has
        # nothing to synchronise.
        with torch.cuda.device(t.device), self.ordered(torch.cuda.current_stream(t.device)):
            return self._cupy().from_dlpack(t)

    def tensor(self, a: Any) -> torch.Tensor:
        return torch.utils.dlpack.from_dlpack(a)

    def current_stream(self, index: int) -> Any:
        return torch.cuda.current_stream(index)

    def _cupy_stream(self, stream: Any) -> Any:
        cp = self._cupy()
        ptr = int(stream.cuda_stream)
        if ptr == 0:  # torch's legacy default stream
            return cp.cuda.Stream.null
        return cp.cuda.ExternalStream(ptr, int(stream.device.index))

    @contextlib.contextmanager
    def ordered(self, stream: Any) -> Iterator[None]:
        cp = self._cupy()
        with cp.cuda.Device(int(stream.device.index)), self._cupy_stream(stream):
            yield

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Iterator[None]:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream), self.ordered(stream):
            yield

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def future_devices(self, index: int) -> list[torch.device]:
        return [torch.device("cuda", index)]


class FakeEvent:
    """An event of a :class:`FakeStream`: done once its stream ran past it."""

    __slots__ = ("mark", "stream")

    def __init__(self, stream: FakeStream, mark: int) -> None:
        self.stream, self.mark = stream, mark

    def query(self) -> bool:
        return self.stream.done >= self.mark

    def __repr__(self) -> str:
        return f"FakeEvent({self.stream.name}@{self.mark})"


class FakeStream:
    """A stand-in stream: counts the work queued on it (``queued``); it runs everything at
    once (``done == queued``) unless a test holds it (:meth:`hold`: ``done`` stays where it
    was until :meth:`release`). ``waits`` lists the events it was told to wait for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queued = 0
        self.waits: list[FakeEvent] = []
        self._held: int | None = None

    @property
    def done(self) -> int:
        return self.queued if self._held is None else self._held

    def hold(self) -> None:
        self._held = self.done

    def release(self) -> None:
        self._held = None

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class StandinTensorDevice(TensorDevice):
    """CPU tensors posing as device tensors (CPU tests of the device path): the arrays are
    ringcomm's stand-in device arrays on the tensors' memory (so ringcomm takes its device
    path), the streams and events are :class:`FakeStream` / :class:`FakeEvent`, and every
    stream use is appended to ``log`` as ``(what, stream name, detail)``. ``claim(t)``
    says which CPU tensors are "device" tensors (default: all); ``index_of(t)`` which
    device index a tensor is on (default 0), ``current`` the current device index."""

    name = "standin"

    def __init__(self, claim: Callable[[torch.Tensor], bool] | None = None) -> None:
        self.claim = claim
        self.index_of: Callable[[torch.Tensor], int] | None = None
        self.current = 0
        self.default = FakeStream("default")
        self.log: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    def claims(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and (self.claim is None or self.claim(t))

    def index(self, t: torch.Tensor) -> int:
        return 0 if self.index_of is None else self.index_of(t)

    def current_index(self) -> int:
        return self.current

    def array(self, t: torch.Tensor) -> Any:
        return StandinArray(t.numpy())

    def tensor(self, a: Any) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.get()))

    def current_stream(self, index: int) -> FakeStream:
        stream: FakeStream = getattr(self._local, "stream", self.default)
        return stream

    def _note(self, what: str, stream: FakeStream, detail: Any = None) -> None:
        with self._lock:
            self.log.append((what, stream.name, detail))

    @contextlib.contextmanager
    def ordered(self, stream: FakeStream) -> Iterator[None]:
        self._note("ordered", stream, threading.current_thread().name)
        yield

    @contextlib.contextmanager
    def on_stream(self, stream: FakeStream) -> Iterator[None]:
        """Also what tests use to run "kernels" on a stream (``queued`` grows by one)."""
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        self._note("on_stream", stream, threading.current_thread().name)
        stream.queued += 1
        try:
            yield
        finally:
            self._local.stream = previous if previous is not None else self.default

    def record(self, stream: FakeStream) -> FakeEvent:
        event = FakeEvent(stream, stream.queued)
        self._note("record", stream, event)
        return event

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        stream.waits.append(event)
        self._note("wait", stream, event)


# -- which device a tensor is on -----------------------------------------------------------
_DEVICES: list[TensorDevice] = [CudaDevice()]


def use_standin(claim: Callable[[torch.Tensor], bool] | None = None) -> StandinTensorDevice:
    """Make CPU tensors (those ``claim`` accepts; default all) device tensors of a new
    :class:`StandinTensorDevice` in this process, for tests of the device path; returns it.
    ``use_standin`` again replaces it."""
    dev = StandinTensorDevice(claim)
    _DEVICES[:] = [d for d in _DEVICES if not isinstance(d, StandinTensorDevice)] + [dev]
    return dev


def stop_standin() -> None:
    """Undo :func:`use_standin`: CPU tensors are host tensors again."""
    _DEVICES[:] = [d for d in _DEVICES if not isinstance(d, StandinTensorDevice)]


def device_of(t: torch.Tensor) -> TensorDevice | None:
    """The device kind of tensor ``t`` (None: a host tensor, NumPy's)."""
    for dev in _DEVICES:
        if dev.claims(t):
            return dev
    return None


def array_of(t: torch.Tensor) -> Any:
    """The ringcomm array on contiguous ``t``'s memory, of the kind the current call takes
    (:func:`current_call`): NumPy on the host, the device's array on a device."""
    scope = current_call()
    return t.numpy() if scope.device is None else scope.device.array(t)


def tensor_of(a: Any, like: torch.Tensor) -> torch.Tensor:
    """A tensor on ringcomm's result array ``a`` of a call on tensors like ``like``."""
    dev = device_of(like)
    if dev is None:
        return torch.from_numpy(np.ascontiguousarray(a))
    return dev.tensor(a)


# -- one call --------------------------------------------------------------------------------
class DeviceBinding:
    """A group's device: bound at its first call on device tensors (the current device)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}  # device kind -> index

    def check(self, dev: TensorDevice, index: int, what: str) -> None:
        bound = self.index.setdefault(dev.name, dev.current_index())
        if index != bound:
            raise ValueError(
                f"{what}: a tensor on {dev.label(index)}, but this rank's device is "
                f"{dev.label(bound)} (the current device at the group's first {dev.name} "
                "call: call torch.cuda.set_device(...) before it)"
            )


class CallScope:
    """One backend call: its device (None: host tensors), device index and the caller's
    stream at the call (see the module docstring)."""

    def __init__(self, what: str, binding: DeviceBinding) -> None:
        self.what = what
        self.binding = binding
        self.device: TensorDevice | None = None
        self.index = 0
        self.stream: Any = None
        self.host: torch.Tensor | None = None  # a host tensor seen in this call

    def check(self, t: torch.Tensor) -> torch.Tensor:
        """Check ``t`` for this call (at the call: before anything is sent)."""
        dev = device_of(t)
        if dev is None:
            if t.device.type != "cpu":
                raise ValueError(
                    f"{self.what}: the ringcomm backend takes CPU tensors and CUDA tensors "
                    f"(with CuPy), got one on {t.device}"
                )
            if self.device is not None:
                self._mixed(t, self.device.label(self.index))
            self.host = t
            return t
        index = dev.index(t)
        if self.host is not None:
            self._mixed(self.host, dev.label(index))
        self.binding.check(dev, index, self.what)
        if not t.is_contiguous():
            raise ValueError(
                f"{self.what}: a non-contiguous {dev.label(index)} tensor (shape "
                f"{tuple(t.shape)}, strides {t.stride()}): the ringcomm backend reads and "
                "writes device tensors in place, as NCCL does; pass .contiguous()"
            )
        if self.device is None:
            self.device, self.index = dev, index
            self.stream = dev.current_stream(index)
        return t

    def _mixed(self, host: torch.Tensor, label: str) -> None:
        raise ValueError(
            f"{self.what}: a tensor on {host.device} (shape {tuple(host.shape)}) in a call on "
            f"{label} tensors: every input and output of one call must be on the rank's "
            "device, or every one on the CPU"
        )

    def ordered(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self.device is None else self.device.ordered(self.stream)

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        if self.device is None:
            return contextlib.nullcontext()
        return self.device.on_stream(self.stream)

    def finish(self) -> Any:
        """After the call's own steps: an event on the caller's stream (None on the host)."""
        return None if self.device is None else self.device.record(self.stream)

    def join(self, event: Any) -> None:
        """The waiting thread's current stream waits for ``event`` (from :meth:`finish`)."""
        if self.device is not None and event is not None:
            self.device.wait(self.device.current_stream(self.index), event)

    def future_devices(self) -> list[torch.device]:
        return [] if self.device is None else self.device.future_devices(self.index)


#: The call this thread is making: a backend call runs on one thread from its start
#: (:func:`start_call`) to the Work it returns; its Work keeps the scope for later steps.
_CALLS = threading.local()


def start_call(what: str, binding: DeviceBinding) -> CallScope:
    """A new scope for the call ``what`` on this thread (the backend's first step)."""
    scope = _CALLS.scope = CallScope(what, binding)
    return scope


def current_call() -> CallScope:
    """The scope of the call this thread is making."""
    scope: CallScope = _CALLS.scope
    return scope
