"""Barrier by dissemination: ``ceil(log2 n)`` rounds of empty messages.

Round ``i``: send to ``(r + 2**i) % n``, receive from ``(r - 2**i) % n``; round ``i+1``'s
message goes out only after round ``i``'s arrived. After the last round every rank has
heard, directly or through others, from every rank that entered the barrier (Hensgen,
Finkel and Manber). No power-of-two fix-up needed, unlike a 0-byte recursive-doubling
all-reduce (which takes two more steps for such ``n``). The peers of the rounds are
distinct, so one inbox per peer, one message each.
"""

from __future__ import annotations

from ringcomm.collectives.base import CollectiveOp
from ringcomm.transport.wire import Header

__all__ = ["BarrierDissemination"]


class BarrierDissemination(CollectiveOp):
    name = "barrier"
    algo = "dissemination"
    gate_writes = False  # no buffers
    fp_messages = False

    def fingerprint_chunk_bytes(self) -> int | None:
        return None  # empty messages: the piece size does not matter

    def start(self) -> None:
        n, r = self.n, self.rank
        self.result = None
        self.rounds = (n - 1).bit_length()
        self.round_of_peer = {(r - (1 << i)) % n: i for i in range(self.rounds)}
        self.arrived = [False] * self.rounds
        self.current = 0  # rounds whose message we sent
        for i in range(self.rounds):
            self.will_send((r + (1 << i)) % n, 1)
            self.expect((r - (1 << i)) % n, 1)
        if self.rounds:
            self._send_round(0)
        self.post_inboxes()

    def _send_round(self, i: int) -> None:
        self.send_piece((self.rank + (1 << i)) % self.n, i, 0, 1, 0, 0, b"", "|u1")
        self.current = i + 1

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        self.arrived[self.round_of_peer[peer]] = True
        # Round i+1 goes out once round i has arrived (and round i was sent).
        while self.current < self.rounds and self.arrived[self.current - 1]:
            self._send_round(self.current)
