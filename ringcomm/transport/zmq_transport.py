"""The data plane over ZeroMQ: one bound receive socket per rank, one send socket per peer.

Socket pattern: each rank binds a PULL socket (on ipc:// and tcp://); it connects a PUSH
socket to each peer the first time it sends there. ZeroMQ keeps the order of messages from
one PUSH to one PULL, which is all the matching layer above needs.

Not thread-safe by design: ZeroMQ sockets must be used by one thread at a time, so the
progress engine calls everything here under its driver lock. Only :meth:`wake` may be
called from any thread.

Copies on the hot path: a large payload is sent zero-copy (libzmq reads the caller's
buffer from its I/O thread; the returned tracker says when it is done with it), so sending
costs one kernel copy; receiving costs one kernel copy into a libzmq message, which the
caller consumes in place (copy or reduce straight from ``frame.buffer``).
"""

from __future__ import annotations

import errno
import math
import os
from typing import Any

import zmq

from ..errors import RingcommError
from .endpoints import ipc_path
from .wire import ZERO_COPY_MIN_BYTES

__all__ = ["ZERO_COPY_MIN_BYTES", "Tracker", "ZmqTransport", "tracker_wait"]


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
    ) -> None:
        self.rank = rank
        self.linger_s = linger_s
        # One I/O thread: a rank's traffic is one socket in and a few out, and on small
        # hosts extra I/O threads only compete with the ranks for cores.
        self._ctx = zmq.Context(io_threads=1)
        self._closed = False
        self._rx = self._ctx.socket(zmq.PULL)
        # Unlimited receive queue: the protocol bounds what peers send (every message
        # answers a call the user made), and a full queue would stall a ring in which every
        # rank sends before it receives. Unexpected-message caps live in the engine.
        self._rx.setsockopt(zmq.RCVHWM, 0)
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
        self.sent_bytes = 0
        self.sent_messages = 0

    # -- peers -------------------------------------------------------------------------
    def set_peer_endpoint(self, peer: int, endpoint: str) -> None:
        self._peer_endpoints[peer] = endpoint

    def _socket_to(self, peer: int) -> zmq.Socket[Any]:
        sock = self._tx.get(peer)
        if sock is None:
            try:
                endpoint = self._peer_endpoints[peer]
            except KeyError:
                raise RingcommError(f"rank {self.rank}: no endpoint known for peer {peer}") from None
            sock = self._ctx.socket(zmq.PUSH)
            # Unlimited send queue: sends never block or fail with EAGAIN. Large payloads
            # are zero-copy references to user buffers (no memory), small ones are bounded
            # by the protocol; a bounded queue would deadlock rings where all ranks send
            # first. Flow control comes from the collectives' structure.
            sock.setsockopt(zmq.SNDHWM, 0)
            # Queue messages for a peer whose connection is still being set up (the default,
            # made explicit): connect is asynchronous and we send right after it.
            sock.setsockopt(zmq.IMMEDIATE, 0)
            sock.connect(endpoint)
            self._tx[peer] = sock
        return sock

    # -- sending -----------------------------------------------------------------------
    def send(self, peer: int, header: bytes, payload: Any, nbytes: int) -> Tracker | None:
        """Queue a two-frame message; return a tracker when the payload went zero-copy.

        ``payload`` is anything with the buffer protocol. While the tracker is not done,
        libzmq may still read the payload's memory: do not modify it.
        """
        sock = self._tx.get(peer) or self._socket_to(peer)
        sock.send(header, _SNDMORE_NOBLOCK, copy=True)
        tracker: Tracker | None = None
        if nbytes >= ZERO_COPY_MIN_BYTES:
            tracker = sock.send(payload, _NOBLOCK, copy=False, track=True)
        else:
            sock.send(payload, _NOBLOCK, copy=True)
        self.sent_bytes += nbytes
        self.sent_messages += 1
        return tracker

    def send_one(self, peer: int, frame: bytes, nbytes: int) -> None:
        """Queue a one-frame message (a header carrying its small payload inline)."""
        sock = self._tx.get(peer) or self._socket_to(peer)
        sock.send(frame, _NOBLOCK, copy=True)
        self.sent_bytes += nbytes
        self.sent_messages += 1

    # -- receiving ---------------------------------------------------------------------
    def poll(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for an incoming message (or a wake-up)."""
        # Round up: a positive timeout below 1 ms must not turn into a busy poll(0).
        ready = False
        for item, _ in zmq.zmq_poll(self._poll_items, max(0, math.ceil(timeout_s * 1000))):
            if item is self._rx:
                ready = True
            else:  # the wake-up pipe
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
        return ready

    def recv_first(self, ready: bool = False) -> tuple[bytes, bool] | None:
        """First frame of the next message and whether more frames follow; None if idle.

        ``ready``: a poll just said a message is waiting (skips looking again).
        A message with more frames must be finished with :meth:`recv_payload`.
        """
        rx = self._rx
        if not ready and not rx.getsockopt(_EVENTS) & _POLLIN:  # cheaper than zmq.Again
            return None
        try:
            first = rx.recv(_NOBLOCK, copy=True)
        except zmq.Again:
            return None
        return first, bool(rx.getsockopt(_RCVMORE))

    def recv_payload(self, copy: bool) -> memoryview | bool:
        """The payload frame after a header: copied (small) or in place in libzmq's buffer.

        Returns ``False`` when the message has more than two frames (the rest is consumed).
        """
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

    # -- closing -----------------------------------------------------------------------
    def close(self, linger_s: float | None = None) -> None:
        """Close every socket; pending outgoing messages get ``linger_s`` to flush."""
        if self._closed:
            return
        self._closed = True
        linger_ms = int(1000 * (self.linger_s if linger_s is None else linger_s))
        for sock in self._tx.values():
            sock.close(linger=linger_ms)
        self._tx.clear()
        self._rx.close(linger=0)
        self._ctx.term()
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
