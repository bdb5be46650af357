"""Point-to-point on device arrays: send and receive staged through pinned host buffers.

:class:`StagedSendOp` enqueues the device->host copy of every piece on the staging stream
first, then sends each piece once its copy is done (the copy of piece k+1 runs while piece
k is sent); a piece's staging buffer goes back to the pool once libzmq let go of it.
:class:`StagedRecvOp` receives into one pinned host buffer with :class:`~ringcomm.core.p2p.RecvOp`'s
own matching and checks, and enqueues the host->device copy of each piece as soon as it
is in (so the copy overlaps the receive of the next piece); the op completes once the
last copy finished. The wire format is the same as for NumPy buffers: a device rank and a
host rank can talk to each other.

:func:`send_op_class`/:func:`recv_op_class` pick the op class for an array (``group``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ringcomm.core.p2p import RecvOp, SendOp
from ringcomm.device.staging import DeviceStager, Slot, backend_for
from ringcomm.transport.wire import Header, pack_header

__all__ = ["STAGING_TIMEOUT_S", "StagedRecvOp", "StagedSendOp", "recv_op_class", "send_op_class"]

#: Longest a p2p call waits for a staging buffer to come back (they come back on their own).
STAGING_TIMEOUT_S = 300.0


def send_op_class(x: Any) -> type[SendOp]:
    return SendOp if type(x) is np.ndarray else StagedSendOp


def recv_op_class(x: Any) -> type[RecvOp]:
    return RecvOp if type(x) is np.ndarray else StagedRecvOp


class StagedSendOp(SendOp):
    def __init__(self, progress: Any, x: Any, **kwargs: Any) -> None:
        super().__init__(progress, x, **kwargs)
        self.backend = backend_for(x)
        self.ready_event = self.backend.caller_event()  # at the call, on the caller's stream

    def start(self) -> None:
        st = DeviceStager(
            self.backend,
            self.ready_event,
            time.monotonic() + STAGING_TIMEOUT_S,
            self.describe(),
        )
        data = self.x.reshape(-1).view(np.uint8)
        for header, off, length in self.pieces():
            st.send(data[off : off + length], self._send_piece, header, length)
        try:
            st.pump(0)
        except BaseException:
            st.abandon()
            raise
        self.settle()

    def _send_piece(self, header: Header, length: int, payload: Any) -> Any:
        tracker = self.progress.send(self.dst_global, None, pack_header(header), payload, length)
        self.add_tracker(tracker)
        self.sent_pieces += 1
        return tracker


class StagedRecvOp(RecvOp):
    def __init__(self, progress: Any, x: Any, **kwargs: Any) -> None:
        super().__init__(progress, x, **kwargs)
        self.backend = backend_for(x)
        self.ready_event = self.backend.caller_event()
        self.dev_u8 = x.reshape(-1).view(np.uint8)
        self._stager: DeviceStager | None = None
        self._slot: Slot | None = None
        self._uploaded = 0  # bytes of the message whose upload is enqueued

    def start(self) -> None:
        st = self._stager = DeviceStager(
            self.backend,
            self.ready_event,  # our writes into x follow the caller's earlier work on it
            time.monotonic() + STAGING_TIMEOUT_S,
            self.describe(),
        )
        self._slot = st.acquire(self.x.nbytes)
        self.data = self._slot.buf[: self.x.nbytes]  # RecvOp fills this host buffer
        super().start()

    def _upload_to(self, end: int) -> None:
        st = self._stager
        assert st is not None
        if end > self._uploaded:
            a = self._uploaded
            st.upload(self.dev_u8[a:end], self.data[a:end])
            self._uploaded = end

    def on_piece(self, header: Header, payload: memoryview) -> bool:
        finished = super().on_piece(header, payload)
        if not self.done and self.mismatch is None and self.got:
            self._upload_to(min(header.offset + len(payload), self.x.nbytes))
        return finished

    def finish(self, error: BaseException | None = None) -> None:
        if self.done:
            return
        st = self._stager
        if st is not None:
            try:
                if error is None:
                    self._upload_to(self.x.nbytes)
            finally:
                st.backend.synchronize(st.stream)
                if self._slot is not None:
                    st.pool.release(self._slot)
                    self._slot = None
        super().finish(error)
