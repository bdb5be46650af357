"""The rendezvous key-value store's client (:class:`Store`), and its server's name.

Ranks meet here before the data plane exists: they publish endpoints, count arrivals with
``add`` and block in ``wait``/``get`` until the keys they need exist. Semantics follow
torch.distributed's ``Store``: values are bytes, ``add`` keeps a decimal ASCII integer,
``get`` waits for the key, ``compare_set`` returns the value now stored. Waits are parked
on the server (:mod:`ringcomm.rendezvous.store_server`), never polled; every call is
bounded by its deadline, and a server that was reached and then lost makes waiting and
later calls raise :class:`RendezvousError` at once. The token never travels: each client
agrees on a signed session at first contact. docs/architecture.md ("The rendezvous store")
has the protocol.
"""

from __future__ import annotations

import hmac
import math
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ringcomm.errors import AuthenticationError, CommTimeoutError, RendezvousError
from ringcomm.rendezvous.join import JoinRefusedError, JoinRequest
from ringcomm.rendezvous.store_server import StoreServer
from ringcomm.transport.rpc import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RpcAuthError,
    RpcClient,
    RpcClosedError,
    RpcConnectionLost,
    RpcError,
    RpcRemoteError,
    RpcTimeoutError,
    tcp_endpoint,
)
from ringcomm.transport.session import (
    NONCE_BYTES,
    dh_keypair,
    dh_shared,
    job_key,
    mac,
    seal,
    session_key,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "DEFAULT_STORE_TIMEOUT_S",
    "MAX_VALUE_BYTES",
    "ClaimPendingError",
    "Store",
    "StoreServer",
]

#: A client's default deadline per call, as the process group's default.
DEFAULT_STORE_TIMEOUT_S = 300.0
# A client waits this much longer than a get/wait's own deadline, so the server's timeout
# reply (which names the missing keys) normally arrives first.
_WAIT_GRACE_S = 1.0
#: Largest value ``set``/``compare_set`` take: a request must fit the server's message
#: limit (rpc.py), which bounds what an unauthenticated sender can make it hold.
MAX_VALUE_BYTES = DEFAULT_MAX_MESSAGE_BYTES - 4096


class ClaimPendingError(AuthenticationError):
    """The store hands its minted token to none of the claim's group (yet): the group may
    not be open there yet (its host's previous store may still hold the port)."""


class _Connection:
    """One RPC client and identity, shared by a :class:`Store` and its prefixed views."""

    def __init__(self, host: str, port: int, token: str | None, label: str) -> None:
        self.host = host
        self.port = port
        self.token = token  # the job's: given, or received at first contact
        self.label = label
        self.address = f"{host}:{port}"
        try:
            self.rpc = RpcClient(tcp_endpoint(host, port), name="ringcomm-store-client")
        except RpcError as exc:
            raise RendezvousError(
                f"{label}: cannot connect to the store at {host}:{port}: {exc}"
            ) from exc

    def close(self) -> None:
        self.rpc.close()


def _as_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, (bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, str):
        data = value.encode()
    else:
        raise TypeError(f"store values are bytes (or str), got {type(value).__name__}")
    if len(data) > MAX_VALUE_BYTES:
        raise ValueError(
            f"store values are at most {MAX_VALUE_BYTES} bytes, got {len(data)} (the server "
            "bounds every message, so that no unauthenticated sender can fill its memory)"
        )
    return data


def _check_timeout(timeout_s: float, name: str = "timeout_s") -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {timeout_s!r}")
    if not (math.isfinite(timeout_s) and timeout_s >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {timeout_s!r}")
    return float(timeout_s)


class Store:
    """A client of a :class:`StoreServer`; a context manager, thread-safe.

    Connects at construction (a first contact: docs/architecture.md, "The rendezvous store"): raises
    :class:`RendezvousError` when the server does not answer within ``connect_timeout_s``
    (default ``timeout_s``) and :class:`AuthenticationError` when it refuses ``token`` (or
    the token differs: "token mismatch"). Without a token the server may hand out its own
    (``token`` then holds it) to this client's ``claim`` (e.g. ``"rank 3"``; see
    :class:`StoreServer`'s ``issue``); ``auth=False``: the job runs without a token
    (``RINGCOMM_SECURITY=none``) and so must the server.
    ``timeout_s`` is also the default deadline of every later call, except that once the
    server was reached, losing it (it closed, or its host died) makes waiting and later calls
    raise :class:`RendezvousError` at once. ``prefix`` namespaces every key as
    ``f"{prefix}/{key}"``; ``label`` (e.g. ``"rank 3"``) starts error messages.

    Thread safety: the socket is owned by one I/O thread (see :class:`RpcClient`); callers
    share a locked request queue, so a thread blocked in ``get`` does not hold up others.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_STORE_TIMEOUT_S,
        prefix: str = "",
        label: str | None = None,
        connect_timeout_s: float | None = None,
        claim: str | None = None,
        auth: bool = True,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
            raise ValueError(f"store port must be in 1..65535, got {port!r}")
        timeout_s = _check_timeout(timeout_s)
        connect_s = timeout_s if connect_timeout_s is None else _check_timeout(connect_timeout_s)
        self._conn = _Connection(
            host, port, (token or None) if auth else None, label or "store client"
        )
        self._prefix = prefix.strip("/")
        self._timeout_s = timeout_s
        self._owner = True
        self._closed = False
        try:
            self._hello(connect_s, claim, auth)
        except BaseException:
            self._conn.close()
            raise

    @property
    def token(self) -> str | None:
        """The job's token as this client uses it (given, or handed out by the server);
        None when the job runs without one."""
        return self._conn.token

    def _hello(self, timeout_s: float, claim: str | None, auth: bool) -> None:
        """First contact: agree on a session (and receive the token if we have none)."""
        conn = self._conn
        cn = os.urandom(NONCE_BYTES)
        fields: dict[str, Any] = {"cn": cn, "auth": auth}
        dh: tuple[int, bytes] | None = None
        if auth and conn.token is None:
            dh = dh_keypair()
            fields["dh"] = dh[1]
            if claim is not None:
                fields["claim"] = claim
                fields["who"] = f"pid {os.getpid()} on {socket.gethostname()}"
        reply = self._request("hello", fields, timeout_s, first_contact=True)
        where = f"{conn.label}: the store at {conn.address}"
        if reply.get("auth") == "none":
            if auth:
                raise AuthenticationError(
                    f"{where} runs without a token (RINGCOMM_SECURITY=none where it was "
                    "started) but this process uses one: token mismatch; set the same "
                    "RINGCOMM_SECURITY everywhere"
                )
            return
        sn, proof = reply.get("sn"), reply.get("proof")
        if not (isinstance(sn, bytes) and isinstance(proof, bytes)):
            raise RendezvousError(f"{where} answered a malformed hello: {reply!r}")
        if not auth:
            raise AuthenticationError(
                f"{where} requires the job's token but this process runs with "
                "RINGCOMM_SECURITY=none: set the same RINGCOMM_SECURITY everywhere"
            )
        if dh is not None:
            box, theirs = reply.get("box"), reply.get("dh")
            shared = dh_shared(dh[0], theirs) if isinstance(theirs, bytes) else None
            if shared is None or not isinstance(box, bytes):
                raise RendezvousError(f"{where} answered a malformed hello: {reply!r}")
            try:
                conn.token = seal(shared, cn, sn, box).decode()
            except UnicodeDecodeError:
                conn.token = "\0"  # not a token: the proof below fails
        assert conn.token is not None
        key = session_key(job_key(conn.token, b"store"), cn, sn)
        conn.rpc.set_session(cn, key)
        if not hmac.compare_digest(mac(key, b"hello", cn, sn), proof):
            # Signed with our key, so the server sees (and logs) the mismatch too.
            try:
                conn.rpc.call({"op": "ping"}, min(timeout_s, 2.0))
            except RpcError:
                pass
            raise AuthenticationError(
                f"{where} refused this process: token mismatch (it holds a different "
                "token); every rank must use the job's token (token= or RINGCOMM_TOKEN)"
                if dh is None
                else f"{where} handed out a token that does not match its proof "
                "(tampered with on the way?)"
            )

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def label(self) -> str:
        return self._conn.label

    def prefixed(self, prefix: str) -> Store:
        """A view whose keys live under ``prefix`` (nested under this store's own prefix).

        It shares this store's connection; closing the view does not close the connection,
        closing this store does (the views stop working).
        """
        view = object.__new__(Store)
        view._conn = self._conn
        view._prefix = "/".join(p for p in (self._prefix, prefix.strip("/")) if p)
        view._timeout_s = self._timeout_s
        view._owner = False
        view._closed = False
        return view

    def close(self) -> None:
        """Close the connection (a view only marks itself closed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self._conn.address}, prefix={self._prefix!r}, label={self.label!r})"

    # -- operations ----------------------------------------------------------------------

    def set(self, key: str, value: bytes | bytearray | memoryview | str) -> None:
        """Store ``value`` under ``key`` (overwriting), waking whoever waits for it.

        Bytes-like values are copied to bytes; a str is stored UTF-8 encoded."""
        self._request("set", {"key": self._key(key), "value": _as_bytes(value)}, self._timeout_s)

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """The value of ``key``, waiting until it exists; :class:`CommTimeoutError` after
        ``timeout_s`` (default: the store's)."""
        wait_s = self._wait_timeout(timeout_s)
        full = self._key(key)
        reply = self._request("get", {"key": full, "timeout_s": wait_s}, wait_s, wait=True)
        return _reply_bytes(reply, "value")

    def try_get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it does not exist (no waiting)."""
        reply = self._request("try_get", {"key": self._key(key)}, self._timeout_s)
        value = reply.get("value")
        return None if value is None else _reply_bytes(reply, "value")

    def add(self, key: str, delta: int = 1, *, timeout_s: float | None = None) -> int:
        """Atomically add ``delta`` to the integer at ``key`` (missing: 0); the new value.
        ``timeout_s``: this call's deadline (default: the store's)."""
        if isinstance(delta, bool) or not isinstance(delta, int):
            raise TypeError(f"add: delta must be an int, got {delta!r}")
        limit_s = self._timeout_s if timeout_s is None else _check_timeout(timeout_s)
        reply = self._request("add", {"key": self._key(key), "delta": delta}, limit_s)
        value = reply.get("value")
        if not isinstance(value, int):
            raise RendezvousError(f"{self.label}, op store.add: malformed reply {reply!r}")
        return value

    def wait(self, keys: Sequence[str], timeout_s: float | None = None) -> None:
        """Block until every key exists (the server parks the request, no client polling);
        :class:`CommTimeoutError` after ``timeout_s`` (default: the store's)."""
        wait_s = self._wait_timeout(timeout_s)
        full = self._keys(keys)
        if not full:
            return
        self._request("wait", {"keys": full, "timeout_s": wait_s}, wait_s, wait=True)

    def wait_missing(self, keys: Sequence[str], timeout_s: float | None = None) -> list[str]:
        """:meth:`wait`, but at the deadline return the keys still missing (as given)
        instead of raising; ``[]`` once every key exists."""
        wait_s = self._wait_timeout(timeout_s)
        full = self._keys(keys)
        if not full:
            return []
        reply = self._request(
            "wait", {"keys": full, "timeout_s": wait_s}, wait_s, wait=True, timeout_ok=True
        )
        if reply.get("status") == "ok":
            return []
        missing = set(reply.get("missing") or ())
        return [k for k, f in zip(keys, full, strict=True) if f in missing]

    def join(self, request: JoinRequest) -> bool:
        """Join the group instance ``request.ns`` (under this store's prefix): the store's
        host checks world size, rank and version against the group's
        (:mod:`ringcomm.rendezvous.join`) and raises :class:`RendezvousError` naming both
        values when they disagree; so does every rank of that group waiting in the store.
        False: this store does not serve that group (yet): its host has not opened it."""
        body = request.to_body()
        body["ns"] = self._key(request.ns)
        return self._request("join", body, self._timeout_s).get("status") == "ok"

    def delete(self, key: str) -> bool:
        """Remove ``key``; True when it existed."""
        reply = self._request("delete", {"key": self._key(key)}, self._timeout_s)
        return bool(reply.get("deleted"))

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists (no waiting)."""
        reply = self._request("check", {"keys": self._keys(keys)}, self._timeout_s)
        return bool(reply.get("exists"))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Atomically set ``key`` to ``desired`` if it holds ``expected``; the value now stored.

        torch semantics: ``expected`` None or ``b""`` matches a missing key; when the key is
        missing and ``expected`` is something else, nothing is stored and ``expected`` is
        returned. Success is ``result == desired``.
        """
        fields = {
            "key": self._key(key),
            "expected": None if expected is None else _as_bytes(expected),
            "desired": _as_bytes(desired),
        }
        return _reply_bytes(self._request("compare_set", fields, self._timeout_s), "value")

    # -- plumbing ------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, got {type(key).__name__}")
        return f"{self._prefix}/{key}" if self._prefix else key

    def _keys(self, keys: Sequence[str]) -> list[str]:
        if isinstance(keys, (str, bytes)):
            raise TypeError("keys must be a sequence of str, not a single string")
        return [self._key(k) for k in keys]

    def _wait_timeout(self, timeout_s: float | None) -> float:
        return self._timeout_s if timeout_s is None else _check_timeout(timeout_s)

    def _request(
        self,
        op: str,
        fields: dict[str, Any],
        timeout_s: float,
        *,
        wait: bool = False,
        first_contact: bool = False,
        timeout_ok: bool = False,
    ) -> dict[str, Any]:
        """Send one op; map every failure to a public error naming label, op and key(s)
        (``timeout_ok``: a timeout reply is returned, not raised)."""
        conn = self._conn
        what = _describe(op, fields)
        if self._closed:
            raise RendezvousError(f"{conn.label}, {what}: this store client is closed")
        body = {"op": op, **fields}
        rpc_timeout_s = timeout_s + _WAIT_GRACE_S if wait else timeout_s
        try:
            reply = conn.rpc.call(body, rpc_timeout_s)
        except RpcTimeoutError as exc:
            if first_contact:
                raise RendezvousError(
                    f"{conn.label}: could not reach the store at {conn.address} within "
                    f"{timeout_s:g} s; is rank 0 (or the launcher) serving it there? "
                    "Check MASTER_ADDR/MASTER_PORT (or RINGCOMM_MASTER_ADDR/_PORT)."
                ) from exc
            raise CommTimeoutError(
                f"{conn.label}, {what}: no reply from the store at {conn.address} within "
                f"{rpc_timeout_s:g} s (store closed, unreachable or overloaded)"
            ) from exc
        except RpcClosedError as exc:
            raise RendezvousError(f"{conn.label}, {what}: this store client is closed") from exc
        except RpcConnectionLost as exc:
            raise RendezvousError(
                f"{conn.label}, {what}: lost the connection to the store at {conn.address} "
                "(its host closed or died)"
            ) from exc
        except RpcAuthError as exc:
            raise AuthenticationError(
                f"{conn.label}, {what}: the store at {conn.address} refused this process "
                f"({exc}); every rank must use the job's token (token= or RINGCOMM_TOKEN)"
            ) from exc
        except RpcRemoteError as exc:
            raise RendezvousError(f"{conn.label}, {what}: {exc}") from exc
        status = reply.get("status")
        if status in ("ok", "not_yet"):
            return reply
        if status == "auth":
            why = reply.get("why")
            given = why if isinstance(why, str) else "no token was given"
            cls = ClaimPendingError if reply.get("pending") is True else AuthenticationError
            raise cls(
                f"{conn.label}, {what}: the store at {conn.address} refused this process "
                f"({given}); every rank must use the job's token (token= or RINGCOMM_TOKEN)"
            )
        if status == "refused":
            raise JoinRefusedError(
                f"{conn.label}: the group's rendezvous failed: {reply.get('message')}"
            )
        if status == "timeout" and timeout_ok:
            return reply
        if status == "timeout":
            missing = reply.get("missing")
            raise CommTimeoutError(
                f"{conn.label}, {what}: not set within {timeout_s:g} s "
                f"(missing {missing!r}; store at {conn.address})"
            )
        if status == "value_error":
            raise ValueError(f"{conn.label}, {what}: {reply.get('message')}")
        raise RendezvousError(
            f"{conn.label}, {what}: the store at {conn.address} answered {reply!r}"
        )


def _describe(op: str, fields: dict[str, Any]) -> str:
    """``op store.get, key 'pg0/x'`` for error messages."""
    if "key" in fields:
        return f"op store.{op}, key {fields['key']!r}"
    if "keys" in fields:
        keys = fields["keys"]
        shown = keys if len(keys) <= 8 else [*keys[:8], f"... {len(keys) - 8} more"]
        return f"op store.{op}, keys {shown!r}"
    return f"op store.{op}"


def _reply_bytes(reply: dict[str, Any], name: str) -> bytes:
    value = reply.get(name)
    if not isinstance(value, bytes):
        raise RendezvousError(f"malformed store reply: {name!r} is {type(value).__name__}")
    return value
