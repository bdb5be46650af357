"""The rendezvous store's server: one thread that holds the keys and answers the clients.

A ``get``/``wait`` for missing keys is parked here (a deferred RPC reply) and answered by
the ``set``/``add`` that completes it, or by a timeout reply at its deadline. A client's
first contact (``hello``) agrees on a signed session; a server made without a token mints
one and hands it out, sealed, within its ``issue`` policy. All state lives on the server
thread, so it needs no locks. docs/architecture.md ("The rendezvous store") has the
protocol: the handshake, the request bodies and the replies.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import socket
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ringcomm.errors import RendezvousError
from ringcomm.rendezvous.join import Formations, JoinRequest, parse_claim
from ringcomm.rendezvous.join import claim as claim_of
from ringcomm.transport.rpc import RpcCall, RpcError, RpcServer
from ringcomm.transport.session import (
    NONCE_BYTES,
    SessionKeys,
    dh_keypair,
    dh_shared,
    mac,
    mint_token,
    seal,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["StoreServer"]

# (The store's logger, as before the server had its own module.)
log = logging.getLogger("ringcomm.rendezvous.store")

_INT_RE = re.compile(rb"[+-]?\d+")


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
    on first contact (docs/architecture.md; default ``"any"`` for a minted token, ``None``
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
                    "which runs without one (RINGCOMM_SECURITY=none): token mismatch",
                    self.host,
                    self.port,
                )
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
            if member is not None and self._formations.claimed_twice(
                member[1], member[0], who, held
            ):
                self._refuse_waiters()
            return (
                f"{claim} already received the job's token ({held}); {who} claims it again: "
                f"two processes claim {claim}, or a process not of this job took its place"
            )
        if claim not in policy:
            member = parse_claim(claim)
            # Rank 0 hosts this store and claims nothing: a second process says it is
            # rank 0 (it found the port taken).
            if (
                member is not None
                and member[0] == 0
                and self._host is not None
                and claim_of(1, member[1]) in policy
                and self._formations.claimed_twice(member[1], 0, who, self._host)
            ):
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
