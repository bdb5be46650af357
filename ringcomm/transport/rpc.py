"""Request/reply over ZeroMQ: one ROUTER server, many DEALER clients, msgpack maps.

Used by the rendezvous store. :class:`RpcServer`: one daemon thread owns the ROUTER and calls
``handler(call)`` per well-formed request (``None``: reply later with
:meth:`RpcServer.reply`); malformed messages are dropped and counted, never stop it.
:class:`RpcClient`: a DEALER (never a REQ) owned by one I/O thread; any number of threads
call :meth:`RpcClient.call`, each with its own deadline.

Invariants: with sessions, nothing larger than a first contact is decoded before its HMAC
and increasing id are checked (:class:`RpcAuthError` otherwise); once a connection was up
and drops, every pending and later call fails at once with :class:`RpcConnectionLost`
until a handshake succeeds again (nothing queued for later, ``IMMEDIATE``); a timed-out or
failed call may still have run on the server. Frames, sessions and connection loss:
docs/architecture.md, section "transport/rpc.py".
"""

from __future__ import annotations

import heapq
import hmac
import ipaddress
import itertools
import logging
import math
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from ringcomm.errors import CommTimeoutError, RingcommError
from ringcomm.transport.session import MAC_BYTES, NONCE_BYTES, SessionKeys, mac

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "HELLO_MAX_BYTES",
    "RpcAuthError",
    "RpcCall",
    "RpcClient",
    "RpcClosedError",
    "RpcConnectionLost",
    "RpcError",
    "RpcRemoteError",
    "RpcServer",
    "RpcTimeoutError",
    "tcp_endpoint",
]

log = logging.getLogger(__name__)

#: Largest message (frame) the server accepts; a bigger one makes ZeroMQ drop that
#: connection as soon as its size is read (so an unauthenticated sender can make the server
#: hold at most this much per connection).
DEFAULT_MAX_MESSAGE_BYTES = 256 << 10
#: Messages libzmq reads ahead per client connection before it waits for the server thread
#: (a bound on what a flood of refused requests can make the server hold).
_RCVHWM = 8
#: Largest request without a session a server with sessions decodes (a first contact).
HELLO_MAX_BYTES = 2048
_HEAD_BYTES = NONCE_BYTES + 8 + MAC_BYTES
_RECV_BATCH = 256  # messages handled per wake-up before timers and the outbox get a turn
_JOIN_TIMEOUT_S = 10.0
_MAX_POLL_MS = 60_000  # the loop re-polls at least this often (huge deadlines overflow poll)
# Client heartbeats (ZMTP PING/PONG): a PING every second; no traffic from the server for 4 s
# drops the connection; the server drops ours after 4 s without traffic from us.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 4000
_HEARTBEAT_TTL_MS = 4000
# Monitor events the client acts on: a handshake done (connection usable) or a connection gone.
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
# What msgpack.unpackb raises on bad input (FormatError, ExtraData, StackError, bad UTF-8,
# unhashable or non-str map keys, ...).
_DECODE_ERRORS = (ValueError, TypeError, OverflowError, msgpack.UnpackException)


class RpcError(RingcommError):
    """A request could not be carried out by the RPC layer."""


class RpcTimeoutError(RpcError, CommTimeoutError):
    """No reply arrived before the call's deadline."""


class RpcClosedError(RpcError):
    """The client was closed (before or while the call was waiting)."""


class RpcConnectionLost(RpcError):
    """The connection to a server that had been reached dropped (it closed or died, or went
    silent); raised for the calls pending at that moment and for calls made while it is down."""


class RpcRemoteError(RpcError):
    """The server's handler raised; the message is its ``Type: text``."""


class RpcAuthError(RpcError):
    """The server refused the request's session (wrong key: another token; or replayed)."""


@dataclass(frozen=True)
class RpcCall:
    """One request as the server's handler sees it."""

    client_id: bytes  # the ROUTER identity of the sender
    request_id: int
    body: dict[str, Any]
    #: The session's client nonce when the request was signed (checked), else None.
    session: bytes | None = None


Handler = Callable[[RpcCall], "dict[str, Any] | None"]


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).version == 6
    except ValueError:
        return False


def tcp_endpoint(host: str, port: int) -> str:
    """``tcp://host:port``, with brackets around an IPv6 literal."""
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if _is_ipv6(host) else f"tcp://{host}:{port}"


def _bind_host(host: str) -> str:
    """What ZeroMQ's bind accepts for ``host``: ``*``, a numeric IP (names are resolved)."""
    if host in ("", "*", "0.0.0.0"):
        return "*"
    try:
        ipaddress.ip_address(host.strip("[]"))
        return host.strip("[]")
    except ValueError:
        pass
    # ZeroMQ binds to interfaces or numeric addresses only; resolve a host name.
    infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    return str(infos[0][4][0])


def _wake_pair() -> tuple[socket.socket, socket.socket]:
    """A non-blocking (reader, writer) socket pair used to wake a poll loop."""
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    return reader, writer


def _poke(writer: socket.socket) -> None:
    """Wake the loop; a full buffer already means a wake-up is pending."""
    try:
        writer.send(b"\0")
    except OSError:  # BlockingIOError (already pending) or closed (loop gone)
        pass


def _drain(reader: socket.socket) -> None:
    try:
        while reader.recv(4096):
            pass
    except OSError:
        pass


class RpcServer:
    """A ROUTER socket served by a daemon thread; see the module docstring.

    The socket is bound in the constructor, so ``port`` is known before :meth:`start`.
    Counters (read from any thread): ``served`` requests handed to the handler, ``dropped``
    malformed messages, ``errors`` handler exceptions, ``unsent`` replies ZeroMQ refused.
    """

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        context: zmq.Context[Any] | None = None,
        name: str = "ringcomm-rpc-server",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        sessions: SessionKeys | None = None,
    ) -> None:
        self.host = host
        self.name = name
        self.served = 0
        self.dropped = 0
        self.errors = 0
        self.unsent = 0
        #: Signed requests refused (wrong HMAC: another token; or a replayed id), and the
        #: address the last one came from.
        self.refused = 0
        self.refused_from: str | None = None
        self._handler = handler
        self._sessions = sessions
        self._session_keys: dict[bytes, bytes] = {}  # client nonce -> key (checked ones)
        self._last_ids: dict[bytes, int] = {}  # client nonce -> highest request id seen
        self._own_ctx = context is None
        self._ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        self._lock = threading.Lock()
        self._outbox: deque[tuple[bytes, bytes, bytes]] = deque()  # replies of other threads
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            # A server that is shutting down answers nothing more: drop unsent replies.
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            self._sock.setsockopt(zmq.RCVHWM, _RCVHWM)
            bind_host = _bind_host(host)
            if _is_ipv6(bind_host):
                self._sock.setsockopt(zmq.IPV6, 1)
            self._sock.bind(tcp_endpoint(bind_host, port))
            last = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.port = int(last.rsplit(":", 1)[1])
        except (zmq.ZMQError, OSError) as exc:
            self._sock.close(linger=0)
            if self._own_ctx:
                self._ctx.term()
            raise RpcError(f"{name}: cannot bind tcp://{host}:{port}: {exc}") from exc
        self._wake_r, self._wake_w = _wake_pair()

    @property
    def endpoint(self) -> str:
        """Where a client on this host connects (the wildcard address maps to loopback)."""
        host = "127.0.0.1" if _bind_host(self.host) == "*" else self.host
        return tcp_endpoint(host, self.port)

    def start(self) -> Self:
        """Start serving in the background; returns self. Starting twice is a no-op."""
        with self._lock:
            if self._closed:
                raise RpcClosedError(f"{self.name}: start() after close()")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return self

    def _on_server_thread(self) -> bool:
        return self._thread is not None and threading.get_ident() == self._thread.ident

    def reply(self, call: RpcCall, body: dict[str, Any]) -> None:
        """Answer ``call`` (deferred or not) with ``body``. Callable from any thread."""
        payload = self._pack_reply(call, body)
        self._send_or_queue(call.client_id, self._reply_head(call, payload), payload)

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> None:
        """Run ``callback()`` on the server thread ``delay_s`` seconds from now."""
        deadline = time.monotonic() + max(0.0, delay_s)
        with self._lock:
            heapq.heappush(self._timers, (deadline, next(self._timer_seq), callback))
        if not self._on_server_thread():
            _poke(self._wake_w)  # the loop must recompute its poll timeout

    def close(self) -> None:
        """Stop serving and release the socket. Idempotent, callable from any thread;
        requests not yet answered stay unanswered (connected clients see the connection
        drop and fail them with :class:`RpcConnectionLost`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            self._cleanup()
            return
        _poke(self._wake_w)
        if thread is not threading.current_thread():
            thread.join(_JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning(
                    "%s: server thread did not stop within %.0f s", self.name, _JOIN_TIMEOUT_S
                )

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- server thread -------------------------------------------------------------------

    def _send_or_queue(self, client_id: bytes, head: bytes, payload: bytes) -> None:
        if self._on_server_thread():
            self._send(client_id, head, payload)
            return
        with self._lock:
            if self._closed:
                return
            self._outbox.append((client_id, head, payload))
        _poke(self._wake_w)

    def _send(self, client_id: bytes, head: bytes, payload: bytes) -> None:
        try:
            # NOBLOCK: a slow or vanished client never stalls the server; ROUTER drops
            # messages to unknown identities itself.
            self._sock.send_multipart([client_id, head, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.unsent += 1
            log.debug("%s: reply not sent: %s", self.name, exc)

    def _poll_timeout_ms(self) -> int:
        with self._lock:
            if not self._timers:
                return -1
            delay_s = self._timers[0][0] - time.monotonic()
        return min(_MAX_POLL_MS, max(0, math.ceil(delay_s * 1000)))

    def _run_due_timers(self) -> None:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._timers or self._timers[0][0] > now:
                    return
                _, _, callback = heapq.heappop(self._timers)
            try:
                callback()
            except Exception:
                self.errors += 1
                log.exception("%s: timer callback failed", self.name)

    def _flush_outbox(self) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    return
                client_id, head, payload = self._outbox.popleft()
            self._send(client_id, head, payload)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wake_fd = self._wake_r.fileno()
        try:
            while not self._closed:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._closed:
                    break
                if wake_fd in events:
                    _drain(self._wake_r)
                self._flush_outbox()
                self._run_due_timers()
                if self._sock in events:
                    self._receive_batch()
        except Exception:  # a bug, not a bad message: keep it visible
            log.exception("%s: server loop failed", self.name)
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        self._sock.close(linger=0)
        self._wake_r.close()
        self._wake_w.close()
        if self._own_ctx:
            self._ctx.term()

    def _receive_batch(self) -> None:
        for _ in range(_RECV_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._dispatch(frames)

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        call = self._decode(frames)
        if call is None:
            return
        self.served += 1
        try:
            body = self._handler(call)
        except Exception as exc:
            self.errors += 1
            log.exception("%s: handler failed on request %d", self.name, call.request_id)
            error = f"{type(exc).__name__}: {exc}"
            payload = bytes(msgpack.packb({"id": call.request_id, "error": error}))
            self._send(call.client_id, self._reply_head(call, payload), payload)
            return
        if body is not None:
            payload = self._pack_reply(call, body)
            self._send(call.client_id, self._reply_head(call, payload), payload)

    def _reply_head(self, call: RpcCall, payload: bytes) -> bytes:
        """The HMAC a signed request's reply carries (empty for an unsigned one)."""
        if call.session is None:
            return b""
        key = self._session_keys[call.session]
        return mac(key, b"reply", call.request_id.to_bytes(8, "little"), payload)

    def _refuse(self, frames: list[zmq.Frame], request_id: int, why: str) -> None:
        """Answer a signed request whose check failed with ``refused`` (unsigned: the
        client cannot tell it from a forgery, so it only ever fails a call)."""
        self.refused += 1
        try:
            self.refused_from = str(frames[-1].get("Peer-Address"))
        except (zmq.ZMQError, AttributeError):
            self.refused_from = None
        payload = bytes(msgpack.packb({"id": request_id, "refused": why}))
        self._send(frames[0].bytes, b"", payload)

    def _pack_reply(self, call: RpcCall, body: dict[str, Any]) -> bytes:
        """The reply message; an unpackable body becomes an error reply, never a crash."""
        try:
            return bytes(msgpack.packb({"id": call.request_id, "body": body}))
        except (TypeError, ValueError, OverflowError) as exc:
            self.errors += 1
            log.exception("%s: reply to request %d cannot be packed", self.name, call.request_id)
            error = f"reply cannot be packed: {type(exc).__name__}: {exc}"
            return bytes(msgpack.packb({"id": call.request_id, "error": error}))

    def _decode(self, frames: list[zmq.Frame]) -> RpcCall | None:
        """The request in ``frames`` once checked (module docstring), or None: malformed
        (counted in ``dropped``) or refused (answered, counted in ``refused``)."""
        if len(frames) != 3:
            self.dropped += 1
            return None
        client_id, head, payload = frames[0].bytes, frames[1].bytes, frames[2].buffer
        session: bytes | None = None
        if not head:
            if self._sessions is not None and len(payload) > HELLO_MAX_BYTES:
                self.dropped += 1  # too large for a first contact: not even decoded
                return None
        elif self._sessions is None or len(head) != _HEAD_BYTES:
            self.dropped += 1
            return None
        else:
            cn, signed_id = head[:NONCE_BYTES], head[NONCE_BYTES : NONCE_BYTES + 8]
            request_id = int.from_bytes(signed_id, "little")
            key = self._session_keys.get(cn) or self._sessions.key(cn)
            if not hmac.compare_digest(mac(key, b"request", signed_id, payload), head[-MAC_BYTES:]):
                self._refuse(frames, request_id, "token mismatch")
                return None
            if request_id <= self._last_ids.get(cn, 0):
                self._refuse(frames, request_id, "replayed request")
                return None
            self._session_keys[cn] = key
            self._last_ids[cn] = request_id
            session = cn
        try:
            message = msgpack.unpackb(payload, raw=False)
        except _DECODE_ERRORS:
            message = None
        if not isinstance(message, dict) or set(message) != {"id", "body"}:
            self.dropped += 1
            return None
        request_id, body = message["id"], message["body"]
        if type(request_id) is not int or not isinstance(body, dict):
            self.dropped += 1
            return None
        if not all(isinstance(key, str) for key in body):
            self.dropped += 1
            return None
        if session is not None and request_id != int.from_bytes(
            head[NONCE_BYTES : NONCE_BYTES + 8], "little"
        ):
            self.dropped += 1
            return None
        return RpcCall(client_id, request_id, body, session)


@dataclass
class _Slot:
    """Where the I/O thread leaves one call's outcome."""

    event: threading.Event = field(default_factory=threading.Event)
    body: dict[str, Any] | None = None
    error: str | None = None
    refused: str | None = None
    closed: bool = False
    lost: bool = False
    key: bytes | None = None  # the session key its request was signed with


class RpcClient:
    """A DEALER connected to ``endpoint`` (``tcp://host:port``); see the module docstring.

    Thread-safe: the socket belongs to one I/O thread, callers share a locked queue.
    ``stale`` counts replies discarded because their caller had given up; ``losses`` counts
    established connections that dropped; ``connected`` tells whether one is up now.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.Context[Any] | None = None,
        name: str = "ringcomm-rpc-client",
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.stale = 0
        self.losses = 0
        self._own_ctx = context is None
        self._ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        self._lock = threading.Lock()
        self._outbox: deque[tuple[int, bytes, bytes]] = deque()
        self._session: tuple[bytes, bytes] | None = None  # (client nonce, key): set_session
        self._pending: dict[int, _Slot] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._ever_up = False  # a handshake succeeded once: a drop is now a loss
        self._up = False  # a connection is established right now
        self._monitor: zmq.Socket[Any] | None = None
        self._sock = self._ctx.socket(zmq.DEALER)
        try:
            # LINGER=0: close() must not block on requests a dead server will never read.
            self._sock.setsockopt(zmq.LINGER, 0)
            # IMMEDIATE: queue only to a live connection, so the requests of calls failed
            # by a lost connection die with it instead of going out after a reconnect.
            self._sock.setsockopt(zmq.IMMEDIATE, 1)
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
            self._sock.setsockopt(zmq.HEARTBEAT_TTL, _HEARTBEAT_TTL_MS)
            self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * DEFAULT_MAX_MESSAGE_BYTES)
            if "[" in endpoint:
                self._sock.setsockopt(zmq.IPV6, 1)
            # Before connect, so the first handshake is seen.
            self._monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS)
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise RpcError(f"{name}: cannot connect to {endpoint}: {exc}") from exc
        self._wake_r, self._wake_w = _wake_pair()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        """True while a connection to the server is established (handshake done)."""
        return self._up

    def _lost_message(self) -> str:
        return f"{self.name}: lost the connection to {self.endpoint} (the server closed or died)"

    def set_session(self, cn: bytes, key: bytes) -> None:
        """Sign every later call with this session (client nonce, key; session.py)."""
        with self._lock:
            self._session = (cn, key)

    def call(self, body: dict[str, Any], timeout_s: float, *, sign: bool = True) -> dict[str, Any]:
        """Send ``body``, return the reply body.

        Signed with the session when there is one and ``sign``. Raises
        :class:`RpcTimeoutError` when no reply arrives within ``timeout_s``,
        :class:`RpcRemoteError` when the server's handler raised, :class:`RpcAuthError`
        when it refused the session, :class:`RpcClosedError` when the client is closed,
        :class:`RpcConnectionLost` at once when the connection to the server dropped
        (while waiting, or before the call while it is still down).
        """
        if not (timeout_s >= 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
        slot = _Slot()
        with self._lock:
            if self._closed:
                raise RpcClosedError(f"{self.name}: call on a closed client ({self.endpoint})")
            if self._ever_up and not self._up:
                raise RpcConnectionLost(self._lost_message())
            # Ids are taken in queue order, so they increase on the wire (the server
            # refuses a signed id that does not: a replay).
            request_id = next(self._ids)
            payload = bytes(msgpack.packb({"id": request_id, "body": body}))
            head = b""
            if sign and self._session is not None:
                cn, slot.key = self._session
                signed_id = request_id.to_bytes(8, "little")
                head = cn + signed_id + mac(slot.key, b"request", signed_id, payload)
            self._pending[request_id] = slot
            self._outbox.append((request_id, head, payload))
        _poke(self._wake_w)
        slot.event.wait(min(timeout_s, threading.TIMEOUT_MAX))
        with self._lock:
            self._pending.pop(request_id, None)
            if not slot.event.is_set():
                # Never sent (server unreachable, queue full)? Then do not send it late.
                self._outbox = deque(item for item in self._outbox if item[0] != request_id)
        if not slot.event.is_set():
            raise RpcTimeoutError(
                f"{self.name}: no reply from {self.endpoint} within {timeout_s:g} s"
            )
        if slot.closed:
            raise RpcClosedError(f"{self.name}: client closed while waiting ({self.endpoint})")
        if slot.lost:
            raise RpcConnectionLost(self._lost_message())
        if slot.refused is not None:
            raise RpcAuthError(f"{self.endpoint}: the server refused this request ({slot.refused})")
        if slot.error is not None:
            raise RpcRemoteError(f"{self.endpoint}: server error: {slot.error}")
        assert slot.body is not None
        return slot.body

    def close(self) -> None:
        """Stop the I/O thread and close the socket. Idempotent; waiting calls get
        :class:`RpcClosedError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            slots = list(self._pending.values())
            self._pending.clear()
            self._outbox.clear()
        for slot in slots:
            slot.closed = True
            slot.event.set()
        _poke(self._wake_w)
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- I/O thread ----------------------------------------------------------------------

    def _run(self) -> None:
        assert self._monitor is not None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wake_fd = self._wake_r.fileno()
        try:
            while not self._closed:
                events = dict(poller.poll())
                if self._closed:
                    break
                if wake_fd in events:
                    _drain(self._wake_r)
                # Replies first (one that arrived before a drop still counts), then the
                # connection's state, then requests (none go out once a loss is known).
                if events.get(self._sock, 0) & zmq.POLLIN:
                    self._receive_all()
                if self._monitor in events:
                    self._read_monitor()
                blocked = self._flush_outbox()
                # Ask for POLLOUT only while ZeroMQ's queue is full, else it fires constantly.
                poller.modify(self._sock, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
        except Exception:
            log.exception("%s: client I/O loop failed", self.name)
        finally:
            self._close_sockets()
            self._wake_r.close()
            self._wake_w.close()

    def _close_sockets(self) -> None:
        """Close the monitor (before the DEALER and the context: a live monitor socket
        makes ``ctx.term()`` hang), then the DEALER, then our own context."""
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError as exc:
                log.debug("%s: disable_monitor: %s", self.name, exc)
            self._monitor.close(linger=0)
            self._monitor = None
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def _read_monitor(self) -> None:
        assert self._monitor is not None
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2 or len(frames[0]) != 6:  # not from libzmq: ignore it
                log.debug("%s: unreadable monitor event %r", self.name, frames)
                continue
            # First frame: 16-bit event id, 32-bit value (native order); second: endpoint.
            (event,) = struct.unpack_from("=H", frames[0])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                with self._lock:
                    reconnected = self._ever_up and not self._up
                    self._up = self._ever_up = True
                if reconnected:
                    log.info("%s: connected to %s again", self.name, self.endpoint)
            elif event == zmq.EVENT_DISCONNECTED:
                self._on_disconnected()

    def _on_disconnected(self) -> None:
        """An established connection dropped: fail every waiting call at once.

        A drop before any handshake (a connect that never became a ZMTP connection) is
        not a loss: the server may not be up yet."""
        with self._lock:
            if not self._up:
                return
            self._up = False
            self.losses += 1
            slots = list(self._pending.values())
            self._pending.clear()
            self._outbox.clear()
        # With no call waiting this is often an orderly shutdown (the store's host closing
        # it after the last checkout): not worth a warning.
        log.log(
            logging.WARNING if slots else logging.INFO,
            "%s: lost the connection to %s; %d waiting call(s) failed",
            self.name,
            self.endpoint,
            len(slots),
        )
        for slot in slots:
            slot.lost = True
            slot.event.set()

    def _flush_outbox(self) -> bool:
        """Hand queued requests to ZeroMQ; True when its queue is full (try again later)."""
        while True:
            with self._lock:
                if not self._outbox:
                    return False
                _, head, payload = self._outbox[0]
                try:
                    self._sock.send_multipart([head, payload], zmq.NOBLOCK)
                except zmq.Again:
                    return True
                self._outbox.popleft()

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message: Any = None
            if len(frames) == 2:
                try:
                    message = msgpack.unpackb(frames[1], raw=False)
                except _DECODE_ERRORS:
                    message = None
            request_id = message.get("id") if isinstance(message, dict) else None
            if type(request_id) is not int:
                self.stale += 1  # not a reply we can read: nobody to give it to
                continue
            with self._lock:
                slot = self._pending.get(request_id)
                if (
                    slot is not None
                    and slot.key is not None
                    and not hmac.compare_digest(
                        frames[0],
                        mac(slot.key, b"reply", request_id.to_bytes(8, "little"), frames[1]),
                    )
                ):
                    # Not from the server of our session: only its refusal (which anyone
                    # could forge, and which only fails the call) is taken unsigned.
                    slot = slot if isinstance(message.get("refused"), str) else None
                if slot is not None:
                    del self._pending[request_id]
            if slot is None:
                self.stale += 1  # its caller timed out already, or a forgery
                continue
            if isinstance(message.get("refused"), str):
                slot.refused = message["refused"]
            elif isinstance(message.get("error"), str):
                slot.error = message["error"]
            elif isinstance(message.get("body"), dict):
                slot.body = message["body"]
            else:
                slot.error = "malformed reply"
            slot.event.set()
