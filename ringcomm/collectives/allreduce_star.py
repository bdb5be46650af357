"""All-reduce through one rank, for the smallest messages on more ranks than cores.

Every rank but group rank 0 sends its buffer to rank 0; rank 0 reduces all ``n`` buffers in
rank order (the direct exchange's reduction, so the same bits) and sends the result back.
Two hops instead of one, but ``2(n - 1)`` messages instead of ``n(n - 1)``: where ranks
outnumber cores each message costs a wake-up, so it pays for a few ranks and small sizes
(``ALL_REDUCE_STAR_*``, measured).

Invariant: no rank writes on a mismatched call (rank 0 reduces only once every fingerprint
checked; the others write only rank 0's result). Everything else is the direct exchange's
(:class:`AllReduceDirect`), fast lane included (rank 0 replies inside
``Progress.exchange``). Copies per byte: docs/architecture.md ("Small all_reduce").
"""

from __future__ import annotations

import numpy as np

from ringcomm.collectives.allreduce_direct import AllReduceDirect
from ringcomm.core.progress import INLINE_MAX_BYTES
from ringcomm.transport.wire import KIND_COLL

__all__ = ["AllReduceStar"]

ROOT = 0  # group rank that reduces


class AllReduceStar(AllReduceDirect):
    name = "all_reduce"
    algo = "star"

    # -- the fast lane -----------------------------------------------------------------
    def run_now(self, deadline: float) -> bool:
        """A blocking call below the inline size: ``Progress.exchange`` (rank 0 collects
        and replies inside it; the others send and collect the reply)."""
        x = self.call.x
        assert x is not None
        n = self.n
        nbytes = x.nbytes
        if n == 1 or nbytes >= INLINE_MAX_BYTES:
            return False
        self.plan = plan = self.shape_plan()
        if len(plan.spans) != 1:
            return False
        ranks, group, seq = self.comm.ranks, self.group_id, self.seq
        template = self.header_template(0, 0, 1, plan.dtype, nbytes, 0)
        self._sent_early = True  # before: a hand-over starts us inside exchange
        if self.rank == ROOT:
            others = [ranks[p] for p in range(1, n)]
            keys = [(g, group, KIND_COLL, seq) for g in others]

            def reply(got: list[memoryview]) -> tuple[bytes, None]:
                self.pieces = [None, *got]
                self.reduce_all()
                return template.pack(seq, x.tobytes()), None  # one frame for every peer

            result = self.progress.exchange(
                self, b"", None, nbytes, [], keys, self.fp, deadline, reply=(reply, others)
            )
        else:
            root = ranks[ROOT]
            key = (root, group, KIND_COLL, seq)
            frame = template.pack(seq, x.tobytes())  # one frame: the payload inline
            result = self.progress.exchange(
                self, frame, None, nbytes, [root], [key], self.fp, deadline
            )
            if type(result) is list:
                self.touched = True
                flat = x if x.ndim == 1 else x.reshape(-1)
                np.copyto(flat, np.frombuffer(result[0], x.dtype))
        if self.received(result) is None:
            return False
        self.result = x
        return True

    # -- the regular path --------------------------------------------------------------
    def start(self) -> None:
        x = self.begin()
        if x is None:
            return
        if self.rank == ROOT:
            for peer in range(1, self.n):
                self.expect(peer, 1)
        else:
            if not self._sent_early:
                self.send_whole([ROOT], x.tobytes())
            self.expect(ROOT, 1)
        self.post_inboxes()

    def all_received(self) -> None:
        x = self.call.x
        assert x is not None
        if self.n == 1:
            return
        if self.rank == ROOT:
            self.reduce_all()
            self.send_whole(list(range(1, self.n)), x.tobytes())
            return
        # Rank 0's result, checked piece by piece by on_data (its pieces sit where rank
        # 0's would in the direct exchange): copy it into x.
        flat = x if x.ndim == 1 else x.reshape(-1)
        self.touched = True
        for j, (a, b) in enumerate(self.plan.bounds):
            flat[a:b] = np.frombuffer(self.pieces[j], x.dtype)  # type: ignore[arg-type]
