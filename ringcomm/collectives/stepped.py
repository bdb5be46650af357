"""What the stepped algorithms share beyond :class:`~ringcomm.collectives.base.CollectiveOp`:
the bases that say, once, where a message of theirs comes from and how it is cut.

- :class:`SpansOp`: every data message is cut alike, by ``self.spans`` (the progress map's
  piece count).
- :class:`RingOp`: a ring (``schedule.ring``): step 0 goes to the right neighbour at once,
  and step ``k`` of the ``n - 1`` is named ``"<step_name> step k+1/n-1"``;
  :meth:`RingOp.join_ring` finds the neighbours and declares the messages.
- :class:`UnevenRingOp`: a ring over segments of different sizes (the ``_v`` rings): the
  message of step ``k`` is segment ``recv_seg[k]``, cut by ``spans[seg]``, of
  ``seg_nbytes[seg]`` bytes, and an arriving piece is checked against it.
- :class:`PeerRowsOp`: each peer's one message is its row of ``out`` (``out_u8[peer]``);
  our own row goes in once the first piece showed the call matches.

These only answer the progress map and check arriving pieces: an algorithm's schedule and
its sends stay in its own module.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ringcomm.collectives.base import CollectiveOp
from ringcomm.errors import CollectiveMismatchError
from ringcomm.schedule.ring import ring_neighbors
from ringcomm.transport.wire import Header

__all__ = ["PeerRowsOp", "RingOp", "SpansOp", "UnevenRingOp"]


class SpansOp(CollectiveOp):
    """An algorithm whose every data message is cut by ``self.spans`` (set in ``start``)."""

    maps_steps = True
    spans: list[tuple[int, int]]

    def message_pieces(self, step: int) -> int | None:
        return len(self.spans)


class RingOp(CollectiveOp):
    """A ring algorithm: step 0 goes right at once; ``step_name`` names its steps."""

    maps_steps = True
    #: "all-gather": the progress map's "all-gather step 3/7".
    step_name: ClassVar[str] = ""
    right: int
    left: int

    def start_peers(self, rank: int) -> tuple[int, ...]:
        return (ring_neighbors(rank, self.n, self.comm.ring_order)[0],)  # step 0 goes right

    def step_text(self, step: int) -> str:
        return f"{self.step_name} step {step + 1}/{self.n - 1}"

    def join_ring(self, messages: int) -> None:
        """Set ``self.right`` and ``self.left`` (``ring_neighbors``) and declare
        ``messages`` messages to the right and as many from the left (in ``start``)."""
        self.right, self.left = ring_neighbors(self.rank, self.n, self.comm.ring_order)
        self.will_send(self.right, messages)
        self.expect(self.left, messages)

    def ring_piece(
        self, peer: int, header: Header, payload: memoryview, spans: list[tuple[int, int]]
    ) -> tuple[int, int]:
        """:meth:`piece_span` of a ring whose every step is cut by ``spans``, the step
        checked first (one of the ``n - 1``)."""
        k = header.step
        if k >= self.n - 1:
            raise CollectiveMismatchError(f"rank {self.rank}: {self.desc}: unexpected step {k}")
        return self.piece_span(peer, header, payload, spans, "the schedule")


class UnevenRingOp(RingOp):
    """A ring over segments of different sizes (attributes set in ``start``)."""

    #: The segment received at each step, each segment's pieces and its size in bytes.
    recv_seg: list[int]
    seg_spans: list[list[tuple[int, int]]]
    seg_nbytes: list[int]

    def message_pieces(self, step: int) -> int | None:
        return len(self.seg_spans[self.recv_seg[step]])

    def uneven_piece(self, peer: int, header: Header, payload: memoryview) -> tuple[int, int, int]:
        """The segment step ``header.step`` carries, and the piece's (offset, length) in
        it; a mismatch if the step, the piece or the segment's size is not what this
        rank's call expects."""
        k = header.step
        if k >= self.n - 1:
            raise CollectiveMismatchError(f"rank {self.rank}: {self.desc}: unexpected step {k}")
        seg = self.recv_seg[k]
        off, length = self.piece_span(peer, header, payload, self.seg_spans[seg], f"segment {seg}")
        if header.nbytes != self.seg_nbytes[seg]:
            raise CollectiveMismatchError(
                f"rank {self.rank}: {self.desc}: segment {seg} from rank {peer} has "
                f"{header.nbytes} bytes, expected {self.seg_nbytes[seg]}"
            )
        return seg, off, length


class PeerRowsOp(CollectiveOp):
    """Each peer's one message is its row of ``out`` (``out_u8[peer]``, cut by ``spans``);
    our own row (``own``) is copied in once the first piece proved the call matches ours
    (a mismatch leaves ``out`` untouched). Attributes set in ``start``."""

    spans: list[tuple[int, int]]
    out_u8: Any
    own: Any

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        off, length = self.piece_span(peer, header, payload, self.spans)
        if not self.touched:  # the first matching piece: now out may be written
            self.touched = True
            self.out_u8[self.rank] = self.own
        self.out_u8[peer, off : off + length] = np.frombuffer(payload, np.uint8)
