"""All-to-all directly: rank ``r`` sends row ``x[j]`` to each rank ``j``; ``out[j]`` is
rank ``j``'s ``x[r]``.

Sends go to ``r+1, r+2, ...`` in turn (so the ranks do not all start with the same peer),
zero-copy from ``x`` when large; ``x`` is never written (``out`` may not overlap it, checked
at the call). Our own row is copied into ``out[r]`` when the first matching piece arrives (so a
mismatch leaves ``out`` untouched); every received piece is copied once
from its frame into ``out[src]``. One inbox per peer.
"""

from __future__ import annotations

import numpy as np

from ringcomm.collectives.base import byte_view
from ringcomm.collectives.stepped import PeerRowsOp
from ringcomm.schedule.chunks import chunk_spans

__all__ = ["AllToAllDirect"]


class AllToAllDirect(PeerRowsOp):
    name = "all_to_all"
    algo = "direct"
    fp_messages = False  # every rank hears from every peer at start

    def start(self) -> None:
        x, out = self.call.x, self.call.out
        assert x is not None and out is not None
        n, r = self.n, self.rank
        self.result = out
        rows = x.reshape(n, -1)
        self.out_u8 = out.reshape(n, -1).view(np.uint8)
        self.own = rows.view(np.uint8)[r]
        if n == 1:
            self.out_u8[r] = self.own
        row_nbytes = rows.shape[1] * x.itemsize
        self.spans = chunk_spans(row_nbytes, self.comm.chunk_bytes, x.itemsize)
        data = byte_view(rows)
        for k in range(1, n):
            peer = (r + k) % n
            self.will_send(peer, 1)
            self.send_message(peer, 0, data, self.spans, peer * row_nbytes, x.dtype.str)
        for k in range(1, n):
            self.expect((r - k) % n, 1)
        self.post_inboxes()
