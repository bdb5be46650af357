"""The data plane over ZeroMQ: one bound receive socket per rank, one send socket per peer.

Each rank binds a PULL socket (ipc:// and tcp://) and connects a PUSH socket to every peer
when the group forms; ZeroMQ keeps the order of messages from one PUSH to one PULL, which is
all the matching layer above needs. Same-host peers also get the datagram lane
(``unix_lane``) and shared-memory slots (``shm_lane``), both keeping that order.

Invariants: not thread-safe (the progress engine calls it under its driver lock; only
:meth:`ZmqTransport.wake` may be called from any thread); a dead or silent peer shows up as
a ``DISCONNECTED`` event from :meth:`ZmqTransport.poll_events`, never on the message path;
with a token, no frame of an unauthenticated connection reaches the socket and no frame
exceeds ``max_message_bytes``. Liveness, authentication and copies: docs/architecture.md,
section "transport/zmq_transport.py".
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import math
import os
import resource
import struct
import time
from collections.abc import Collection
from typing import Any, cast

import zmq
from zmq.utils import z85

from ringcomm.errors import RingcommError
from ringcomm.transport import shm_lane
from ringcomm.transport.base import (
    EVENT_DISCONNECTED,
    EVENT_HANDSHAKE_OK,
    INLINE_MAX_BYTES,
    LANE_MAX_PAYLOAD_BYTES,
    ZERO_COPY_MIN_BYTES,
    Completion,
    Stream,
)
from ringcomm.transport.endpoints import ipc_path, release_private_dir
from ringcomm.transport.session import LoginCheck, job_key, plain_login
from ringcomm.transport.shm_lane import ShmSegments
from ringcomm.transport.unix_lane import UnixLane
from ringcomm.transport.wire import inline_frame
from ringcomm.transport.zap import ZapHandler

__all__ = [
    "EVENT_DISCONNECTED",
    "EVENT_HANDSHAKE_OK",
    "SECURITY_MODES",
    "ZERO_COPY_MIN_BYTES",
    "Tracker",
    "ZmqTransport",
    "data_plane_credentials",
    "tracker_wait",
]

#: Data-plane authentication mechanisms (module docstring); "none" only without a token.
SECURITY_MODES = ("none", "handshake", "curve")
_ZAP_DOMAIN = "ringcomm"
#: How long a connection has to authenticate (libzmq's default is 30 s).
HANDSHAKE_S = 3.0
#: The default bound on one incoming frame (the group passes its largest piece + slack).
DEFAULT_MAX_MESSAGE_BYTES = (8 << 20) + (64 << 10)
#: Most events read off one monitor socket per look (the rest wait for the next look).
_MAX_EVENTS_PER_LOOK = 256
# Connection events :meth:`ZmqTransport.poll_events` reports (transport/base.py's values).
assert int(zmq.EVENT_DISCONNECTED) == EVENT_DISCONNECTED
assert int(zmq.EVENT_HANDSHAKE_SUCCEEDED) == EVENT_HANDSHAKE_OK
_EVENTS_AUTH_FAILED = (
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH),
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL),
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL),
)
_TX_AUTH_FAILED = int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_TX_EVENTS = EVENT_DISCONNECTED | EVENT_HANDSHAKE_OK | _TX_AUTH_FAILED
_RX_EVENTS = 0
for _e in _EVENTS_AUTH_FAILED:
    _RX_EVENTS |= _e


def data_plane_credentials(token: str) -> dict[str, bytes]:
    """What a token turns into on the data plane (pure; the token itself never travels).

    ``plain_key``: the key of the per-connection PLAIN logins (session.py);
    ``server_secret``/``server_public`` and ``client_secret``/``client_public``: CurveZMQ
    key pairs (Z85), all derived with HMAC-SHA256 under fixed labels, so every rank of a
    job derives the same ones.
    """
    key = token.encode()

    def derive(label: bytes) -> bytes:
        return hmac.new(key, b"ringcomm data plane v1: " + label, hashlib.sha256).digest()

    server_secret = z85.encode(derive(b"curve server"))
    client_secret = z85.encode(derive(b"curve client"))
    return {
        "plain_key": job_key(token, b"plain"),
        "server_secret": server_secret,
        "server_public": zmq.curve_public(server_secret),
        "client_secret": client_secret,
        "client_public": zmq.curve_public(client_secret),
    }


def _raise_fd_limit() -> None:
    """Raise this process's open-file limit to its hard limit: connections that never
    authenticate are closed after :data:`HANDSHAKE_S`, and meanwhile must not take the
    descriptors the application needs."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass


Tracker = zmq.MessageTracker

# Flag values as plain ints: combining pyzmq's enum members costs a microsecond per call.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def tracker_wait(tracker: Tracker, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for libzmq to release a zero-copy payload; True if done."""
    try:
        tracker.wait(timeout_s)
    except zmq.NotDone:
        return False
    return True


class ZmqTransport:
    def __init__(
        self,
        rank: int,
        *,
        tcp_host: str | None = "127.0.0.1",
        use_ipc: bool = True,
        linger_s: float = 3.0,
        token: str | None = None,
        security: str = "handshake",
        heartbeat_ivl_s: float = 1.0,
        heartbeat_timeout_s: float = 4.0,
        rcv_hwm: int = 0,
        lane: bool = False,
        shm: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        handshake_s: float = HANDSHAKE_S,
    ) -> None:
        if security not in SECURITY_MODES:
            raise ValueError(f"security must be one of {SECURITY_MODES}, got {security!r}")
        self.rank = rank
        self.linger_s = linger_s
        #: "handshake" or "curve" with a token; None without one (anyone is admitted).
        self.security = security if token and security != "none" else None
        self.heartbeat_ivl_s = heartbeat_ivl_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # One I/O thread: a rank's traffic is one socket in and a few out, and on small
        # hosts extra I/O threads only compete with the ranks for cores.
        self._ctx = zmq.Context(io_threads=1)
        self._closed = False
        self._auth: ZapHandler | None = None
        self._creds = data_plane_credentials(token) if token and self.security else None
        self._login: LoginCheck | None = None
        #: Published with the endpoints: peers bind their logins to it (session.py).
        self.auth_salt: str | None = None
        self._peer_salts: dict[int, bytes] = {}
        self.auth_failures = 0
        #: Peers that refused our login (their handshake failed: a token mismatch).
        self.refused_by: set[int] = set()
        self._monitors: dict[int, zmq.Socket[Any]] = {}  # peer -> monitor of our socket to it
        _raise_fd_limit()
        self._rx = self._ctx.socket(zmq.PULL)
        # Nothing large before authentication: a frame above the largest piece closes its
        # connection when its size is read, and a handshake gets a few seconds.
        self._rx.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._rx.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_s * 1000)))
        if self._creds is not None:
            self._start_authenticator()
        self._rx_monitor = self._rx.get_monitor_socket(_RX_EVENTS)
        # Unlimited receive queue: the protocol bounds what peers send (every message
        # answers a call the user made), and a full queue would stall a ring in which every
        # rank sends before it receives. Unexpected-message caps live in the engine.
        # ``rcv_hwm`` (messages per connection, 0 = unlimited) bounds what libzmq holds for
        # a peer we are not reading from; the engine caps what it buffers per peer.
        self._rx.setsockopt(zmq.RCVHWM, rcv_hwm)
        self._rx.setsockopt(zmq.LINGER, 0)  # the receive side never has anything to flush
        self.ipc_endpoint: str | None = None
        self.tcp_endpoint: str | None = None
        self._ipc_file: str | None = None
        try:
            if use_ipc:
                path = ipc_path(rank)
                self._rx.bind(f"ipc://{path}")
                self._ipc_file = path
                self.ipc_endpoint = f"ipc://{path}"
            if tcp_host is not None:
                port = self._rx.bind_to_random_port(f"tcp://{tcp_host}")
                self.tcp_endpoint = f"tcp://{tcp_host}:{port}"
        except zmq.ZMQError as exc:
            self.close()
            raise RingcommError(f"rank {rank}: cannot bind data socket: {exc}") from exc
        self._peer_endpoints: dict[int, str] = {}
        self._tx: dict[int, zmq.Socket[Any]] = {}
        # A pipe in the poll set lets another thread interrupt a blocking poll.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll_items: list[tuple[Any, int]] = [(self._rx, _POLLIN), (self._wake_r, _POLLIN)]
        # The same-host lane for one-frame messages (unix_lane.py): not for jobs that ask
        # for encryption, nor without ipc:// (peers elsewhere, or tcp:// forced).
        self._lane: UnixLane | None = None
        self._stash: tuple[bytes, bool] | None = None  # see recv_first
        self._lane_payload: memoryview | None = None  # see _from_lane
        self.lane_endpoint: str | None = None
        if lane and use_ipc and self.security != "curve":
            try:
                self._lane = UnixLane(rank)
            except OSError:
                self._lane = None  # no lane: everything goes over zmq
            else:
                self.lane_endpoint = self._lane.path
                self._poll_items.append((self._lane.fileno, _POLLIN))
        # Large payloads to same-host peers through shared memory (shm_lane.py): set up
        # over the lane by setup_shm, once every peer's lane is known.
        self._shm: ShmSegments | None = (
            ShmSegments(rank) if shm and self._lane is not None and shm_lane.AVAILABLE else None
        )
        self.sent_bytes = 0
        self.sent_messages = 0
        self._framed: tuple[Any, Any, bytes] = (None, None, b"")  # see send

    def _start_authenticator(self) -> None:
        """Make ``_rx`` a ZMTP server whose connections a ZAP handler checks."""
        creds = self._creds
        assert creds is not None
        rx = self._rx
        rx.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN.encode())
        if self.security == "curve":
            rx.setsockopt(zmq.CURVE_SERVER, 1)
            rx.setsockopt(zmq.CURVE_SECRETKEY, creds["server_secret"])
        else:
            self._login = LoginCheck(creds["plain_key"])
            self.auth_salt = self._login.salt.hex()
            rx.setsockopt(zmq.PLAIN_SERVER, 1)
        what = f"rank {self.rank}: refused a data connection"
        self._auth = ZapHandler(self._ctx, self._admit, what)

    def _admit(self, mechanism: bytes, address: str, credentials: list[bytes]) -> bytes | None:
        """The ZAP check (on the handler's thread): a user id, or None to refuse."""
        creds = self._creds
        assert creds is not None
        if self.security == "curve":
            if mechanism != b"CURVE" or len(credentials) != 1:
                return None
            ok = hmac.compare_digest(z85.encode(credentials[0]), creds["client_public"])
            return b"job" if ok else None
        if mechanism != b"PLAIN" or len(credentials) != 2 or self._login is None:
            return None
        src = self._login.check(credentials[0], credentials[1])
        return None if src is None else b"r%d" % src

    # -- peers -------------------------------------------------------------------------
    def set_peer_endpoint(self, peer: int, endpoint: str, salt: str | None = None) -> None:
        """Where ``peer`` listens, and the salt it published (its logins are bound to it)."""
        self._peer_endpoints[peer] = endpoint
        if salt is not None:
            self._peer_salts[peer] = bytes.fromhex(salt)

    def set_peer_lane(self, peer: int, path: str) -> bool:
        """Send lane-safe one-frame messages to ``peer`` through its lane socket
        (same host); False when there is no lane (then they go over zmq)."""
        return self._lane is not None and self._lane.connect(peer, path)

    @property
    def lane_fallbacks(self) -> int:
        """Peers that left the lane (their socket was gone; unix_lane.py)."""
        return 0 if self._lane is None else self._lane.fallbacks

    @property
    def shm_enabled(self) -> bool:
        """This rank takes part in the shared-memory lane (what it tells its peers)."""
        return self._shm is not None

    def setup_shm(self, peers: Collection[int], timeout_s: float) -> list[int]:
        """Exchange shared-memory segments with those of ``peers`` (the ones that said they
        take part) we have a lane to: each sends its segment's descriptor through the lane
        (shm_lane.py). Returns the peers set up; every one of them must do the same within
        ``timeout_s``: RingcommError if not."""
        shm, lane = self._shm, self._lane
        if shm is None or lane is None:
            return []
        peers = sorted(p for p in peers if lane.has(p))
        data = shm_lane.SHM_TAG + b"%d:%d" % (self.rank, shm.segment_bytes())
        to_send = {p: shm.outgoing_fd(p) for p in peers}
        waiting = set(peers)
        deadline = time.monotonic() + timeout_s
        while to_send or waiting:
            for p, fd in list(to_send.items()):
                if lane.send_fd(p, data, fd) is not None:  # sent, or no lane after all
                    del to_send[p]
            got = lane.recv_fds()
            if got is not None:
                self._attach_shm(got, waiting)
            elif time.monotonic() > deadline:
                raise RingcommError(
                    f"rank {self.rank}: no shared-memory segment from ranks "
                    f"{sorted(waiting)} within {timeout_s:g} s"
                    if waiting
                    else f"rank {self.rank}: could not pass segments to ranks {sorted(to_send)}"
                )
            else:
                time.sleep(0.0005)
        return peers

    def _attach_shm(self, got: tuple[bytes, list[int]], waiting: set[int]) -> None:
        data, fds = got
        shm = self._shm
        assert shm is not None
        fields = data[len(shm_lane.SHM_TAG) :].split(b":")
        ok = data.startswith(shm_lane.SHM_TAG) and len(fds) == 1 and len(fields) == 2
        if ok and all(f.isdigit() for f in fields):
            peer, size = int(fields[0]), int(fields[1])
            if peer in waiting and shm.attach(peer, fds[0], size):
                waiting.discard(peer)
                return
        for fd in fds:
            os.close(fd)

    @property
    def shm_pieces(self) -> int:
        """Pieces sent through shared memory instead of the socket."""
        return 0 if self._shm is None else self._shm.sent

    @property
    def lane_messages(self) -> int:
        """Messages sent through the lane (also counted in ``sent_messages``)."""
        return 0 if self._lane is None else self._lane.sent

    def peers(self) -> list[int]:
        """Every peer with a known endpoint (global ranks, ascending)."""
        return sorted(self._peer_endpoints)

    def connect_all(self) -> None:
        """Connect (asynchronously) to every known peer now, so a peer's death is seen
        even by ranks that never send to it (module docstring)."""
        for peer in self._peer_endpoints:
            self._socket_to(peer)

    def poll_events(self) -> list[tuple[int, int]]:
        """Connection events since the last look, as ``(peer, event)``; never blocks.

        Events: ``DISCONNECTED`` (the connection to that peer dropped: the peer died, shut
        down or stopped answering heartbeats) and ``HANDSHAKE_SUCCEEDED``. Failed
        handshakes on our receive socket are counted in ``auth_failures``.
        """
        found: list[tuple[int, int]] = []
        for peer, mon in self._monitors.items():
            for _ in range(_MAX_EVENTS_PER_LOOK):
                event = _read_event(mon)
                if event is None:
                    break
                found.append((peer, event))
        for _ in range(_MAX_EVENTS_PER_LOOK):
            event = _read_event(self._rx_monitor)
            if event is None:
                break
            if event in _EVENTS_AUTH_FAILED:
                self.auth_failures += 1
        for peer, event in found:
            if event == _TX_AUTH_FAILED:
                self.refused_by.add(peer)
        return found

    def _configure_tx(self, sock: zmq.Socket[Any], peer: int) -> None:
        """Options of a send socket to ``peer``: queueing, heartbeats, credentials (a
        login made for this connection)."""
        # Unlimited send queue: sends never block or fail with EAGAIN. Large payloads
        # are zero-copy references to user buffers (no memory), small ones are bounded
        # by the protocol; a bounded queue would deadlock rings where all ranks send
        # first. Flow control comes from the collectives' structure.
        sock.setsockopt(zmq.SNDHWM, 0)
        # Queue messages for a peer whose connection is still being set up (the default,
        # made explicit): connect is asynchronous and we send right after it.
        sock.setsockopt(zmq.IMMEDIATE, 0)
        # Liveness: libzmq's I/O thread pings the peer; no answer within the timeout
        # drops the connection (a DISCONNECTED event, as when the peer dies).
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(self.heartbeat_ivl_s * 1000)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(self.heartbeat_timeout_s * 1000)))
        creds = self._creds
        if creds is not None:
            if self.security == "curve":
                sock.setsockopt(zmq.CURVE_SERVERKEY, creds["server_public"])
                sock.setsockopt(zmq.CURVE_PUBLICKEY, creds["client_public"])
                sock.setsockopt(zmq.CURVE_SECRETKEY, creds["client_secret"])
            else:
                salt = self._peer_salts.get(peer)
                if salt is None:
                    raise RingcommError(f"rank {self.rank}: peer {peer} published no login salt")
                username, password = plain_login(creds["plain_key"], salt, self.rank)
                sock.setsockopt(zmq.PLAIN_USERNAME, username)
                sock.setsockopt(zmq.PLAIN_PASSWORD, password)

    def _socket_to(self, peer: int) -> zmq.Socket[Any]:
        sock = self._tx.get(peer)
        if sock is None:
            try:
                endpoint = self._peer_endpoints[peer]
            except KeyError:
                raise RingcommError(
                    f"rank {self.rank}: no endpoint known for peer {peer}"
                ) from None
            sock = self._ctx.socket(zmq.PUSH)
            self._configure_tx(sock, peer)
            self._monitors[peer] = sock.get_monitor_socket(_TX_EVENTS)
            sock.connect(endpoint)
            self._tx[peer] = sock
        return sock

    # -- sending -----------------------------------------------------------------------
    def send(
        self, peer: int, stream: Stream | None, header: bytes, payload: Any, nbytes: int
    ) -> Tracker | None:
        """Queue one message to ``peer`` (transport/base.py: the path is chosen here).

        ``header``: packed without an inline payload; ``payload``: ``nbytes`` bytes
        (anything with the buffer protocol), or None when ``header`` is a whole one-frame
        message (payload inline, below ``INLINE_MAX_BYTES``). Returns a tracker when the
        payload went zero-copy: while it is not done, libzmq may still read its memory.
        """
        self.sent_bytes += nbytes
        self.sent_messages += 1
        lane = self._lane
        if lane is not None and (
            stream is None or (stream.ordered is not None and peer in stream.ordered)
        ):
            lane = None  # this message must not overtake one sent over zmq (may_overtake)
        if nbytes < INLINE_MAX_BYTES:
            # The same small message to several peers in a row is framed once.
            if payload is None:
                frame = header  # framed by the caller (transport/base.py)
            elif header is self._framed[0] and payload is self._framed[1]:
                frame = self._framed[2]
            else:
                frame = inline_frame(header, payload)
                if type(payload) is bytes:  # immutable: safe to reuse
                    self._framed = (header, payload, frame)
            if lane is not None and lane.send(peer, frame):
                return None
            if stream is not None:
                stream.keep_ordered(peer)
            sock = self._tx.get(peer) or self._socket_to(peer)
            sock.send(frame, _NOBLOCK, copy=True)
            return None
        if (
            lane is not None
            and nbytes < LANE_MAX_PAYLOAD_BYTES
            and lane.send_parts(peer, header, payload)
        ):
            return None
        if stream is not None:
            stream.keep_ordered(peer)
        sock = self._tx.get(peer) or self._socket_to(peer)
        shm = self._shm
        if shm is not None and nbytes >= ZERO_COPY_MIN_BYTES:
            ref = shm.put(peer, payload, nbytes)  # copied: the caller's buffer is free
            if ref is not None:
                sock.send(header, _SNDMORE_NOBLOCK, copy=True)
                sock.send(ref, _NOBLOCK, copy=True)
                return None
        sock.send(header, _SNDMORE_NOBLOCK, copy=True)
        if nbytes >= ZERO_COPY_MIN_BYTES:
            tracker: Tracker = sock.send(payload, _NOBLOCK, copy=False, track=True)
            return tracker
        sock.send(payload, _NOBLOCK, copy=True)
        return None

    def send_tracked(self, peer: int, frame: bytes) -> Tracker:
        """Queue a one-frame message; its tracker is done once libzmq wrote it out (and
        with it every earlier message to ``peer``: one connection keeps their order)."""
        sock = self._tx.get(peer) or self._socket_to(peer)
        tracker: Tracker = sock.send(frame, _NOBLOCK, copy=False, track=True)
        return tracker

    def wait_sent(self, completion: Completion, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for libzmq to release a zero-copy payload; True if
        done (no lock: only libzmq's I/O thread and pyzmq's gc thread finish it)."""
        return tracker_wait(cast(Tracker, completion), timeout_s)

    # -- receiving ---------------------------------------------------------------------
    def poll(self, timeout_s: float, spin_s: float = 0.0) -> bool:
        """Wait up to ``timeout_s`` for an incoming message (or a wake-up).

        ``spin_s``: first look without sleeping for up to that long, yielding the core
        between looks (``sched_yield``: ranks sharing it run meanwhile). A message that
        comes within microseconds is then taken without the sleep and wake-up a blocking
        poll costs (on this VM: 8-byte exchange 12 -> 4 µs at W=2, 48 -> 30 µs at W=4 on
        two cores; benchmarks/results/local_lane.md).
        """
        if self._stash is not None:  # a zmq message recv_first took out is waiting
            return True
        if self._lane is not None and self._lane.holding:
            return True
        if spin_s > 0.0:
            items = self._poll_items
            until = time.monotonic() + min(spin_s, timeout_s)
            while True:
                if zmq.zmq_poll(items, 0):
                    break  # a message or a wake-up: the poll below sorts it out at once
                if time.monotonic() >= until:
                    break
                os.sched_yield()
        # Round up: a positive timeout below 1 ms must not turn into a busy poll(0).
        ready = False
        for item, _ in zmq.zmq_poll(self._poll_items, max(0, math.ceil(timeout_s * 1000))):
            if item is self._rx:
                ready = True
            elif item == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            else:  # the lane
                ready = True
        return ready

    def control_waiting(self) -> bool:
        """A zmq message is waiting (control messages never take the lane): one
        ``getsockopt``, cheaper than a :meth:`recv_first` that finds nothing."""
        return self._stash is not None or bool(cast(int, self._rx.getsockopt(_EVENTS)) & _POLLIN)

    def recv_first(self, ready: bool = False) -> tuple[bytes, bool] | None:
        """First frame of the next message and whether more frames follow; None if idle.

        ``ready``: a poll just said a message is waiting (skips looking again).
        A message with more frames must be finished with :meth:`recv_payload`.
        With a lane, its datagrams come first (one never follows a zmq message on the
        same stream, so handing it out early is safe), and a zmq message is handed out
        only after a look at the lane made after that message was received: a datagram
        sent before it is queued by then (unix_lane.py, "Order") and goes first, while
        the zmq message waits in ``_stash`` (its payload frame, if any, stays next in the
        zmq socket).
        """
        rx = self._rx
        lane = self._lane
        if lane is not None:
            datagram = lane.recv()
            if datagram is not None:
                return self._from_lane(datagram)
            stash = self._stash
            if stash is None:
                if not cast(int, rx.getsockopt(_EVENTS)) & _POLLIN:
                    return None
                try:
                    first = rx.recv(_NOBLOCK, copy=True)
                except zmq.Again:
                    return None
                stash = self._stash = (first, bool(rx.getsockopt(_RCVMORE)))
                datagram = lane.recv()
                if datagram is not None:
                    return self._from_lane(datagram)
            self._stash = None
            return stash
        if not ready and not cast(int, rx.getsockopt(_EVENTS)) & _POLLIN:  # cheaper than zmq.Again
            return None
        try:
            first = rx.recv(_NOBLOCK, copy=True)
        except zmq.Again:
            return None
        return first, bool(rx.getsockopt(_RCVMORE))

    def _from_lane(self, datagram: bytes) -> tuple[bytes, bool]:
        """A datagram as recv_first hands it out: a two-part one is split, its payload kept
        for the recv_payload that follows (a stashed zmq message waits behind it)."""
        parts = UnixLane.split(datagram)
        if parts is None:
            return datagram, False
        header, self._lane_payload = parts
        return header, True

    def recv_payload(self, copy: bool, src: int = -1) -> memoryview | bool:
        """The payload frame after a header: copied (small) or in place in libzmq's buffer,
        or in place in a shared-memory slot when the frame is a reference to one from
        ``src`` (the header's sender; shm_lane.py).

        Returns ``False`` when the message has more than two frames (the rest is consumed)
        or refers to a slot that is not valid.
        """
        lane_payload = self._lane_payload
        if lane_payload is not None:  # the header came through the lane (_from_lane)
            self._lane_payload = None
            return lane_payload  # a view of the datagram, which nothing else holds
        rx = self._rx
        if copy:
            data = memoryview(rx.recv(copy=True))
            more = rx.getsockopt(_RCVMORE)
        else:
            frame = rx.recv(copy=False)
            data, more = frame.buffer, frame.more
        if more:
            while rx.getsockopt(_RCVMORE):
                rx.recv()
            return False
        if self._shm is not None and shm_lane.is_ref(data):
            view = self._shm.take(data, src)
            if view is None:
                return False
            return memoryview(bytes(view)) if copy else view
        return data

    def wake(self) -> None:
        """Interrupt a poll in progress on another thread (thread-safe)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is pending anyway
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise

    def send_farewell(self, frame: bytes, peers: Collection[int], timeout_s: float) -> None:
        """Send the one-frame message ``frame`` to each of ``peers`` over connections of
        its own, made now, and wait up to ``timeout_s`` for libzmq to write them out.

        For a rank that is going down (an uncaught exception, a signal): it may run on a
        thread that interrupted this transport's user between two frames of a message,
        so it touches neither the data sockets nor their context. Order against earlier
        messages is not kept (a peer that reads it fails the group anyway).
        """
        ctx = zmq.Context(io_threads=1)
        try:
            for peer in peers:
                endpoint = self._peer_endpoints.get(peer)
                if endpoint is None:
                    continue
                sock = ctx.socket(zmq.PUSH)
                self._configure_tx(sock, peer)
                sock.setsockopt(zmq.LINGER, max(0, int(timeout_s * 1000)))
                sock.connect(endpoint)
                try:
                    sock.send(frame, _NOBLOCK, copy=True)
                except zmq.ZMQError:
                    pass  # best effort: the peer learns of us from the dropped connection
        finally:
            # Each socket lingers up to timeout_s (all at once): term waits for no more.
            ctx.destroy(linger=max(0, int(timeout_s * 1000)))

    def remove_files(self) -> None:
        """Remove what this rank left in the file system (the ipc:// socket and the
        lane's folder) without closing anything: for a process about to be killed."""
        if self._ipc_file is not None:
            try:
                os.unlink(self._ipc_file)
            except OSError:
                pass
        if self._lane is not None:
            self._lane.remove_files()

    # -- closing -----------------------------------------------------------------------
    def close(self, linger_s: float | None = None, abandon: Collection[int] = ()) -> None:
        """Close every socket; pending outgoing messages get ``linger_s`` to flush, but
        those to the peers in ``abandon`` (gone: nothing can reach them) none."""
        if self._closed:
            return
        self._closed = True
        linger_ms = int(1000 * (self.linger_s if linger_s is None else linger_s))
        for peer, sock in self._tx.items():
            _close_monitor(sock, self._monitors.get(peer))
            sock.close(linger=0 if peer in abandon else linger_ms)
        self._tx.clear()
        self._monitors.clear()
        _close_monitor(self._rx, getattr(self, "_rx_monitor", None))
        self._rx.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        # Every socket above is closed; destroy (not term) also closes any left open
        # (linger 0), so closing never waits on libzmq for more than the lingers above.
        self._ctx.destroy(linger=0)
        if self._lane is not None:
            self._lane.close()
        if self._shm is not None:
            self._shm.close()
        for fd in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self._ipc_file is not None:
            try:
                os.unlink(self._ipc_file)
            except OSError:
                pass
        release_private_dir()


def _read_event(mon: zmq.Socket[Any]) -> int | None:
    """The next event number on a monitor socket, or None (never blocks)."""
    try:
        frames = mon.recv_multipart(_NOBLOCK)
    except zmq.Again:
        return None
    if not frames or len(frames[0]) < 6:
        return None
    return int(struct.unpack_from("=H", frames[0])[0])


def _close_monitor(sock: zmq.Socket[Any], mon: zmq.Socket[Any] | None) -> None:
    if mon is None:
        return
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    mon.close(linger=0)
