"""Collectives on device arrays: how algorithms reach their data (``ringcomm.device.staging``).

* **Piece-level pipeline** (:data:`PIPELINED`: ring all_reduce, reduce_scatter, all_gather,
  broadcast chain): the algorithm goes through a *stager* (:func:`make_stager`):
  :data:`~ringcomm.device.staging.HOST_STAGER` (zero-copy) for NumPy arrays, a
  ``DeviceStager`` overlapping the copies of one piece with the send of the next otherwise.
* **Whole-buffer staging** (every other algorithm): :func:`staged_class` wraps it; the device
  inputs are copied whole into pinned host buffers at start and the outputs back before the
  op reports completion.

``api`` marks a call on device arrays by setting ``op.device`` (a :class:`DeviceCall`: the
backend, and the event on the caller's stream taken at the call).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from ringcomm.collectives.base import CollectiveOp
from ringcomm.device.staging import HOST_STAGER, DeviceBackend, DeviceStager, HostStager, Slot

__all__ = ["PIPELINED", "DeviceCall", "PipelinedOp", "emit", "make_stager", "staged_class"]

#: (collective, algorithm) pairs that stage piece by piece themselves.
PIPELINED = frozenset(
    {
        ("all_reduce", "ring"),
        ("reduce_scatter", "ring"),
        ("all_gather", "ring"),
        ("broadcast", "chain"),
    }
)


class DeviceCall(NamedTuple):
    """A collective call on device arrays: their backend, and the caller's stream event."""

    backend: DeviceBackend
    ready_event: Any


def make_stager(op: CollectiveOp) -> HostStager | DeviceStager:
    """The stager of ``op``'s call: HOST_STAGER for NumPy arrays, else a DeviceStager."""
    device: DeviceCall | None = getattr(op, "device", None)
    if device is None:
        return HOST_STAGER
    return DeviceStager(
        device.backend,
        device.ready_event,
        time.monotonic() + op.comm.timeout_s,
        f"rank {op.rank}: {op.desc}",
    )


class PipelinedOp(CollectiveOp):
    """Base of the algorithms that move their pieces through a stager (the rings and the
    broadcast chain; ``start`` sets ``self.stager = make_stager(self)``): the last pieces'
    device work is waited for before the op completes, and a failed op lets its staging
    buffers go."""

    stager: HostStager | DeviceStager

    def stage_message(
        self,
        peer: int,
        step: int,
        data: Any,
        spans: list[tuple[int, int]],
        base: int,
        dtype: str,
    ) -> None:
        """:meth:`~CollectiveOp.send_message` through the stager (``data`` from its
        ``bytes_of``): every piece's copy is enqueued, then each piece is sent once its
        copy is done."""
        st = self.stager
        npieces = len(spans)
        total = sum(length for _, length in spans)
        for j, (off, length) in enumerate(spans):
            src = data[base + off : base + off + length]
            st.send(src, emit, self, peer, step, j, npieces, total, off, dtype)
        st.pump(0)

    def all_received(self) -> None:
        self.stager.sync()

    def finish(self, error: BaseException | None = None) -> None:
        if error is not None and not self.done and hasattr(self, "stager"):
            self.stager.abandon()
        super().finish(error)


def emit(
    op: CollectiveOp,
    peer: int,
    step: int,
    piece: int,
    npieces: int,
    msg_nbytes: int,
    offset: int,
    dtype: str,
    payload: Any,
) -> Any:
    """:meth:`CollectiveOp.send_piece` with the payload last: what algorithms hand a
    stager (``st.send(src, emit, op, peer, ...)``), which may call it later, once the
    piece's copy into a staging buffer finished."""
    return op.send_piece(peer, step, piece, npieces, msg_nbytes, offset, payload, dtype)


_STAGED_CLASSES: dict[type[CollectiveOp], type[CollectiveOp]] = {}


def staged_class(cls: type[CollectiveOp]) -> type[CollectiveOp]:
    """``cls`` running on pinned host copies of device arrays (see the module docstring)."""
    staged = _STAGED_CLASSES.get(cls)
    if staged is None:
        staged = type(f"Staged{cls.__name__}", (_WholeStaged, cls), {})
        _STAGED_CLASSES[cls] = staged
    return staged


class _WholeStaged(CollectiveOp):
    """Mixin: stage ``call.x`` in at start, the outputs back before completing."""

    device: DeviceCall

    def run_now(self, deadline: float) -> bool:
        return False  # no fast lane: the regular path stages at start

    def start(self) -> None:
        call = self.call
        self._dev_call = call
        self._slots: list[Slot] = []
        self._sent: list[Any] = []  # its zero-copy sends (add_tracker), for finish
        self._outputs: list[tuple[Any, Any]] = []  # (device array, host twin)
        st = self._stager = make_stager(self)
        assert isinstance(st, DeviceStager)
        hx = hout = None
        if call.x is not None:
            slot, host = st.to_host(call.x)
            self._slots.append(slot)
            hx = host.view(call.x.dtype).reshape(call.x.shape)
        if call.out is not None:
            if (
                call.name == "reduce_scatter"
                and call.x is not None
                and hx is not None
                and st.backend.same_memory(call.out, call.x[self.rank])
            ):
                hout = hx[self.rank]  # the in-place form
            else:
                slot = st.pool.acquire(call.out.nbytes, st.deadline, st.what)
                self._slots.append(slot)
                hout = slot.buf[: call.out.nbytes].view(call.out.dtype).reshape(call.out.shape)
            self._outputs.append((call.out, hout))
        if call.x is not None and self._writes_x():
            self._outputs.append((call.x, hx))
        self._host_to_dev = {id(h): d for d, h in self._outputs}
        if call.x is not None:
            self._host_to_dev.setdefault(id(hx), call.x)
        self.call = call._replace(x=hx, out=hout)
        super().start()

    def add_tracker(self, tracker: Any) -> None:
        super().add_tracker(tracker)
        if tracker is not None and not tracker.done:
            self._sent.append(tracker)

    def _writes_x(self) -> bool:
        name, root = self._dev_call.name, self._dev_call.root
        if name == "all_reduce":
            return True
        if name == "broadcast":
            return self.rank != root
        if name == "reduce":
            return self.rank == root
        return False

    def finish(self, error: BaseException | None = None) -> None:
        if self.done:
            return
        st: DeviceStager | None = getattr(self, "_stager", None)
        if st is not None:
            if error is None:
                try:
                    for dev, host in self._outputs:
                        st.upload(dev, host)
                    st.sync()
                    if self.result is not None:
                        self.result = self._host_to_dev.get(id(self.result), self.result)
                except Exception as exc:  # noqa: BLE001 (a device error fails the call)
                    error = exc
            else:
                st.backend.synchronize(st.stream)
            # Sends still in libzmq's hands (only after an error) keep their buffers busy.
            pending = tuple(t for t in self._sent if not t.done)
            for slot in self._slots:
                st.pool.release(slot, *pending)
            self._slots = []
        super().finish(error)
