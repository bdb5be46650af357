"""Point-to-point operations: chunked, pipelined send and receive.

A send cuts the buffer into ``chunk_bytes`` pieces (:func:`chunk_spans`) and queues them
all at once; large pieces go zero-copy, so libzmq streams piece k+1 while the receiver
copies piece k into the caller's buffer straight from the received frame. A send is done
when libzmq has released every piece (the caller may then reuse its buffer).

Matching: messages with the same (source, group, tag) are received in the order sent (no
overtaking, as in MPI); a receive posted before its message arrives is fed pieces as they
come, otherwise the pieces wait in the engine's unexpected queue.

Any source (:data:`ANY_SOURCE`): the receive matches the first message with its tag from
any rank of the group (the earliest arrived, or the first to arrive; a receive naming the
sender that was posted earlier matches first) and is then bound to that sender
(:meth:`Progress.post_any`), so the rule above still holds per sender. Its result is the
sender's group rank (also ``Work.source``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ringcomm.core.progress import Op, Progress
from ringcomm.errors import MessageMismatchError, RingcommError
from ringcomm.schedule.chunks import chunk_spans
from ringcomm.transport.wire import KIND_P2P, Header, dtype_to_wire, pack_header

__all__ = ["ANY_SOURCE", "AnySource", "RecvOp", "SendOp"]


class AnySource:
    """The type of :data:`ANY_SOURCE` (use that one instance). Not an int, so that a negative rank
    passed by mistake is still refused at the call."""

    def __repr__(self) -> str:
        return "ringcomm.ANY_SOURCE"

    def __reduce__(self) -> str:
        return "ANY_SOURCE"  # pickled as the module's constant: stays the one instance


#: ``recv(x, src=ANY_SOURCE)``: take the next message with the tag from any rank (MPI's
#: ``MPI_ANY_SOURCE``; ``src=None`` means the same).
ANY_SOURCE = AnySource()


class SendOp(Op):
    fails_group = False  # a failed send or receive leaves the group usable

    def __init__(
        self,
        progress: Progress,
        x: np.ndarray,
        *,
        src_global: int,
        dst_global: int,
        dst: int,
        group_id: int,
        tag: int,
        chunk_bytes: int,
        async_op: bool = False,
    ) -> None:
        super().__init__(progress, async_op=async_op)
        self.x = x
        self.dst = dst
        self.src_global = src_global
        self.dst_global = dst_global
        self.group_id = group_id
        self.tag = tag
        self.chunk_bytes = chunk_bytes
        self.sent_pieces = 0
        self.npieces = 0

    def describe(self) -> str:
        return f"send to peer {self.dst} (op send, tag {self.tag}, {self.x.dtype}[{self.x.size}])"

    def start(self) -> None:
        data = self.x.reshape(-1).view(np.uint8)
        mv = memoryview(data)  # type: ignore[arg-type]
        for header, off, length in self.pieces():
            self.add_tracker(
                self.progress.send(
                    self.dst_global, None, pack_header(header), mv[off : off + length], length
                )
            )
            self.sent_pieces = header.piece + 1
        self.settle()

    def pieces(self) -> Iterator[tuple[Header, int, int]]:
        """The message cut into ``chunk_bytes`` pieces, one at a time: each one's header,
        offset and length in bytes (the first header says the shape). Sets ``npieces``."""
        x = self.x
        spans = chunk_spans(x.nbytes, self.chunk_bytes, x.itemsize)
        self.npieces = n = len(spans)
        dtype = dtype_to_wire(x.dtype)
        for i, (off, length) in enumerate(spans):
            header = Header(
                KIND_P2P,
                self.src_global,
                self.group_id,
                self.tag,
                0,
                i,
                n,
                dtype,
                x.nbytes,
                off,
                tuple(x.shape) if i == 0 else None,
            )
            yield header, off, length

    def progress_note(self) -> str:
        return f"{self.sent_pieces}/{self.npieces} pieces queued, waiting for the transport to release the buffer"


class RecvOp(Op):
    fails_group = False

    def __init__(
        self,
        progress: Progress,
        x: np.ndarray,
        *,
        src_global: int | None,
        src: int | None,
        group_id: int,
        tag: int,
        rank: int,
        async_op: bool = False,
        ranks: tuple[int, ...] = (),
    ) -> None:
        """``src``/``src_global`` None: any source among ``ranks`` (the group's global
        ranks, in group-rank order); the result is then the sender's group rank."""
        super().__init__(progress, async_op=async_op)
        self.x = x
        self.data = x.reshape(-1).view(np.uint8)
        self.any_source = src_global is None
        self.key = (-1 if src_global is None else src_global, group_id, KIND_P2P, tag)
        #: The sender's group rank (None until an any-source receive is bound).
        self.source = src
        self.src = src
        self.tag = tag
        self.rank = rank
        self.group_id = group_id
        self.got = 0
        self.npieces = 0
        self.mismatch: MessageMismatchError | None = None
        self.result: Any = x
        self.order = 0
        self.sources = frozenset(ranks) if self.any_source else frozenset()
        self._group_rank = {g: r for r, g in enumerate(ranks)} if self.any_source else {}

    def describe(self) -> str:
        if self.any_source:
            bound = "" if self.source is None else f", matched peer {self.source}"
            peer = f"any peer{bound}"
        else:
            peer = f"peer {self.src}"
        return f"recv from {peer} (op recv, tag {self.tag}, {self.x.dtype}[{self.x.size}])"

    def start(self) -> None:
        self.order = self.progress.next_order()
        if self.any_source:
            self.progress.post_any(self.group_id, self.tag, self)
        else:
            self.progress.post(self.key, self)

    def bind(self, src: int) -> None:
        """An any-source receive takes its message from global rank ``src``."""
        self.key = (src, self.group_id, KIND_P2P, self.tag)
        self.source = self.src = self._group_rank[src]
        self.result = self.source
        self._desc = ""  # describe() names the sender from now on

    def on_piece(self, header: Header, payload: memoryview) -> bool:
        if self.done:  # finished by a timeout while pieces were in flight: discard them
            self.got += 1
            return self.got >= header.npieces
        if self.got == 0:
            self.npieces = header.npieces
            if header.nbytes != self.x.nbytes or header.dtype != self.x.dtype.str:
                shape = (
                    "?" if header.shape is None else "x".join(map(str, header.shape)) or "scalar"
                )
                self.mismatch = MessageMismatchError(
                    f"rank {self.rank}: recv from peer {self.src} (op recv, tag {self.tag}): "
                    f"message is {header.dtype}[{shape}] ({header.nbytes} bytes) but the "
                    f"buffer is {self.x.dtype.str}[{'x'.join(map(str, self.x.shape)) or 'scalar'}] "
                    f"({self.x.nbytes} bytes); message discarded, buffer untouched"
                )
        if header.piece != self.got or header.npieces != self.npieces:
            self.mismatch = self.mismatch or MessageMismatchError(
                f"rank {self.rank}: recv from peer {self.src} (op recv, tag {self.tag}): "
                f"piece {header.piece}/{header.npieces} arrived, expected {self.got}/{self.npieces}"
            )
        n = len(payload)
        if self.mismatch is None:
            if header.offset + n > self.data.size:
                self.mismatch = MessageMismatchError(
                    f"rank {self.rank}: recv from peer {self.src} (op recv, tag {self.tag}): "
                    f"piece {header.piece} overruns the buffer"
                )
            elif n:
                self.data[header.offset : header.offset + n] = np.frombuffer(payload, np.uint8)
        self.got += 1
        if self.got >= self.npieces:
            self.finish(self.mismatch)
            return True
        return False

    def progress_note(self) -> str:
        if self.got == 0:
            return "no piece of the message has arrived"
        return f"{self.got}/{self.npieces} pieces received"

    def on_timeout(self, error: RingcommError) -> bool:
        if self.got == 0:
            # Nothing consumed yet: withdraw cleanly, later messages match later receives.
            if self.any_source and self.key[0] == -1:
                self.progress.unpost_any(self.group_id, self.tag, self)
            else:
                self.progress.unpost(self.key, self)
            return True
        # Part of the message was consumed: keep discarding the rest (on_piece checks
        # ``done``), but the caller's buffer holds a partial message.
        return True
