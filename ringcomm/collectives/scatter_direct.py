"""Scatter from ``src`` directly: ``src`` sends row ``x[i]`` to each rank ``i``.

Every rank returns its row (``out``, shape ``x.shape[1:]``). A rank other than ``src`` may
call with ``x=None`` and ``out=None``: its fingerprint then leaves dtype and shape open and
the buffer is made from the source's fingerprint when the first piece arrives. With ``x``
(the source's shape) or ``out`` given, they must match the source's call.

``src`` sends to ``src+1, src+2, ...`` in turn (zero-copy from ``x`` when large; ``x`` is
never written) and copies its own row into ``out``. Copies per byte at a receiver: one
frame, one copy into ``out``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CollectiveMismatchError
from ..schedule.chunks import chunk_spans
from ..transport.wire import SUPPORTED_DTYPES, Header
from .base import CollectiveOp, _Inbox, byte_view

__all__ = ["ScatterDirect"]

_WIRE_DTYPES = {dt.str: dt for dt in SUPPORTED_DTYPES}


class ScatterDirect(CollectiveOp):
    name = "scatter"
    algo = "direct"
    gate_writes = False  # non-roots' fingerprints differ by design (base docstring)
    fp_messages = False

    def start(self) -> None:
        root = self.call.root
        assert root is not None
        n = self.n
        if self.rank == root:
            x, out = self.call.x, self.call.out
            assert x is not None and out is not None
            self.result = out
            rows = x.reshape(n, -1)
            out.reshape(-1)[...] = rows[root]
            data = byte_view(rows)
            row_nbytes = rows.shape[1] * x.itemsize
            spans = chunk_spans(row_nbytes, self.comm.chunk_bytes, x.itemsize)
            for k in range(1, n):
                peer = (root + k) % n
                self.will_send(peer, 1)
                self.send_message(peer, 0, data, spans, peer * row_nbytes, x.dtype.str)
            self.post_inboxes()
            return
        self.result = self.call.out
        self.out_u8: np.ndarray | None = None
        if self.result is not None:
            self._bind(self.result)
        self.expect(root, 1)
        self.post_inboxes()

    def _bind(self, out: np.ndarray) -> None:
        self.out_u8 = out.reshape(-1).view(np.uint8)
        self.spans = chunk_spans(out.nbytes, self.comm.chunk_bytes, out.itemsize)

    def accepts(self, inbox: _Inbox, fp: Any) -> bool:
        # A receiver called with x=None and out=None: dtype and shape come from src.
        mine = self.fp
        if self.result is not None or not isinstance(fp, list) or len(fp) != len(mine):
            return False
        for i, (m, t) in enumerate(zip(mine, fp)):
            if m is not None and m != t and i not in (1, 2):
                return False
        dtype = _WIRE_DTYPES.get(fp[1]) if isinstance(fp[1], str) else None
        shape = fp[2]
        if dtype is None or not isinstance(shape, list) or not shape or shape[0] != self.n:
            return False
        if not all(type(d) is int and d >= 0 for d in shape):
            return False
        self.result = np.empty(tuple(shape[1:]), dtype)
        self._bind(self.result)
        self.fp = list(fp)
        inbox.fp = fp
        return True

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        j = header.piece
        spans = self.spans
        if self.out_u8 is None or header.npieces != len(spans) or len(payload) != spans[j][1]:
            raise CollectiveMismatchError(
                f"rank {self.rank}: {self.desc}: piece {j}/{header.npieces} of "
                f"{len(payload)} bytes from rank {peer} does not fit the buffer"
            )
        off, length = spans[j]
        self.touched = True
        self.out_u8[off : off + length] = np.frombuffer(payload, np.uint8)
