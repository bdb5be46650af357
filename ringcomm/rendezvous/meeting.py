"""Where a new group meets: its store, its key namespace, and the checks before the wait.

:func:`ringcomm.init_process_group` forms a group in four steps: the namespace
(:func:`next_namespace`: the k-th group a process forms at one meeting point uses
``pg<k>``), the store (rank 0 serves it, :func:`serve_store`, or a launcher does; under
torchrun through :func:`publish_address`/:func:`read_address`), the join
(:func:`join_request`, checked by :mod:`ringcomm.rendezvous.join`) and the wait
(:func:`wait_for_ranks`, naming missing ranks after :data:`NOTICE_S`).

Invariant: every rank of a job forms its groups in the same order, so groups formed one
after another or side by side never read each other's keys. Details: docs/architecture.md,
section "rendezvous/meeting.py".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from ringcomm.config import InitConfig
from ringcomm.errors import AuthenticationError, CommTimeoutError, RendezvousError
from ringcomm.rendezvous.hosting import ServerLease, serve
from ringcomm.rendezvous.join import JoinRefusedError, JoinRequest
from ringcomm.rendezvous.security import connect_store
from ringcomm.rendezvous.store import ClaimPendingError, Store
from ringcomm.rendezvous.torchstore import TorchStoreClient
from ringcomm.transport.rpc import RpcConnectionLost, RpcTimeoutError

__all__ = [
    "NOTICE_S",
    "REFUSAL_LINGER_S",
    "close_hosted",
    "connect_and_join",
    "join_request",
    "next_namespace",
    "publish_address",
    "read_address",
    "serve_store",
    "wait_for_ranks",
]

log = logging.getLogger("ringcomm")

#: How long a rendezvous waits before it says, once, which ranks it still waits for.
NOTICE_S = 5.0
#: How long rank 0 looks for another rank 0's store at a port it cannot bind.
_PROBE_S = 1.0
#: How long a rank joining keeps reaching a store that goes away before admitting it.
_LOST_S = 5.0
#: How long rank 0 serves on after its group was refused, so that every rank gets its
#: refusal (a closing server drops the replies it has not sent).
REFUSAL_LINGER_S = 1.0

_lock = threading.Lock()
_formed: dict[tuple[str, int], int] = {}  # groups formed per meeting point


def next_namespace(cfg: InitConfig) -> str:
    """``pg<k>``: the key namespace of the k-th group this process forms at ``cfg``'s
    meeting point (torchrun's store, else the store's address)."""
    where = (
        (cfg.torch_store.host, cfg.torch_store.port)
        if cfg.torch_store is not None
        else (cfg.master_addr, cfg.master_port)
    )
    with _lock:
        k = _formed.get(where, 0)
        _formed[where] = k + 1
    return f"pg{k}"


def join_request(cfg: InitConfig, ns: str, version: str, opens: bool = False) -> JoinRequest:
    """What this rank says when it joins namespace ``ns`` (a fresh nonce per join);
    ``opens``: this rank hosts the store."""
    who = f"pid {os.getpid()} on {socket.gethostname()}"
    return JoinRequest(ns, cfg.rank, cfg.world_size, version, who, uuid.uuid4().hex, opens)


def connect_and_join(cfg: InitConfig, join: JoinRequest, label: str) -> Store:
    """A store connection to ``cfg``'s address on which ``join`` was admitted. A store
    that does not serve the group yet (its host has not opened it: the store of the host's
    previous group may still be closing at that port) is left and reached again, until
    the group's deadline; after :data:`NOTICE_S` this says so once."""
    deadline = time.monotonic() + cfg.timeout_s
    notice_at = time.monotonic() + NOTICE_S
    lost_since: float | None = None
    delay_s = 0.005
    unreached = False  # the last try found no store answering at all
    token = cfg.token  # or the one the store hands out, at the first contact
    while True:
        now = time.monotonic()
        # Until the notice, a first contact is given only until then (a store that is not
        # up yet: its host may start late); after it, the rest of the deadline.
        contact_s = max(0.1, min(deadline, notice_at) - now)
        store: Store | None = None
        try:
            store = connect_store(
                cfg,
                cfg.master_addr,
                cfg.master_port,
                label,
                join.ns,
                token=token,
                connect_timeout_s=contact_s,
            )
            token = store.token  # handed out once: kept for the next try
            unreached = False
            if store.join(join):
                joined, store = store, None
                return joined
        except ClaimPendingError:
            unreached = False  # a store not serving the group (yet): as "not_yet" below
        except RendezvousError as exc:
            if isinstance(exc.__cause__, RpcTimeoutError) and time.monotonic() < deadline:
                unreached = True  # not up yet: say so at the notice, then wait on
            elif isinstance(exc.__cause__, RpcConnectionLost):
                # Lost before it admitted us: the host's previous store closing at this
                # port (reach the next), or its host died (say so, after a while).
                lost_since = time.monotonic() if lost_since is None else lost_since
                if time.monotonic() - lost_since > _LOST_S:
                    raise
            else:
                raise
        finally:
            if store is not None:
                store.close()
        now = time.monotonic()
        if now >= deadline:
            what = (
                "no store answered there"
                if unreached
                else f"the store there never served group {join.ns!r}"
            )
            raise CommTimeoutError(
                f"{label}: rendezvous timed out after {cfg.timeout_s:g} s: {what} (store "
                f"address {cfg.master_addr}:{cfg.master_port}; does rank 0 run, and form its "
                "groups in the same order as this rank?)"
            )
        if now >= notice_at:
            notice_at = float("inf")
            where = f"{cfg.master_addr}:{cfg.master_port}"
            what = (
                f"for the store at {where} to answer (rank 0 or the launcher serves it)"
                if unreached
                else f"for rank 0 to open group {join.ns!r} at the store at {where}"
            )
            log.warning(
                "%s: waited %g s %s; still waiting, up to %g s in all",
                label,
                NOTICE_S,
                what,
                cfg.timeout_s,
            )
        if not unreached:
            time.sleep(delay_s)
            delay_s = min(2 * delay_s, 0.1)


def serve_store(
    cfg: InitConfig, bind_host: str, port: int, join: JoinRequest, label: str
) -> ServerLease | None:
    """Rank 0's store on ``bind_host:port`` (this process's live one there is shared).

    When the port is taken, it may be another rank 0 of the same job serving there (a
    duplicate rank): look (for :data:`_PROBE_S`) and join that store as rank 0, which
    raises naming both processes, or returns None if that store admits this rank (its
    host will be refused instead, and this rank then too, as a member of a failed group).
    Anything else raises the bind error."""
    try:
        return serve(
            bind_host,
            port,
            token=cfg.token,
            security=cfg.security,
            world_size=cfg.world_size,
            ns=join.ns,
        )
    except RendezvousError as exc:
        if port == 0 or cfg.world_size < 2:
            raise
        try:  # (without a token, the claim of a second rank 0 fails the group there)
            probe = connect_store(
                cfg, cfg.master_addr, port, label, join.ns, connect_timeout_s=_PROBE_S
            )
        except JoinRefusedError:
            raise
        except (RendezvousError, AuthenticationError):
            raise exc from None
        with probe:
            probe.join(join)  # refused: the duplicate, named by the store's host
        return None


def close_hosted(server: ServerLease, error: BaseException | None) -> None:
    """Close rank 0's store after its group failed to form (``error``); after a refusal,
    serve on for :data:`REFUSAL_LINGER_S` first, so the other ranks receive theirs."""
    if isinstance(error, JoinRefusedError):
        time.sleep(REFUSAL_LINGER_S)
    server.close()


def _published_key(cfg: InitConfig, ns: str) -> str:
    assert cfg.torch_store is not None
    return f"{cfg.torch_store.prefix}/{ns}/store"


def publish_address(
    cfg: InitConfig, ns: str, addr: str, port: int, label: str
) -> tuple[str, int] | None:
    """Rank 0 under torchrun: publish ``addr:port`` for group ``ns`` in torchrun's store.
    None when published; another rank 0's address if one published first (a duplicate
    rank 0: the caller joins that store instead, where the duplicate is named)."""
    ts = cfg.torch_store
    assert ts is not None
    mine = json.dumps({"addr": addr, "port": port, "pid": os.getpid()}).encode()
    with TorchStoreClient(ts.host, ts.port, cfg.timeout_s, label) as client:
        now = client.compare_set(_published_key(cfg, ns), b"", mine)
    if now == mine:
        return None
    theirs = json.loads(now)
    return str(theirs["addr"]), int(theirs["port"])


def read_address(cfg: InitConfig, ns: str, label: str) -> tuple[str, int]:
    """Ranks but 0 under torchrun: the address rank 0 published for group ``ns``."""
    ts = cfg.torch_store
    assert ts is not None
    key = _published_key(cfg, ns)
    deadline = time.monotonic() + cfg.timeout_s
    first = min(NOTICE_S, cfg.timeout_s)
    with TorchStoreClient(ts.host, ts.port, cfg.timeout_s, label) as client:
        try:
            raw = client.get(key, first)
        except CommTimeoutError:
            if first >= cfg.timeout_s:
                raise
            log.warning(
                "%s: waited %g s for rank 0 to publish the store's address in "
                "torchrun's store (%s:%d, key %r); still waiting, up to %g s in all",
                label,
                first,
                ts.host,
                ts.port,
                key,
                cfg.timeout_s,
            )
            raw = b""
    if not raw:
        with TorchStoreClient(ts.host, ts.port, cfg.timeout_s, label) as client:
            raw = client.get(key, max(0.001, deadline - time.monotonic()))
    info = json.loads(raw)
    return str(info["addr"]), int(info["port"])


def wait_for_ranks(store: Store, keys: list[str], cfg: InitConfig, label: str) -> None:
    """Wait for every rank's ``keys`` (``keys[r]`` is set by rank r) within the group's
    deadline; after :data:`NOTICE_S` say once which ranks are missing. A timeout raises
    :class:`CommTimeoutError` naming them."""
    deadline = time.monotonic() + cfg.timeout_s
    first = min(NOTICE_S, cfg.timeout_s)
    missing = store.wait_missing(keys, timeout_s=first)
    if missing and first < cfg.timeout_s:
        log.warning(
            "%s: waited %g s for %s to join the group (world_size=%d, store at "
            "%s:%d); still waiting, up to %g s in all",
            label,
            first,
            _ranks(keys, missing),
            cfg.world_size,
            cfg.master_addr,
            cfg.master_port,
            cfg.timeout_s,
        )
        missing = store.wait_missing(keys, timeout_s=max(0.001, deadline - time.monotonic()))
    if missing:
        raise CommTimeoutError(
            f"{label}: rendezvous timed out after {cfg.timeout_s:g} s: {_ranks(keys, missing)} "
            f"never joined (world_size={cfg.world_size}, store at {cfg.master_addr}:"
            f"{cfg.master_port})"
        )


def _ranks(keys: list[str], missing: list[str]) -> str:
    ranks = [r for r, k in enumerate(keys) if k in missing]
    shown = ", ".join(map(str, ranks[:16])) + (
        f" ... ({len(ranks)} in all)" if len(ranks) > 16 else ""
    )
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"
