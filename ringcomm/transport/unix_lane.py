"""The same-host lane: messages below 64 KiB as AF_UNIX datagrams, past libzmq's I/O threads.

A libzmq message crosses two I/O threads; a datagram costs one ``send`` into the receiver's
socket queue and one ``recv`` out of it (measured in benchmarks/results/local_lane.md).
Only messages below ``LANE_MAX_PAYLOAD_BYTES`` that the layer above marks lane-safe travel
here, to peers on the same host, never with ``RINGCOMM_SECURITY=curve``.

Invariants: the transport reads the lane after every zmq read and before handing that
message out, and never sends a lane message after a zmq message on the same stream, so
order holds; a sender never blocks (a full queue returns False and the stream moves to
zmq); the socket lives in a 0700 folder at a random path peers learn only from the
authenticated store. Order, flow control and who may write: docs/architecture.md,
section "transport/unix_lane.py".
"""

from __future__ import annotations

import collections
import os
import shutil
import socket
import struct
import tempfile
from typing import Any

from ringcomm.transport.base import LANE_MAX_PAYLOAD_BYTES
from ringcomm.transport.endpoints import private_dir

__all__ = ["LANE_MAX_PAYLOAD_BYTES", "LANE_RECV_BYTES", "PARTS_TAG", "UnixLane"]

# LANE_MAX_PAYLOAD_BYTES: the largest payload sent through the lane (transport/base.py,
# with the other path thresholds): larger pieces go through shared memory or zero-copy.
#: Receive buffer per datagram: the largest message (payload plus header) fits with room to
#: spare; a longer datagram (not sent by ringcomm) arrives truncated and fails to parse.
LANE_RECV_BYTES = LANE_MAX_PAYLOAD_BYTES + 4096
#: First byte of a two-part datagram (a header frame starts with a msgpack array, 0x9f).
PARTS_TAG = 1
_PARTS_HEAD = struct.Struct("<BI")


class UnixLane:
    """One receiving datagram socket for this rank and one connected sender per peer."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._dir = tempfile.mkdtemp(prefix="lane-", dir=private_dir())  # mode 0700
        path = os.path.join(self._dir, f"r{rank}")
        if len(path) > 100:  # AF_UNIX paths are limited to ~107 bytes
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = tempfile.mkdtemp(prefix="rcl-", dir="/tmp")
            path = os.path.join(self._dir, f"r{rank}")
        self.path = path
        self._rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._rx.bind(path)
        except OSError:
            self.close()
            raise
        self._rx.setblocking(False)
        self.fileno = self._rx.fileno()
        self._tx: dict[int, socket.socket] = {}
        self.fallbacks = 0  # peers that left the lane
        self.full = 0  # sends refused by a full queue (the message went over zmq)
        self.sent = 0  # datagrams sent
        # Messages that came in while recv_fds looked for descriptors (recv hands them
        # out first, in the order they came).
        self._early: collections.deque[bytes] = collections.deque()
        self._closed = False

    def connect(self, peer: int, path: str) -> bool:
        """Send to ``peer`` through its lane socket at ``path`` from now on; False (and no
        lane to it) when that socket cannot be reached."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return False
        sock.setblocking(False)
        self._tx[peer] = sock
        return True

    def has(self, peer: int) -> bool:
        return peer in self._tx

    def send(self, peer: int, frame: bytes) -> bool:
        """Queue ``frame`` in ``peer``'s socket now; False if it did not go: no lane to the
        peer, its queue is full, or its socket is gone (then it leaves the lane for good)."""
        sock = self._tx.get(peer)
        if sock is None:
            return False
        try:
            sock.send(frame)
        except OSError as exc:
            return self._refused(peer, sock, exc)
        self.sent += 1
        return True

    def send_parts(self, peer: int, header: bytes, payload: Any) -> bool:
        """Queue a header and its payload as one datagram (``PARTS_TAG``; the kernel copies
        the payload now); False as :meth:`send`."""
        sock = self._tx.get(peer)
        if sock is None:
            return False
        try:
            sock.sendmsg((_PARTS_HEAD.pack(PARTS_TAG, len(header)), header, payload))
        except OSError as exc:
            return self._refused(peer, sock, exc)
        self.sent += 1
        return True

    def _refused(self, peer: int, sock: socket.socket, exc: OSError) -> bool:
        if isinstance(exc, BlockingIOError):  # the receiver's queue is full
            self.full += 1
        else:  # ECONNREFUSED (the peer closed its socket or died), ...
            del self._tx[peer]
            sock.close()
            self.fallbacks += 1
        return False

    @staticmethod
    def split(datagram: bytes) -> tuple[bytes, memoryview] | None:
        """``(header, payload)`` of a two-part datagram; None if it is not one (or its
        header length does not fit)."""
        if len(datagram) < _PARTS_HEAD.size or datagram[0] != PARTS_TAG:
            return None
        _, n = _PARTS_HEAD.unpack_from(datagram)
        start = _PARTS_HEAD.size
        if start + n > len(datagram):
            return None
        return datagram[start : start + n], memoryview(datagram)[start + n :]

    def send_fd(self, peer: int, data: bytes, fd: int) -> bool | None:
        """Pass descriptor ``fd`` to ``peer`` with ``data`` (SCM_RIGHTS); None if its
        queue is full (try again), False if there is no lane to it."""
        sock = self._tx.get(peer)
        if sock is None:
            return False
        try:
            socket.send_fds(sock, [data], [fd])
        except BlockingIOError:
            return None
        except OSError:
            return False
        return True

    def recv_fds(self) -> tuple[bytes, list[int]] | None:
        """The next datagram that carries descriptors, or None if none is waiting; other
        datagrams met on the way are kept for :meth:`recv`."""
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._rx, LANE_RECV_BYTES, 4)
            except (BlockingIOError, InterruptedError):
                return None
            if fds:
                return data, fds
            self._early.append(data)

    @property
    def holding(self) -> bool:
        """Datagrams are waiting in ``_early`` (a poll of the socket does not see them)."""
        return bool(self._early)

    def recv(self) -> bytes | None:
        """The next datagram, or None when none is waiting (never blocks)."""
        if self._early:
            return self._early.popleft()
        try:
            return self._rx.recv(LANE_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return None

    def remove_files(self) -> None:
        """Remove the socket's folder, leaving the socket open (the process is ending)."""
        shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for sock in getattr(self, "_tx", {}).values():
            sock.close()
        self._tx = {}
        rx = getattr(self, "_rx", None)
        if rx is not None:
            rx.close()
        shutil.rmtree(self._dir, ignore_errors=True)
