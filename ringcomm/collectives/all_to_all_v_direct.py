"""All-to-all with rows of different counts per peer, directly (``all_to_all_v``).

Rank ``r`` sends rows ``x[in_off[j] : in_off[j] + input_splits[j]]`` to each rank ``j`` and
receives ``output_splits[j]`` rows from it into ``out[out_off[j] : ...]``. As
:mod:`all_to_all_direct`: sends go to ``r+1, r+2, ...`` in turn, zero-copy when large.

Invariants: an empty message still goes (every rank hears from every peer at start); ``x``
is never written (``out`` may not overlap it); before any row is written every rank holds
every rank's splits (the first piece to each peer carries the sender's in ``Header.shape``)
and checks every pair, so a disagreement anywhere raises ``CollectiveMismatchError`` on
every rank, naming the pair, with every ``out`` untouched. The fingerprint and the check:
docs/architecture.md, section "collectives/all_to_all_v_direct.py".
"""

from __future__ import annotations

import numpy as np

from ringcomm.collectives.base import Call, CollectiveOp, Comm, byte_view
from ringcomm.errors import CollectiveMismatchError
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.schedule.partition import split_offsets
from ringcomm.transport.wire import Header

__all__ = ["AllToAllVDirect"]


class AllToAllVDirect(CollectiveOp):
    name = "all_to_all_v"
    algo = "direct"
    fp_messages = False  # every rank hears from every peer at start

    def __init__(self, comm: Comm, call: Call, *, async_op: bool = False) -> None:
        # call.shape is (*input_splits, *output_splits, *row shape) (see collectives.api);
        # the fingerprint gets the row shape alone, the one thing ranks share.
        n = comm.world_size
        shape = call.shape
        assert shape is not None and len(shape) >= 2 * n
        self.splits = (tuple(shape[:n]), tuple(shape[n : 2 * n]))
        super().__init__(comm, call._replace(shape=tuple(shape[2 * n :])), async_op=async_op)

    def first_heard(self, peer: int, header: Header) -> None:
        n = self.n
        shape = header.shape
        if shape is None or len(shape) != 2 * n:
            raise CollectiveMismatchError(
                f"rank {self.rank}: {self.desc}: rank {peer}'s first piece does not say its "
                f"splits ({shape!r:.60})"
            )
        self.heard_splits[peer] = (tuple(shape[:n]), tuple(shape[n:]))

    def gate_opens(self) -> None:
        """Every rank's splits are here: every pair must agree before a row is written."""
        splits = self.heard_splits
        splits[self.rank] = self.splits
        n = self.n
        for i in range(n):
            for j in range(n):
                sent, expected = splits[i][0][j], splits[j][1][i]
                if sent != expected:
                    raise CollectiveMismatchError(
                        f"rank {self.rank}: {self.desc}: rank {i} sends {sent} rows to rank "
                        f"{j} (its input_splits[{j}]) but rank {j} expects {expected} "
                        f"(its output_splits[{i}]); every rank's out is untouched"
                    )

    def start(self) -> None:
        x, out = self.call.x, self.call.out
        assert x is not None and out is not None
        n, r = self.n, self.rank
        self.result = out
        input_splits, output_splits = self.splits
        row_nbytes = x.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
        in_base = [o * row_nbytes for o in split_offsets(input_splits)]
        out_base = [o * row_nbytes for o in split_offsets(output_splits)]
        self.out_base = out_base
        self.expect_nbytes = [s * row_nbytes for s in output_splits]
        self.out_u8 = out.reshape(-1).view(np.uint8)
        x_u8 = x.reshape(-1).view(np.uint8)
        self.own_src = x_u8[in_base[r] : in_base[r + 1]]
        self.own_dst = self.out_u8[out_base[r] : out_base[r + 1]]
        if n == 1:
            self.own_dst[...] = self.own_src
        chunk = self.comm.chunk_bytes
        self.spans = [chunk_spans(b, chunk, x.itemsize) for b in self.expect_nbytes]
        self.heard_splits: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        whole = (*input_splits, *output_splits)  # the first piece to each peer says it
        data = byte_view(x)
        dtype = x.dtype.str
        for k in range(1, n):
            peer = (r + k) % n
            nbytes = in_base[peer + 1] - in_base[peer]
            self.will_send(peer, 1)
            spans = chunk_spans(nbytes, chunk, x.itemsize)
            base = in_base[peer]
            for j, (off, length) in enumerate(spans):
                self.send_piece(
                    peer,
                    0,
                    j,
                    len(spans),
                    nbytes,
                    off,
                    data[base + off : base + off + length],
                    dtype,
                    shape=whole if j == 0 else None,
                )
        for k in range(1, n):
            self.expect((r - k) % n, 1)
        self.post_inboxes()

    def on_data(self, peer: int, header: Header, payload: memoryview) -> None:
        if header.nbytes != self.expect_nbytes[peer]:
            raise CollectiveMismatchError(
                f"rank {self.rank}: {self.desc}: rank {peer} sends {header.nbytes} bytes but "
                f"output_splits[{peer}] says {self.expect_nbytes[peer]} (its input_splits"
                f"[{self.rank}] and this rank's output_splits[{peer}] differ)"
            )
        off, length = self.piece_span(peer, header, payload, self.spans[peer])
        if not self.touched:  # the first matching piece: now out may be written
            self.touched = True
            self.own_dst[...] = self.own_src
        if length:
            at = self.out_base[peer] + off
            self.out_u8[at : at + length] = np.frombuffer(payload, np.uint8)
