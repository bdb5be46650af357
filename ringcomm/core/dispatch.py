"""Dispatch: what arrives on the transport goes to its receiver, or is acted on here.

Messages are taken off the socket without blocking, at most :data:`MAX_DISPATCH_PER_ROUND`
per round, and handed to :meth:`Matching.dispatch <ringcomm.core.matching.Matching.dispatch>`
in arrival order; malformed ones are dropped and counted. Control messages (never matched)
come back here: goodbyes and failure reports (to :mod:`~ringcomm.core.health`), aborts of
collectives (to :mod:`~ringcomm.core.aborts`, then the engine fails its calls), and the
progress query, by which a rank whose operation timed out asks every peer where it is.
Everything here runs under the engine's driver lock. See docs/architecture.md, "The
progress engine".
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ringcomm.core.aborts import GroupAborts
from ringcomm.core.control import (
    CTRL_ABORT,
    CTRL_BYE,
    CTRL_PEER_FAILED,
    CTRL_QUERY,
    CTRL_STATE,
    CTRL_TEXT_MAX,
    is_list,
    send_ctrl,
)
from ringcomm.core.health import Health
from ringcomm.core.matching import Matching, Message
from ringcomm.transport.base import ZERO_COPY_MIN_BYTES, Transport
from ringcomm.transport.wire import KIND_CTRL, Header, WireError, unpack_header

__all__ = ["MAX_DISPATCH_PER_ROUND", "QUERY_WAIT_S", "Dispatcher"]

#: Most messages dispatched in one round before new submissions are admitted.
MAX_DISPATCH_PER_ROUND = 4096
#: How long a timed-out operation waits for its peers' answers to "where are you?".
QUERY_WAIT_S = 0.25


class Done(Protocol):
    """An operation a drain may stop for (an :class:`~ringcomm.core.progress.Op`)."""

    done: bool


@dataclass(eq=False, repr=False)
class Dispatcher:
    """Reads and routes one engine's incoming messages.

    ``where()``: where this rank is (its unfinished operations), for the progress query;
    ``fail_collectives(group_id, seq)``: a peer aborted that collective of the group (the
    engine fails its calls from ``seq`` on); ``closed()``: whether the engine closed.
    """

    transport: Transport
    rank: int
    matching: Matching
    health: Health
    aborts: GroupAborts
    where: Callable[[], str]
    fail_collectives: Callable[[int, int], None]
    closed: Callable[[], bool]
    query_ids: itertools.count[int] = field(init=False, default_factory=lambda: itertools.count(1))
    #: The progress query under way: ``(query id, answers per global rank)``.
    query: tuple[int, dict[int, str]] | None = field(init=False, default=None)

    # -- reading the transport ---------------------------------------------------------
    def drain(self, until: Done | None = None, ready: bool = False) -> int:
        """Dispatch what has arrived (without blocking); return how many messages.

        ``until``: stop as soon as that op is done; ``ready``: a poll just said a message
        is waiting.
        """
        recv, dispatch = self.recv, self.matching.dispatch
        n = 0
        for n in range(1, MAX_DISPATCH_PER_ROUND + 1):
            if until is not None and until.done:
                return n - 1
            message = recv(ready)
            ready = False
            if message is None:
                return n - 1
            if message is not False:
                dispatch(*message)
        return n

    def recv(self, ready: bool = False) -> Message | Literal[False] | None:
        """The next message as ``(header, payload)`` without blocking; None if none is
        waiting; False for a malformed one (dropped and counted).

        ``ready``: a poll just said a message is waiting.
        """
        transport = self.transport
        first = transport.recv_first(ready)
        if first is None:
            return None
        raw_header, more = first
        try:
            header, inline = unpack_header(raw_header)
        except WireError:
            if more:
                transport.recv_payload(copy=True)
            self.matching.dropped_frames += 1
            return False
        if inline is not None:
            if more:  # an inline payload and a payload frame: malformed
                transport.recv_payload(copy=True)
                self.matching.dropped_frames += 1
                return False
            return header, memoryview(inline)
        if more:
            # Small payloads are copied out of libzmq (cheaper than a zero-copy frame).
            payload = transport.recv_payload(header.nbytes < ZERO_COPY_MIN_BYTES, header.src)
            if payload is False:
                self.matching.dropped_frames += 1
                return False
            return header, payload  # type: ignore[return-value]
        self.matching.dropped_frames += 1  # a header without its payload
        return False

    def read_control(self) -> None:
        """Take what arrived off the socket, acting on goodbyes and failure reports only
        (the group is closing: nothing may reach a receiver any more)."""
        known_src = self.matching.known_src
        for _ in range(MAX_DISPATCH_PER_ROUND):
            message = self.recv()
            if message is None:
                return
            if message is not False and message[0].kind == KIND_CTRL:
                header = message[0]
                if header.src in known_src and header.tag in (CTRL_BYE, CTRL_PEER_FAILED):
                    self.on_ctrl(header)

    # -- control messages --------------------------------------------------------------
    def on_ctrl(self, header: Header) -> None:
        """Handle a control message (its contents came off the wire: check everything)."""
        src, tag, fp = header.src, header.tag, header.fp
        if tag == CTRL_BYE:
            self.on_goodbye(src, fp)
        elif tag == CTRL_PEER_FAILED and is_list(fp, 2) and type(fp[0]) is int:
            dead = fp[0]
            if dead != self.rank and dead not in self.health.failed_peers:
                self.health.peer_failed(dead, reporter=src, text=str(fp[1])[:CTRL_TEXT_MAX])
        elif tag == CTRL_QUERY and is_list(fp, 1) and type(fp[0]) is int:
            answer = [fp[0], self.where()[:CTRL_TEXT_MAX]]
            send_ctrl(self.transport, self.rank, src, CTRL_STATE, answer)
        elif tag == CTRL_STATE and is_list(fp, 2) and type(fp[0]) is int:
            query = self.query
            if query is not None and query[0] == fp[0]:
                query[1][src] = str(fp[1])[:CTRL_TEXT_MAX]
        elif tag == CTRL_ABORT and is_list(fp, 5) and all(type(fp[i]) is int for i in (0, 1, 4)):
            # Peer src's collective fp[1] of group fp[0] failed, because of global rank
            # fp[4] (a PeerFailedError's peer; -1: src itself): fail ours from it on.
            culprit = fp[4] if 0 <= fp[4] != self.rank else src
            kind, text = str(fp[2])[:64], str(fp[3])[:CTRL_TEXT_MAX]
            if self.aborts.record(culprit, fp[0], fp[1], kind, text, src):
                self.fail_collectives(fp[0], fp[1])
        else:
            self.matching.dropped_frames += 1

    def on_goodbye(self, src: int, fp: Any) -> None:
        """Peer ``src`` leaves: a failure if it goes down with an error; else a departure,
        which fails the engine only if something here still waits on ``src``."""
        health = self.health
        if health.on_goodbye(src, fp) and self.matching.awaits(src):
            health.orphaned.add(src)
            health.fail_orphaned()

    # -- the progress query ------------------------------------------------------------
    def progress_map(self, wait_s: float = QUERY_WAIT_S) -> str:
        """Ask every live peer where it is (answers within ``wait_s``); lines per rank.

        Peers answer from their own driving thread, so a peer busy outside ringcomm (or
        hung, or dead) shows as not answering.
        """
        health, transport = self.health, self.transport
        peers = health.live_peers()
        qid = next(self.query_ids)
        answers: dict[int, str] = {}
        self.query = (qid, answers)
        try:
            for peer in peers:
                send_ctrl(transport, self.rank, peer, CTRL_QUERY, [qid])
            give_up_at = time.monotonic() + wait_s
            while len(answers) < len(peers):
                remaining = give_up_at - time.monotonic()
                if remaining <= 0 or self.closed():
                    break
                if transport.poll(remaining):
                    self.drain(ready=True)
        finally:
            self.query = None
        lines = [f"  rank {self.rank} (this rank): {self.where()}"]
        for peer in transport.peers():
            if peer == self.rank:
                continue
            if peer in answers:
                lines.append(f"  rank {peer}: {answers[peer]}")
            elif peer in health.failed_peers:
                lines.append(f"  rank {peer}: failed")
            elif peer in health.departed:
                lines.append(f"  rank {peer}: left the group ({health.departure.get(peer)})")
            else:
                lines.append(
                    f"  rank {peer}: no answer within {wait_s:g} s (busy outside ringcomm, "
                    "hung, or unreachable)"
                )
        return "where each rank was:\n" + "\n".join(lines)
