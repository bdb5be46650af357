"""libzmq's authentication requests (ZAP, RFC 27) for one context, answered on a thread.

libzmq asks ``inproc://zeromq.zap.01`` about every incoming connection whose socket is a
PLAIN or CURVE server, once its client's first command arrived (so the thread wakes only
for connection handshakes, never per message). :class:`ZapHandler` answers with
``check(mechanism, address, credentials)``: a user id to admit it, None to refuse it (the
connection is closed before any of its messages reaches the socket). A refusal is logged
once per address (a token mismatch is named where it happens); counters live with the
caller (the socket monitor counts failed handshakes).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["ZAP_ENDPOINT", "ZapHandler"]

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_VERSION = b"1.0"
_MAX_LOGGED_ADDRESSES = 64

#: ``check(mechanism, address, credentials) -> user id or None``.
Check = Callable[[bytes, str, list[bytes]], "bytes | None"]


class ZapHandler:
    """Binds the context's ZAP endpoint and answers on a daemon thread until :meth:`stop`.

    ``what``: how refusals are logged (``"rank 3: refused a data connection"``).
    """

    def __init__(self, ctx: zmq.Context[Any], check: Check, what: str) -> None:
        self._check = check
        self._what = what
        self._logged: set[str] = set()
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ringcomm-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll())
                if self._stopping:
                    break
                if self._sock in events:
                    self._answer(self._sock.recv_multipart())
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            self._sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) < 6:
            request_id = frames[1] if len(frames) > 1 else b""
            self._sock.send_multipart([_VERSION, request_id, b"400", b"malformed", b"", b""])
            return
        _, request_id, _, address, _, mechanism, *credentials = frames
        where = address.decode("utf-8", "replace")
        try:
            user = self._check(mechanism, where, credentials)
        except Exception:  # a bug in the check must not stop authentication: refuse
            log.exception("%s: the credential check failed", self._what)
            user = None
        if user is None:
            if where not in self._logged and len(self._logged) < _MAX_LOGGED_ADDRESSES:
                self._logged.add(where)
                log.warning(
                    "%s from %s: wrong credential (a token mismatch, a replayed login, or a "
                    "process not of this job)",
                    self._what,
                    where or "a local socket",
                )
            self._sock.send_multipart([_VERSION, request_id, b"400", b"refused", b"", b""])
            return
        self._sock.send_multipart([_VERSION, request_id, b"200", b"OK", user, b""])

    def stop(self) -> None:
        """Stop answering (idempotent); call before the context is destroyed."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._wake_r.close()
        self._wake_w.close()
