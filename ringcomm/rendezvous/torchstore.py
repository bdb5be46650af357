"""A client of torch's ``TCPStore`` in pure Python: how ringcomm meets under torchrun.

torchrun's agent serves a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` and every worker
connects to it (``TORCHELASTIC_USE_AGENT_STORE``), so that port is taken. A ringcomm
group there lets the OS pick its own store's port on rank 0 and publishes the address
under a key of torch's store, which the other ranks read: no guessed port can collide
(as the torch backend does through torch's own ``Store`` object). This module speaks
``TCPStore``'s wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp) without
importing torch: a query byte, then strings and byte vectors as a little-endian uint64
length and the bytes; keys go with torch's client prefix ``/``, so a key here is the same
key as torch's ``store.get(key)``. Only what the rendezvous needs: ``compare_set``, ``get`` (a
server-side ``WAIT`` then ``GET``). Every call is bounded by a deadline.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import TYPE_CHECKING

from ringcomm.errors import CommTimeoutError, RendezvousError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["TorchStoreClient"]

# TCPStoreBackend.hpp: QueryType, WaitResponseType, validationMagicNumber.
_VALIDATE, _COMPARE_SET, _GET, _WAIT = 0, 2, 3, 6
_STOP_WAITING = 0
_MAGIC = 0x3C85F7CE
_U64 = struct.Struct("<Q")


def _string(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _key(key: str) -> bytes:
    """``key`` on the wire, as torch's ``TCPStore`` client sends it."""
    return _string(b"/" + key.encode())


class TorchStoreClient:
    """One connection to a ``TCPStore`` at ``host:port``, made within ``timeout_s``
    (the agent's store is up before the workers start; a refused connection is retried
    until then). ``label`` (e.g. ``"rank 1"``) starts error messages."""

    def __init__(self, host: str, port: int, timeout_s: float, label: str = "") -> None:
        self.address = f"{host}:{port}"
        self.label = label or "torch store client"
        self._host, self._port = host, port
        self._sock = self._connect(time.monotonic() + timeout_s)

    def _connect(self, deadline: float) -> socket.socket:
        while True:
            try:
                sock = socket.create_connection(
                    (self._host, self._port), timeout=max(0.05, deadline - time.monotonic())
                )
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"{self.label}: cannot reach torch's store at {self.address} "
                        f"(MASTER_ADDR:MASTER_PORT): {exc}"
                    ) from exc
                time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(bytes([_VALIDATE]) + struct.pack("<I", _MAGIC))
        return sock

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``b""``: if it is missing);
        the value now stored (torch's semantics)."""
        self._send(bytes([_COMPARE_SET]) + _key(key) + _string(expected) + _string(desired), 10.0)
        return self._recv_vector(key, 10.0)

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value of ``key``, waiting (on the server) until it exists;
        :class:`CommTimeoutError` after ``timeout_s`` (the connection is closed then: the
        server's late answer would be out of step)."""
        self._send(bytes([_WAIT]) + _U64.pack(1) + _key(key), timeout_s)
        answer = self._recv_exact(1, key, timeout_s, waiting=True)
        if answer[0] != _STOP_WAITING:
            raise RendezvousError(
                f"{self.label}: torch's store at {self.address} cancelled the wait for {key!r}"
            )
        self._send(bytes([_GET]) + _key(key), 10.0)
        return self._recv_vector(key, 10.0)

    # -- plumbing ------------------------------------------------------------------------
    def _send(self, data: bytes, timeout_s: float) -> None:
        try:
            self._sock.settimeout(max(0.001, timeout_s))
            self._sock.sendall(data)
        except OSError as exc:
            self.close()
            raise RendezvousError(
                f"{self.label}: lost torch's store at {self.address}: {exc}"
            ) from exc

    def _recv_vector(self, key: str, timeout_s: float) -> bytes:
        (size,) = _U64.unpack(self._recv_exact(8, key, timeout_s))
        return self._recv_exact(size, key, timeout_s) if size else b""

    def _recv_exact(self, n: int, key: str, timeout_s: float, waiting: bool = False) -> bytes:
        deadline = time.monotonic() + timeout_s
        out = bytearray()
        while len(out) < n:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
                chunk = self._sock.recv(n - len(out))
            except TimeoutError:
                self.close()
                what = "not set" if waiting else "no answer"
                raise CommTimeoutError(
                    f"{self.label}: key {key!r} in torch's store at {self.address}: {what} "
                    f"within {timeout_s:g} s"
                ) from None
            except OSError as exc:
                self.close()
                raise RendezvousError(
                    f"{self.label}: lost torch's store at {self.address}: {exc}"
                ) from exc
            if not chunk:
                self.close()
                raise RendezvousError(
                    f"{self.label}: torch's store at {self.address} closed the connection"
                )
            out += chunk
        return bytes(out)
