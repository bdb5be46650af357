"""The fast lane: a blocking one-step exchange of one-piece messages (the small all_reduce)
carried out without the engine's bookkeeping while nothing else needs the engine.

It sends, takes its peers' messages off the socket on the calling thread (dispatching
everyone else's as a round would) and gives up on anything unusual: a message with another
fingerprint or layout, an abort of the call, the engine needing more than dispatching, or a
wait longer than one poll slice. Giving up leaves the messages it took at the front of the
unexpected queues, so the call's regular operation takes over as if nothing had happened:
the lane keeps every guarantee of the regular path. :meth:`Progress.exchange
<ringcomm.core.progress.Progress.exchange>` holds the driver lock around it and decides
when it may run. See docs/architecture.md, "The progress engine".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ringcomm.core.aborts import Call, GroupAborts
from ringcomm.core.health import Health
from ringcomm.core.matching import Key, Matching, Message
from ringcomm.errors import RingcommError
from ringcomm.transport.base import Stream, Transport
from ringcomm.transport.wire import KIND_CTRL

__all__ = ["FAST_LANE_SPIN_S", "FastLane"]

#: How long the fast lane looks for its messages without sleeping, yielding the core
#: between looks, before it blocks (ZmqTransport.poll).
FAST_LANE_SPIN_S = 200e-6


@dataclass(eq=False, repr=False)
class FastLane:
    """The lane of one engine. ``recv(ready)``: the next message off the socket (the
    engine's, None: none; False: a malformed one); ``busy()``: whether the engine needs
    more than dispatching (a submission from another thread, loopback or tracked sends,
    closing)."""

    transport: Transport
    matching: Matching
    health: Health
    aborts: GroupAborts
    recv: Callable[[bool], Message | Literal[False] | None]
    busy: Callable[[], bool]
    #: The lane's one-message streams (reset per use).
    stream: Stream = field(init=False, default_factory=Stream)

    def run(
        self,
        call: Call,
        header: bytes,
        payload: Any,
        nbytes: int,
        peers: Sequence[int],
        keys: Sequence[Key],
        fp: Any,
        deadline: float,
        slice_s: float,
        got: dict[Key, Message],
    ) -> list[memoryview] | RingcommError | None:
        """Send ``header`` and ``payload`` (``nbytes``) to each of ``peers`` and collect
        one message per ``keys`` entry into ``got`` (driver lock held, the engine idle).

        Returns the payloads in ``keys`` order once each arrived whole (one piece of
        ``nbytes``) with fingerprint ``fp``; else gives up, leaving what it took in
        ``got``: None (the call goes the regular way), or the error that fails the call
        (the engine failed, or a peer aborted the call). It waits at most ``slice_s``,
        and never past ``deadline`` (``time.monotonic()``).
        """
        transport = self.transport
        matching = self.matching
        stream = self.stream  # the call's only message to each peer: nothing to overtake
        stream.ordered = None
        for peer in peers:
            transport.send(peer, stream, header, payload, nbytes)  # copied: below zero-copy
        for key in keys:  # what arrived before we asked, as a posted receiver is fed it
            queued = matching.take(key)
            if queued is not None:
                got[key] = queued
                h, data = queued
                if h.fp != fp or h.npieces != 1 or len(data) != nbytes:
                    return None
        give_up_at = min(deadline, time.monotonic() + slice_s)
        recv, dispatch, health = self.recv, matching.dispatch, self.health
        while len(got) < len(keys):
            if health.failure is not None:
                return health.failed_error(call.desc)
            if self.busy():
                return None
            remaining = give_up_at - time.monotonic()
            if remaining <= 0:
                return None
            if not transport.poll(remaining, FAST_LANE_SPIN_S):
                continue
            ready = True
            while len(got) < len(keys):
                message = recv(ready)
                ready = False
                if message is None:
                    break
                if message is False:
                    continue
                h, data = message
                key = (h.src, h.group, h.kind, h.tag)
                if key in got or key not in keys:
                    dispatch(h, data)
                    if h.kind == KIND_CTRL and self.aborts.known:
                        aborted = self.aborts.call_error(call)
                        if aborted is not None:  # a peer failed this call
                            return aborted
                    continue
                got[key] = message
                if h.fp != fp or h.npieces != 1 or len(data) != nbytes:
                    return None
        return [got[key][1] for key in keys]

    def reply(
        self,
        make: Callable[[list[memoryview]], tuple[bytes, Any]],
        to: Sequence[int],
        payloads: list[memoryview],
        nbytes: int,
    ) -> None:
        """Send ``make(payloads)`` (a header and a payload of ``nbytes``) to each global
        rank in ``to`` (the star all_reduce's rank 0, once every message is in)."""
        answer, data = make(payloads)
        send, stream = self.transport.send, self.stream
        stream.ordered = None
        for peer in to:  # the call's only message to each peer: nothing to overtake
            send(peer, stream, answer, data, nbytes)
