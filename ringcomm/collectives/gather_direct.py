"""Gather to ``dst`` directly: every other rank sends its ``x`` to ``dst``.

``dst`` copies its own ``x`` into ``out[dst]`` (once the first piece has shown a matching
call, so a mismatch leaves ``out`` untouched) and copies each arriving piece from its
frame into ``out[src]``; it returns ``out`` (``(n, *x.shape)``), the others None.
(Direct, not a tree: the root has to take in ``(n-1) * nbytes`` either way, and a tree
would add copies and steps on the way.)

Copies per byte: one send (zero-copy when large), one frame, one copy into ``out``.
"""

from __future__ import annotations

import numpy as np

from ringcomm.collectives.base import byte_view
from ringcomm.collectives.stepped import PeerRowsOp
from ringcomm.schedule.chunks import chunk_spans

__all__ = ["GatherDirect"]


class GatherDirect(PeerRowsOp):
    name = "gather"
    algo = "direct"
    fp_messages = False  # the root hears from every peer; others write nothing

    def start(self) -> None:
        x, root = self.call.x, self.call.root
        assert x is not None and root is not None
        n = self.n
        self.spans = chunk_spans(x.nbytes, self.comm.chunk_bytes, x.itemsize)
        self.row_nbytes = x.nbytes
        if self.rank != root:
            self.result = None
            self.will_send(root, 1)
            data = byte_view(x)
            self.send_message(root, 0, data, self.spans, 0, x.dtype.str)
            self.post_inboxes()
            return
        out = self.call.out
        assert out is not None
        self.result = out
        self.out_u8 = out.reshape(n, -1).view(np.uint8)
        self.own = x.reshape(-1).view(np.uint8)
        if n == 1:
            self.out_u8[root] = self.own
        for peer in range(n):
            if peer != root:
                self.expect(peer, 1)
        self.post_inboxes()
