"""Scatter from ``src`` directly: ``src`` sends row ``x[i]`` to each rank ``i``.

Every rank returns its row (``out``, shape ``x.shape[1:]``). A rank other than ``src`` may
call with ``x=None`` and ``out=None``: its buffer is then made from the source's
fingerprint when the first piece arrives; an ``x`` or ``out`` given must match the source's
call. ``src`` sends to ``src+1, src+2, ...`` in turn (zero-copy when large; ``x`` is never
written) and copies its own row into ``out``.

Invariant: every rank hears from every other before it writes ``out`` (``gate_writes``,
see ``base``); a peer's fingerprint may differ from ours in dtype and shape only, and those
must agree with every dtype and shape seen so far in the call (two non-roots that passed
different shapes both raise). The rule in full: docs/architecture.md, section
"collectives/scatter_direct.py".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.collectives.base import CollectiveOp, Inbox, byte_view
from ringcomm.errors import CollectiveMismatchError
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.transport.wire import SUPPORTED_DTYPES, Header

__all__ = ["ScatterDirect"]

_WIRE_DTYPES = {dt.str: dt for dt in SUPPORTED_DTYPES}


class ScatterDirect(CollectiveOp):
    name = "scatter"
    algo = "direct"

    def start_peers(self, rank: int) -> tuple[int, ...]:
        # The source sends every other rank its row at once.
        return tuple(p for p in range(self.n) if p != rank) if rank == self.call.root else ()

    def start(self) -> None:
        root = self.call.root
        assert root is not None
        n = self.n
        # dtype and shape as far as this call knows them (merged in ``accepts``).
        self.known: list[Any] = [self.fp[1], self.fp[2]]
        self.out_u8: np.ndarray | None = None
        if self.rank == root:
            x, out = self.call.x, self.call.out
            assert x is not None and out is not None
            self.result = out
            rows = x.reshape(n, -1)
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
        if self.result is not None:
            self._bind(self.result)
        self.expect(root, 1)
        self.post_inboxes()

    def all_received(self) -> None:
        # The source's own row: written only now that every rank agreed.
        call = self.call
        if self.rank == call.root:
            assert call.x is not None and call.out is not None
            self.touched = True
            call.out.reshape(-1)[...] = call.x.reshape(self.n, -1)[self.rank]

    def _bind(self, out: np.ndarray) -> None:
        self.out_u8 = out.reshape(-1).view(np.uint8)
        self.spans = chunk_spans(out.nbytes, self.comm.chunk_bytes, out.itemsize)

    def accepts(self, inbox: Inbox, fp: Any) -> bool:
        """Same call but for dtype/shape, and those agree with all seen (docstring)."""
        mine = self.fp
        if not isinstance(fp, list) or len(fp) != len(mine):
            return False
        for i, (m, t) in enumerate(zip(mine, fp)):
            if i not in (1, 2) and m != t:
                return False
        dtype, shape = fp[1], fp[2]
        if dtype is not None and (not isinstance(dtype, str) or dtype not in _WIRE_DTYPES):
            return False
        if shape is not None and (
            not isinstance(shape, list)
            or not shape
            or shape[0] != self.n
            or not all(type(d) is int and d >= 0 for d in shape)
        ):
            return False
        known = self.known
        for i, value in ((0, dtype), (1, shape)):
            if value is not None:
                if known[i] is None:
                    known[i] = value
                elif known[i] != value:
                    return False
        inbox.fp = fp  # its later pieces compare equal at once
        return True

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        if self.result is None:
            # Called with neither x nor out: dtype and shape as every rank agreed.
            dtype, shape = self.known
            if dtype is None or shape is None:
                raise CollectiveMismatchError(
                    f"rank {self.rank}: {self.desc}: data from rank {peer} but no rank "
                    "said the dtype and shape"
                )
            self.result = np.empty(tuple(shape[1:]), _WIRE_DTYPES[dtype])
            self._bind(self.result)
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
