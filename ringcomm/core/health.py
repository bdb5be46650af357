"""Liveness of the peers: goodbyes, departures, dropped connections, failure.

A peer that said goodbye has *departed*, which is no failure; one whose connection dropped
without a goodbye is a *suspect* for :data:`SUSPECT_GRACE_S` (its goodbye may still be in
flight), then *failed*. A failure is final for the engine: :meth:`Health.fail` records the
first one, tells every live peer and has the engine fail every operation (``on_failure``).
A departed peer that something here still waits on (or sends to) is *orphaned*: the engine
fails for it at the start of its next round. Connection events are read at most every
:data:`HEALTH_CHECK_S`, from the driving thread's rounds, never per message. Everything here
runs under the engine's driver lock but :meth:`Health.farewell`, which takes none.
See docs/architecture.md, "The progress engine".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ringcomm.core.control import (
    CTRL_PEER_FAILED,
    CTRL_TEXT_MAX,
    bye_frame,
    is_list,
    send_ctrl,
)
from ringcomm.core.lifecycle import DEPART_ERROR, DEPART_EXIT
from ringcomm.errors import PeerFailedError, RingcommError
from ringcomm.transport.base import EVENT_DISCONNECTED, EVENT_HANDSHAKE_OK, Transport

__all__ = [
    "DEPARTURE_NOTES",
    "DEPART_CLOSE",
    "FAREWELL_S",
    "GOODBYE_MIN_S",
    "HEALTH_CHECK_S",
    "SUSPECT_GRACE_S",
    "Health",
]

log = logging.getLogger("ringcomm")

#: How often a driving thread looks at connection events (a time check per round).
HEALTH_CHECK_S = 0.05
#: How long a peer whose connection dropped has for its goodbye to arrive.
SUSPECT_GRACE_S = 0.3
#: Shortest wait for goodbyes to be written out at close (even with no linger).
GOODBYE_MIN_S = 0.5
#: Longest a rank going down waits for its farewells to be written out (to a peer that
#: is gone already, libzmq would hold one until then).
FAREWELL_S = 0.25

#: How a rank leaves (``Progress.close``, :meth:`Health.farewell`); the other two kinds
#: are the process's exit paths (lifecycle.py).
DEPART_CLOSE = "close"
DEPARTURE_NOTES = {
    DEPART_CLOSE: "it closed its process group",
    DEPART_EXIT: "its process ended without closing its process group",
}


class Health:
    """What this rank knows of its peers' liveness, and the engine's failure.

    ``on_failure()``: called once, when the engine fails (it fails every operation);
    ``drain()``: dispatches what has arrived (a goodbye may wait on the socket).
    """

    def __init__(
        self,
        transport: Transport,
        rank: int,
        on_failure: Callable[[], None],
        drain: Callable[[], object],
    ) -> None:
        self.transport = transport
        self.rank = rank
        self.on_failure = on_failure
        self.drain = drain
        #: The engine's failure (the first one), once it failed.
        self.failure: RingcommError | None = None
        self.failed_peers: set[int] = set()
        self.departed: set[int] = set()  # peers that said goodbye
        self.departure: dict[int, str] = {}  # peer -> how it left (DEPARTURE_NOTES)
        #: Departed peers that a receiver still waits on (or a send goes to): they fail the
        #: engine at the start of the next round (found where failing at once is unsafe).
        self.orphaned: set[int] = set()
        self.said_goodbye = False
        self.disconnected: set[int] = set()  # peers whose connection dropped (not back)
        self.suspects: dict[int, float] = {}  # peer -> when its connection dropped
        #: When the driving thread next looks at connection events (``time.monotonic()``).
        self.next_check = time.monotonic() + HEALTH_CHECK_S

    # -- reading the transport's connection events -----------------------------------
    def check(self, drain: bool = True) -> None:
        """Look at connection events; declare peers failed.

        ``drain=False``: from inside a dispatch (a wait for a zero-copy release), where
        the socket must not be read; a goodbye still waiting there is then not seen.
        """
        now = time.monotonic()
        self.next_check = now + HEALTH_CHECK_S
        for peer, event in self.transport.poll_events():
            if event == EVENT_DISCONNECTED:
                self.disconnected.add(peer)
                if peer in self.departed or peer in self.failed_peers:
                    continue
                if self.said_goodbye:
                    # We are closing (every operation is over): a peer that had our
                    # goodbye may leave without one of its own to us (the store's host
                    # still waits for check-outs then): a departure, not a failure.
                    self.departed.add(peer)
                    self.departure[peer] = DEPARTURE_NOTES[DEPART_CLOSE]
                    log.debug("rank %d: rank %d disconnected after our goodbye", self.rank, peer)
                else:
                    self.suspects.setdefault(peer, now)
            elif event == EVENT_HANDSHAKE_OK:
                self.suspects.pop(peer, None)  # reconnected: alive after all
                self.disconnected.discard(peer)
        if not self.suspects:
            return
        due = [p for p, t in self.suspects.items() if now - t >= SUSPECT_GRACE_S]
        if not due:
            return
        if drain:
            self.drain()  # a goodbye may be waiting on the socket
        for peer in due:
            if self.suspects.pop(peer, None) is not None and peer not in self.departed:
                self.peer_failed(peer)

    # -- failure -----------------------------------------------------------------------
    def peer_failed(self, peer: int, reporter: int | None = None, text: str = "") -> None:
        """Global rank ``peer`` failed: its connection dropped without a goodbye (or its
        login was refused), or peer ``reporter`` said so (``text``)."""
        if reporter is None and peer in self.transport.refused_by:
            why = (
                f"peer rank {peer} refused this rank's data-plane login: token mismatch (or "
                "a reconnection, whose login was used already); every rank must use the "
                "job's token"
            )
        elif reporter is None:
            why = (
                f"peer rank {peer} failed: its connection dropped without a goodbye "
                f"(killed, crashed, or silent for {self.transport.heartbeat_timeout_s:g} s)"
            )
        else:
            why = f"peer rank {peer} failed (reported by rank {reporter}: {text})"
        self.fail(PeerFailedError(f"rank {self.rank}: {why}", peer=peer), peer=peer)

    def fail(self, error: RingcommError, peer: int, tell_peers: bool = True) -> None:
        """The engine fails for good because of ``peer``: every unfinished op and every
        later one raise (the first failure is kept)."""
        self.failed_peers.add(peer)
        if self.failure is not None:
            return
        self.failure = error
        log.warning("%s", error)
        if tell_peers:
            fp = [peer, str(error)[:CTRL_TEXT_MAX]]
            for q in self.live_peers():
                send_ctrl(self.transport, self.rank, q, CTRL_PEER_FAILED, fp)
        self.on_failure()

    def failed_error(self, what: str) -> RingcommError:
        """A fresh error for ``what`` (an op) after the engine failed."""
        failure = self.failure
        assert failure is not None
        text = f"rank {self.rank}: {what}: the process group failed: {failure}"
        if isinstance(failure, PeerFailedError):
            return PeerFailedError(text, peer=failure.peer)
        err = type(failure)(text)
        err.__cause__ = failure
        return err

    def live_peers(self) -> list[int]:
        """The peers (global ranks, not this one) that neither departed nor failed."""
        gone = self.failed_peers | self.departed
        return [p for p in self.transport.peers() if p not in gone and p != self.rank]

    # -- departures --------------------------------------------------------------------
    def on_goodbye(self, src: int, fp: Any) -> bool:
        """Peer ``src`` leaves (its goodbye's fingerprint ``fp``, from the wire): a failure
        if it goes down with an error. True if it newly departed without one: the engine
        then checks whether anything still waits on it (:meth:`fail_orphaned`)."""
        self.suspects.pop(src, None)
        if src in self.departed:
            return False
        self.departed.add(src)
        kind = fp[0] if is_list(fp, 2) else DEPART_CLOSE
        if kind == DEPART_ERROR:
            why = str(fp[1])[:CTRL_TEXT_MAX]
            self.fail(
                PeerFailedError(f"rank {self.rank}: peer rank {src} exited: {why}", peer=src),
                peer=src,
            )
            return False
        self.departure[src] = DEPARTURE_NOTES.get(kind, DEPARTURE_NOTES[DEPART_CLOSE])
        return True

    def fail_orphaned(self) -> None:
        """Fail the engine for a departed peer that something here still needs."""
        peer = min(self.orphaned)
        self.orphaned.clear()
        note = self.departure_note(peer)
        self.fail(
            PeerFailedError(
                f"rank {self.rank}: peer rank {peer} left the group ({note}) while this "
                "rank still expected messages from it or sent it more",
                peer=peer,
            ),
            peer=peer,
        )

    def gone(self, peer: int) -> bool:
        """Whether global rank ``peer`` said goodbye or failed."""
        return peer in self.departed or peer in self.failed_peers

    def departure_note(self, peer: int) -> str:
        """How global rank ``peer`` left ("it closed its process group", ...), once it did."""
        return self.departure.get(peer, DEPARTURE_NOTES[DEPART_CLOSE])

    # -- leaving -----------------------------------------------------------------------
    def say_goodbye(self, linger_s: float, kind: str, read_control: Callable[[], None]) -> None:
        """Tell every live peer we are leaving (so our disconnection is no failure) and
        wait, up to ``linger_s``, until libzmq took each goodbye (and so everything queued
        before it) off its queue, or the peer left or failed itself. A peer that closed
        first can never take our goodbye: waiting for it (libzmq's linger) would cost the
        whole ``linger_s``, so the wait ends for it as soon as its own goodbye is read
        (``read_control()``: act on the goodbyes and failure reports that arrived)."""
        read_control()
        linger_s = max(linger_s, GOODBYE_MIN_S)  # even a failed group says goodbye
        frame = bye_frame(self.rank, None if kind == DEPART_CLOSE else [kind, ""])
        pending = {}
        for peer in self.live_peers():
            try:
                pending[peer] = self.transport.send_tracked(peer, frame)
            except Exception as exc:  # noqa: BLE001 (best effort, as every control message)
                log.debug("rank %d: goodbye to rank %d not sent: %r", self.rank, peer, exc)
        give_up_at = time.monotonic() + linger_s
        while True:
            gone = self.failed_peers | self.departed
            pending = {p: t for p, t in pending.items() if not t.done and p not in gone}
            remaining = give_up_at - time.monotonic()
            if not pending or remaining <= 0:
                return
            if self.transport.poll(min(remaining, 0.005)):
                read_control()

    def farewell(
        self, why: str, timeout_s: float = FAREWELL_S, skip: Callable[[int], bool] | None = None
    ) -> None:
        """Tell every live peer this rank goes down because of ``why`` (their calls then
        raise :class:`PeerFailedError` saying ``rank N exited: why``).

        Takes no lock and touches no data socket (:meth:`ZmqTransport.send_farewell`), so
        it may run from a signal handler that interrupted the engine's driver.
        ``skip(peer)``: True for peers not to tell (known to be gone).
        """
        frame = bye_frame(self.rank, [DEPART_ERROR, why[:CTRL_TEXT_MAX]])
        # Peers that said goodbye are told too (one may still wait for check-outs); not
        # those that dropped without one (dead: a farewell to them would only linger).
        try:
            dead = self.failed_peers - self.departed
            peers = [p for p in self.transport.peers() if p != self.rank and p not in dead]
        except RuntimeError:  # a set changed under us (another thread): tell everyone
            peers = [p for p in self.transport.peers() if p != self.rank]
        if skip is not None:  # e.g. peers known to be gone
            peers = [p for p in peers if not skip(p)]
        self.transport.send_farewell(frame, peers, timeout_s)
