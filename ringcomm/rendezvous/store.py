"""The rendezvous key-value store: a server thread and thread-safe clients.

Ranks meet here before the data plane exists: they publish endpoints, count arrivals with
``add`` and block in ``wait``/``get`` until the keys they need exist. Semantics follow
torch.distributed's ``Store``: values are bytes, ``add`` keeps a decimal ASCII integer,
``get`` waits for the key, ``compare_set`` returns the value now stored.

Waiting happens on the server: a ``get``/``wait`` for missing keys is parked there (a deferred
RPC reply) and answered by the ``set``/``add`` that completes it, or by a timeout reply when
its deadline passes (which also removes the parked waiter). The client adds a short grace to
its own deadline, so a server that never answers still yields a bounded
:class:`CommTimeoutError`. A server that was reached and then closed or died (its host went
down) is noticed by the RPC client (:class:`~ringcomm.transport.rpc.RpcConnectionLost`): the
calls waiting on it, and every call while it stays unreachable, raise
:class:`RendezvousError` at once instead of waiting out their deadlines.

Authentication (session.py; the token never travels): a client's first contact is a
``hello`` with a fresh nonce; the server answers with its nonce and a proof that it knows
the token, and every later request and reply is signed with the session's key (checked in
rpc.py before anything is decoded). A server made without a token mints one
(``server.token``) and hands it out on first contact, sealed under a Diffie-Hellman
exchange, to clients that come without one, within its ``issue`` policy: ``"any"`` (the
default for a minted token), a set of claims each handed out once (``{"rank 1", ...}``:
what ``init_process_group`` uses, so nobody gets it once the group formed), or ``None``.
``auth=False`` (``RINGCOMM_SECURITY=none``) serves anyone, unsigned. A client whose token
differs is told "token mismatch" by the proof, and the server counts it (``rejected``,
``refused``) and logs it with the address.

Request bodies (msgpack maps, see :mod:`ringcomm.transport.rpc`)::

    {"op": "hello"|"ping"|"set"|"get"|"try_get"|"add"|"wait"|"delete"|"check"|"compare_set"
           |"join",
     "key": str | "keys": [str], "value": bytes, "delta": int, "expected": bytes|None,
     "desired": bytes, "timeout_s": float, "cn": bytes, "dh": bytes, "claim": str}

Replies: ``{"status": "ok", ...}``, ``{"status": "timeout", "missing": [str]}``,
``{"status": "auth", "why": str}``, ``{"status": "value_error" | "error", "message": str}``,
``{"status": "refused", "message": str}`` (a failed group: :mod:`ringcomm.rendezvous.join`),
``{"status": "not_yet"}`` (a join this store cannot admit yet).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
import os
import re
import socket
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ringcomm.errors import AuthenticationError, CommTimeoutError, RendezvousError
from ringcomm.rendezvous.join import Formations, JoinRefusedError, JoinRequest, parse_claim
from ringcomm.rendezvous.join import claim as claim_of
from ringcomm.transport.rpc import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RpcAuthError,
    RpcCall,
    RpcClient,
    RpcClosedError,
    RpcConnectionLost,
    RpcError,
    RpcRemoteError,
    RpcServer,
    RpcTimeoutError,
    tcp_endpoint,
)
from ringcomm.transport.session import (
    NONCE_BYTES,
    SessionKeys,
    dh_keypair,
    dh_shared,
    job_key,
    mac,
    mint_token,
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

log = logging.getLogger(__name__)

#: A client's default deadline per call, as the process group's default.
DEFAULT_STORE_TIMEOUT_S = 300.0
# A client waits this much longer than a get/wait's own deadline, so the server's timeout
# reply (which names the missing keys) normally arrives first.
_WAIT_GRACE_S = 1.0
_INT_RE = re.compile(rb"[+-]?\d+")
#: Largest value ``set``/``compare_set`` take: a request must fit the server's message
#: limit (rpc.py), which bounds what an unauthenticated sender can make it hold.
MAX_VALUE_BYTES = DEFAULT_MAX_MESSAGE_BYTES - 4096


class ClaimPendingError(AuthenticationError):
    """The store hands its minted token to none of the claim's group (yet): the group may
    not be open there yet (its host's previous store may still hold the port)."""


class _BadRequest(Exception):
    """A request with a valid token but missing or mistyped fields (a client bug)."""


class _NotAnInteger(Exception):
    """``add`` on a key whose value is not a decimal integer."""


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise _BadRequest(f"field {name!r} missing or not {kind}")
    return value


def _keys_field(body: dict[str, Any]) -> list[str]:
    keys = body.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise _BadRequest("field 'keys' missing or not a list of str")
    return keys


def _timeout_field(body: dict[str, Any]) -> float:
    timeout_s = body.get("timeout_s")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise _BadRequest("field 'timeout_s' missing or not a number")
    if not (math.isfinite(timeout_s) and timeout_s >= 0):
        raise _BadRequest(f"timeout_s={timeout_s} is not a finite number >= 0")
    return float(timeout_s)


@dataclass
class _Waiter:
    """A parked ``get`` or ``wait``: answered when ``missing`` empties or at its deadline."""

    call: RpcCall
    op: str  # "get" or "wait"
    keys: list[str]
    missing: set[str]


class StoreServer:
    """Serves the store on ``host:port`` (port 0: a free one, see ``port``) in a thread.

    A context manager (entering starts it); ``close()`` is idempotent. ``token``: the job's
    (None: a fresh one is minted, see ``token``); ``issue``: who may receive a minted token
    on first contact (module docstring; default ``"any"`` for a minted token, ``None``
    for a given one); ``auth=False``: no token at all (``RINGCOMM_SECURITY=none``).
    Counters: ``rejected`` requests refused for their token (unsigned ones, a token not
    handed out, and ``refused``: signed ones whose signature failed, a token mismatch or a
    replay; see ``refused_from``), ``dropped`` malformed messages, ``bad_requests``
    well-formed messages with a valid session but bad fields. All state lives on the server
    thread, so it needs no locks; the one exception, :meth:`allow_claims` (a second group
    meeting at a live store), replaces the claim set whole (copy on write).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        world_size: int | None = None,
        world_from: str = "the launcher",
        gated: bool = False,
        issue: str | Collection[str] | None = "default",
        auth: bool = True,
    ) -> None:
        self.host = host
        self._rejected = 0
        self.bad_requests = 0
        if not auth and token:
            raise ValueError("StoreServer: a token with auth=False")
        self.auth = auth
        minted = auth and not token
        self.token: str | None = (mint_token() if minted else token) if auth else None
        if issue == "default":
            issue = "any" if minted else None
        if issue is not None and not minted:
            raise ValueError("StoreServer: only a minted token is handed out (token=None)")
        self._issue: str | set[str] | None = issue if issue in (None, "any") else set(issue)
        self._issued: dict[str, str] = {}  # claim -> who received it
        # A store a rank hosts for its groups (gated): that process, rank 0 of each.
        self._host = f"pid {os.getpid()} on {socket.gethostname()}" if gated else None
        self._claims_lock = threading.Lock()
        self._dh: tuple[int, bytes] | None = None  # made at the first hand-out
        self._sessions = SessionKeys(self.token) if self.token else None
        self._data: dict[str, bytes] = {}
        self._waiters: dict[int, _Waiter] = {}
        self._waiters_by_key: dict[str, set[int]] = {}
        self._waiter_ids = itertools.count()
        # Groups joining here (join.py): ``world_size``, a launcher's rank count, binds all.
        self._formations = Formations(world_size, world_from, gated)
        self._ops = {
            "ping": self._op_ping,
            "set": self._op_set,
            "get": self._op_get,
            "try_get": self._op_try_get,
            "add": self._op_add,
            "wait": self._op_wait,
            "delete": self._op_delete,
            "check": self._op_check,
            "compare_set": self._op_compare_set,
            "join": self._op_join,
        }
        try:
            self._rpc = RpcServer(
                self._handle, host, port, name="ringcomm-store-server", sessions=self._sessions
            )
        except RpcError as exc:
            raise RendezvousError(f"cannot serve the store on {host}:{port}: {exc}") from exc
        self.port: int = self._rpc.port

    @property
    def dropped(self) -> int:
        """Malformed messages dropped by the server (wrong frames, not msgpack, bad types)."""
        return self._rpc.dropped

    @property
    def rejected(self) -> int:
        """Requests refused for their token (the class docstring)."""
        return self._rejected + self._rpc.refused

    @property
    def refused(self) -> int:
        """Signed requests refused: a wrong signature (token mismatch) or a replay."""
        return self._rpc.refused

    @property
    def refused_from(self) -> str | None:
        """The address the last refused request came from."""
        return self._rpc.refused_from

    def refusals(self) -> str:
        """``""``, or a sentence saying how many processes the store turned away, for
        error messages (a rank that waits for a peer refused for its token)."""
        if not self.rejected:
            return ""
        last = f", the last from {self.refused_from}" if self.refused_from else ""
        return (
            f"; the store refused {self.rejected} request(s) for their token "
            f"(token mismatch{last}): every rank must use the job's token"
        )

    @property
    def num_waiters(self) -> int:
        """``get``/``wait`` requests parked on the server right now (diagnostics, tests)."""
        return len(self._waiters)

    def start(self) -> Self:
        """Serve in a background thread; returns self."""
        self._rpc.start()
        return self

    def close(self) -> None:
        """Stop serving; parked waiters are not answered (their clients see the connection
        drop and raise :class:`RendezvousError` at once)."""
        self._rpc.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreServer({self.host}:{self.port})"

    # -- server thread -------------------------------------------------------------------

    def _handle(self, call: RpcCall) -> dict[str, Any] | None:
        """The RPC handler: a first contact, or an op of a signed session (None: answered
        later)."""
        body = call.body
        op_name = body.get("op")
        if op_name == "hello":
            try:
                return self._op_hello(body)
            except _BadRequest as exc:
                self.bad_requests += 1
                return {"status": "error", "message": f"bad request: {exc}"}
        if self.auth and call.session is None:
            self._rejected += 1
            return {"status": "auth", "why": "no session: say hello first"}
        op = self._ops.get(op_name) if isinstance(op_name, str) else None
        try:
            if op is None:
                raise _BadRequest(f"unknown op {op_name!r}")
            return op(call, body)
        except _BadRequest as exc:
            self.bad_requests += 1
            return {"status": "error", "message": f"bad request: {exc}"}
        except _NotAnInteger as exc:
            return {"status": "value_error", "message": str(exc)}

    def _op_hello(self, body: dict[str, Any]) -> dict[str, Any]:
        """First contact: the server's nonce and proof; the minted token, sealed, to a
        client without one whose claim the ``issue`` policy allows."""
        cn = body.get("cn")
        if not isinstance(cn, bytes) or len(cn) != NONCE_BYTES:
            raise _BadRequest("field 'cn' missing or not a nonce")
        if self._sessions is None or self.token is None:
            if body.get("auth"):  # the client expects a token: it will refuse us, say so here
                self._rejected += 1
                log.warning(
                    "ringcomm store %s:%d: a client that uses a token contacted this store, "
                    "which runs without one (RINGCOMM_SECURITY=none): token mismatch", self.host,
                    self.port,
                )  # fmt: skip
            return {"status": "ok", "auth": "none"}
        sn = self._sessions.server_nonce(cn)
        reply: dict[str, Any] = {
            "status": "ok",
            "auth": "token",
            "sn": sn,
            "proof": mac(self._sessions.key(cn), b"hello", cn, sn),
        }
        dh = body.get("dh")
        if dh is None:
            return reply
        if not isinstance(dh, bytes):
            raise _BadRequest("field 'dh' is not bytes")
        claim = body.get("claim")
        claim = claim if isinstance(claim, str) else None
        who = body.get("who")
        who = who[:200] if isinstance(who, str) else "a process"
        why = self._issue_refused(claim, who)
        if why is not None:
            self._rejected += 1
            log.warning("ringcomm store %s:%d: %s", self.host, self.port, why)
            member = parse_claim(claim)
            failed = None if member is None else self._formations.failed().get(member[1])
            if failed is not None:  # its group failed (this claim may have failed it)
                return {"status": "refused", "message": failed}
            # A claim of no group here yet may be early (its host opens it next): say so.
            pending = isinstance(self._issue, set) and claim not in self._issued
            return {"status": "auth", "why": why, "pending": pending}
        if self._dh is None:
            self._dh = dh_keypair()
        shared = dh_shared(self._dh[0], dh)
        if shared is None:
            raise _BadRequest("field 'dh' is not a valid public value")
        if isinstance(self._issue, set):
            assert claim is not None
            self._issued[claim] = who
        reply["dh"] = self._dh[1]
        reply["box"] = seal(shared, cn, sn, self.token.encode())
        return reply

    def allow_claims(self, claims: Collection[str]) -> None:
        """Also hand the minted token to ``claims`` (once each): the members of another
        group meeting at this store. Any thread; a server handing out to anyone or no one
        is left as it is."""
        with self._claims_lock:
            if isinstance(self._issue, set):
                self._issue = self._issue | set(claims)

    def _issue_refused(self, claim: str | None, who: str) -> str | None:
        """Why the minted token is not handed to ``claim`` (None: it is). A second claim
        of a rank of a group still forming fails that group (join.py)."""
        policy = self._issue
        if policy is None:
            return (
                "a process without the token asked for it: this store hands out no token "
                "(the job's token is RINGCOMM_TOKEN or token=)"
            )
        if policy == "any":
            return None
        assert isinstance(policy, set)
        held = self._issued.get(claim) if claim is not None else None
        if held is not None:
            member = parse_claim(claim)
            if member is not None and self._formations.claimed_twice(member[1], member[0],
                                                                     who, held):  # fmt: skip
                self._refuse_waiters()
            return (
                f"{claim} already received the job's token ({held}); {who} claims it again: "
                f"two processes claim {claim}, or a process not of this job took its place"
            )
        if claim not in policy:
            member = parse_claim(claim)
            # Rank 0 hosts this store and claims nothing: a second process says it is
            # rank 0 (it found the port taken).
            if (member is not None and member[0] == 0 and self._host is not None
                    and claim_of(1, member[1]) in policy
                    and self._formations.claimed_twice(member[1], 0, who, self._host)):  # fmt: skip
                self._refuse_waiters()
            return f"{claim or 'a process'} asked for the job's token but is not a member still to join"
        return None

    def _store(self, key: str, value: bytes) -> None:
        """Set ``key`` and answer the waiters it completes."""
        self._data[key] = value
        for waiter_id in self._waiters_by_key.pop(key, set()):
            waiter = self._waiters.get(waiter_id)
            if waiter is None:
                continue
            waiter.missing.discard(key)
            if waiter.missing:
                continue
            # Recheck every key: one may have been deleted since it was seen.
            still_missing = {k for k in waiter.keys if k not in self._data}
            if still_missing:
                waiter.missing = still_missing
                for k in still_missing:
                    self._waiters_by_key.setdefault(k, set()).add(waiter_id)
                continue
            del self._waiters[waiter_id]
            self._rpc.reply(waiter.call, self._satisfied(waiter))

    def _satisfied(self, waiter: _Waiter) -> dict[str, Any]:
        if waiter.op == "get":
            return {"status": "ok", "value": self._data[waiter.keys[0]]}
        return {"status": "ok"}

    def _park(self, call: RpcCall, op: str, keys: list[str], timeout_s: float) -> None:
        waiter_id = next(self._waiter_ids)
        missing = {k for k in keys if k not in self._data}
        self._waiters[waiter_id] = _Waiter(call, op, keys, missing)
        for k in missing:
            self._waiters_by_key.setdefault(k, set()).add(waiter_id)
        self._rpc.call_later(timeout_s, lambda: self._expire(waiter_id))

    def _unpark(self, waiter_id: int) -> _Waiter | None:
        """Forget a parked waiter (None: answered already)."""
        waiter = self._waiters.pop(waiter_id, None)
        if waiter is None:
            return None
        for k in waiter.missing:
            ids = self._waiters_by_key.get(k)
            if ids is not None:
                ids.discard(waiter_id)
                if not ids:
                    del self._waiters_by_key[k]
        return waiter

    def _expire(self, waiter_id: int) -> None:
        """A parked waiter's deadline: forget it and answer with the keys still missing."""
        waiter = self._unpark(waiter_id)
        if waiter is None:
            return  # answered already
        self._rpc.reply(waiter.call, {"status": "timeout", "missing": sorted(waiter.missing)})

    def _op_ping(self, call: RpcCall, body: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok"}

    def _op_set(self, call: RpcCall, body: dict[str, Any]) -> dict[str, Any]:
        self._store(_field(body, "key", str), _field(body, "value", bytes))
        return {"status": "ok"}

    def _op_get(self, call: RpcCall, body: dict[str, Any]) -> dict[str, Any] | None:
        key = _field(body, "key", str)
        timeout_s = _timeout_field(body)
        if key in self._data:
            return {"status": "ok", "value": self._data[key]}
        if (refused := self._formations.failure([key])) is not None:
            return {"status": "refused", "message": refused}
        self._park(call, "get", [key], timeout_s)
        return None

    def _op_try_get(self, call: RpcCall, body: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok", "value": self._data.get(_field(body, "key", str))}

    def _op_add(self, call: RpcCall, body: dict[str, Any]) -> dict[str, Any]:
        key = _field(body, "key", str)
        delta = _field(body, "delta", int)
        old = self._data.get(key, b"0")
        if not _INT_RE.fullmatch(old):
            raise _NotAnInteger(f"add on key {key!r}: its value {old[:32]!r} is not an integer")
        new = int(old) + delta
        self._store(key, str(new).encode())
        return {"status": "ok", "value": new}

    def _op_wait(self, call: RpcCall, body: dict[str, Any]) -> dict[str, Any] | None:
        keys = _keys_field(body)
        timeout_s = _timeout_field(body)
        if all(k in self._data for k in keys):
            return {"status": "ok"}
        if (refused := self._formations.failure(keys)) is not None:
            return {"status": "refused", "message": refused}
        self._park(call, "wait", keys, timeout_s)
        return None

    def _op_delete(self, call: RpcCall, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "status": "ok",
            "deleted": self._data.pop(_field(body, "key", str), None) is not None,
        }

    def _op_check(self, call: RpcCall, body: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok", "exists": all(k in self._data for k in _keys_field(body))}

    def _op_compare_set(self, call: RpcCall, body: dict[str, Any]) -> dict[str, Any]:
        key = _field(body, "key", str)
        expected = body.get("expected")
        if expected is not None and not isinstance(expected, bytes):
            raise _BadRequest("field 'expected' is not bytes or None")
        desired = _field(body, "desired", bytes)
        current = self._data.get(key)
        if current is None:
            # torch: a missing key is swapped only when the expected value is empty ("no
            # value"); otherwise the expected value is returned and nothing is stored.
            if expected:
                return {"status": "ok", "value": expected}
            self._store(key, desired)
            return {"status": "ok", "value": desired}
        if expected is not None and current == expected:
            self._store(key, desired)
            return {"status": "ok", "value": desired}
        return {"status": "ok", "value": current}


    def _op_join(self, call: RpcCall, body: dict[str, Any]) -> dict[str, Any] | None:
        req = JoinRequest.from_body(body)
        if req is None:
            raise _BadRequest("join: fields ns, rank, world_size, version, who, nonce")
        if not self._formations.admits(req):
            return {"status": "not_yet"}
        refused = self._formations.join(req)
        if refused is None:
            return {"status": "ok"}
        self._rpc.reply(call, {"status": "refused", "message": refused})  # (before the others)
        self._refuse_waiters()
        return None

    def _refuse_waiters(self) -> None:
        """Answer every parked waiter of a failed namespace with its error."""
        for waiter_id, waiter in list(self._waiters.items()):
            refused = self._formations.failure(waiter.keys)
            if refused is not None and self._unpark(waiter_id) is not None:
                self._rpc.reply(waiter.call, {"status": "refused", "message": refused})


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

    Connects at construction (a first contact, see the module docstring): raises
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
        self._conn = _Connection(host, port, (token or None) if auth else None,
                                 label or "store client")  # fmt: skip
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
