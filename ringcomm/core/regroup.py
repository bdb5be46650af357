"""Regrouping a world group: shrink to the survivors, grow by restarted ranks, rejoin.

:func:`shrink` (``ProcessGroup.shrink``): after a peer failed, the survivors agree on who
survived through the store (:func:`agree_survivors`: each publishes the ranks it knows
gone, views only grow and converge) and form a new world group of them; if the store died
with its host, the lowest survivor serves a new one. :func:`grow` (``ProcessGroup.grow``)
admits restarted ranks that asked to join (:func:`rejoin`, in the restarted process).

Guarantees: every survivor gets the same member list or raises (``PeerFailedError``,
``CommTimeoutError`` naming who is missing), never hangs; the old group is closed only
once the new one formed and passed a barrier. These functions return what ``wrap`` makes
of the new core (the facade, :class:`ringcomm.group.ProcessGroup`). docs/architecture.md,
"Forming a group", says what goes wrong and what each survivor raises.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from ringcomm.config import InitConfig
from ringcomm.core.forming import form_world, store_view
from ringcomm.core.group_core import GroupCore, wait_for_exit
from ringcomm.core.progress import DEPART_CLOSE
from ringcomm.errors import (
    AuthenticationError,
    CommTimeoutError,
    GroupClosedError,
    PeerFailedError,
    RendezvousError,
    RingcommError,
)
from ringcomm.rendezvous import Store, StoreServer
from ringcomm.rendezvous.hosting import ServerLease
from ringcomm.transport.endpoints import EndpointInfo, bind_host

__all__ = [
    "FAILOVER_PORTS",
    "GONE_SETTLE_S",
    "SHRINK_SLICE_S",
    "Facade",
    "agree_survivors",
    "connect_store",
    "dead_view",
    "explain_store_loss",
    "failover_ports",
    "grow",
    "next_epoch",
    "rejoin",
    "shrink",
    "watch_members",
]

#: How often a shrinking survivor looks at the store and its failure detectors.
SHRINK_SLICE_S = 0.02

#: How long a survivor that saw a member go looks for others before it says who went.
GONE_SETTLE_S = 0.3

#: How many ports after the old store's a failover store may take (the first free one).
FAILOVER_PORTS = 8


class Facade(Protocol):
    """What regrouping needs of the group facade (:class:`ringcomm.group.ProcessGroup`):
    its core, and its barrier and broadcast (collectives live above this layer)."""

    core: GroupCore

    def barrier(
        self, async_op: bool = False, *, timeout_s: float | None = None, algo: str | None = None
    ) -> Any: ...

    def broadcast(
        self,
        x: Any,
        src: int = 0,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any: ...


#: The facade a regroup returns: what ``wrap`` makes of the new group's core.
G = TypeVar("G", bound=Facade)


def shrink(core: GroupCore, timeout_s: float | None, wrap: Callable[[GroupCore], G]) -> G:
    """The new world group of the survivors of ``core``'s (``ProcessGroup.shrink``), as
    ``wrap`` makes it; ``core``'s group is then closed. Every survivor calls it; they agree
    on who survived through the store (:func:`agree_survivors`)."""
    if not core.is_world:
        raise ValueError(
            f"rank {core.rank}: shrink: call it on the world group (this is "
            "a sub-group; make sub-groups again on the result)"
        )
    if core.closed or core.state.closed:
        raise GroupClosedError(f"rank {core.rank}: shrink: the process group is closed")
    t = core.timeout(timeout_s)
    deadline = time.monotonic() + t
    old = core.state
    epoch = old.epoch + 1
    dead = dead_view(core)
    store_host, addr, ports, server, moved = _shrink_store(core, dead)
    store: Store | None = None
    try:
        try:
            store, port = connect_store(
                core, addr, ports, old.config.token, deadline, store_host, dead
            )
            members = agree_survivors(
                core, store_view(store, old.namespace), epoch, deadline, t, dead
            )
            slots = [old.slots[g] for g in members]
            return next_epoch(
                core,
                store,
                addr,
                port,
                server,
                moved,
                epoch,
                slots,
                deadline,
                wrap,
                watch=watch_members(core, members, dead),
            )
        except RendezvousError as exc:  # the store went: who else went with it?
            raise explain_store_loss(core, exc, store_host, dead) from exc
    except BaseException:
        if store is not None:
            store.close()
        if server is not None and not moved:
            server.close()
        raise


def _shrink_store(
    core: GroupCore, dead: set[int]
) -> tuple[int | None, str, list[int], StoreServer | ServerLease | None, bool]:
    """Where the shrink meets: the store's host (a global rank; None: a launcher serves
    it), its address, the ports to try, the server this rank serves it with (None: it
    does not) and whether that is the old group's (moved on to the new group). If the
    store died with its host (rank 0), the lowest survivor serves a new one."""
    old = core.state
    cfg = old.config
    store_host = None if cfg.store_external else 0
    if store_host is None or store_host not in dead:
        return store_host, cfg.master_addr, [old.store_port], old.server, old.server is not None
    leader = min(g for g in core.ranks if g not in dead)
    addr, ports = _address_of(old.peers[leader]), failover_ports(old.store_port)
    server: StoreServer | None = None
    if leader == core.global_rank:
        server = _serve_failover(addr, ports, cfg.token, core.rank)
        ports = [server.port]
    return leader, addr, ports, server, False


def _serve_failover(addr: str, ports: list[int], token: str | None, rank: int) -> StoreServer:
    """The shrink's new store, on the first of ``ports`` that is free (one may be any
    socket's local port)."""
    errors = []
    for port in ports:
        try:
            return StoreServer(bind_host(addr), port, token=token, auth=token is not None).start()
        except RendezvousError as exc:
            errors.append(f"{port}: {exc}")
    raise RendezvousError(
        f"rank {rank}: shrink: cannot serve the new store on {addr}, "
        f"ports {ports[0]}..{ports[-1]}: " + "; ".join(errors)
    )


def _address_of(info: EndpointInfo) -> str:
    """The host address of a peer, from its tcp:// endpoint."""
    tcp = info.tcp or ""
    host = tcp.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host or "127.0.0.1"


def grow(
    group: G,
    wait: bool,
    timeout_s: float | None,
    on_admit: Callable[[], None] | None,
    wrap: Callable[[GroupCore], G],
) -> G:
    """``ProcessGroup.grow``: ``group`` itself if no restarted rank waits to join, else
    the new world group with them (as ``wrap`` makes it), ``group`` then closed. Rank 0
    reads who waits (``join/<slot>`` in the store) and broadcasts it; ``on_admit`` runs on
    every rank once they know, before any closes ``group``."""
    core = group.core
    if not core.is_world:
        raise ValueError(f"rank {core.rank}: grow: call it on the world group")
    core.check_usable("grow")
    t = core.timeout(timeout_s)
    deadline = time.monotonic() + t
    state = core.state
    root = state.root_store
    if root is None:
        return group  # a singleton: nobody to admit
    if core.rank == 0:  # per slot: 1 + the restart count waiting
        flags = _waiting_slots(core, root, wait, deadline)
    else:
        flags = np.zeros(state.slots_total, np.int64)
    group.broadcast(flags, 0, timeout_s=t)
    joiners = {int(s): int(f) - 1 for s, f in enumerate(flags) if f}
    if not joiners:
        return group
    if on_admit is not None:  # (before the new group's barrier: so before any close)
        on_admit()
    epoch = state.epoch + 1
    slots = sorted([*state.slots, *joiners])
    cfg = state.config
    if core.rank == 0:
        for slot, restart in joiners.items():
            root.set(f"admit/{slot}/{restart}", json.dumps([epoch, slots]).encode())
    addr, port = cfg.master_addr, state.store_port
    store = Store(
        addr,
        port,
        token=cfg.token,
        timeout_s=max(0.1, deadline - time.monotonic()),
        label=f"rank {core.global_rank}",
        auth=cfg.token is not None,
    )
    try:
        return next_epoch(
            core,
            store,
            addr,
            port,
            state.server,
            state.server is not None,
            epoch,
            slots,
            deadline,
            wrap,
        )
    except BaseException:
        store.close()
        raise


def _waiting_slots(core: GroupCore, root: Store, wait: bool, deadline: float) -> np.ndarray:
    """On rank 0: per rank slot, 1 + the restart count of a restarted rank waiting to join
    and not yet admitted, else 0. ``wait``: first wait for the slots the launcher says it
    is starting again."""
    state = core.state
    flags = np.zeros(state.slots_total, np.int64)
    if wait:
        job = state.job_store
        assert job is not None
        _wait_for_restarts(root, job, state.slots, state.slots_total, deadline, core.rank)
    for slot in range(state.slots_total):
        if slot in state.slots:
            continue
        raw = root.try_get(f"join/{slot}")
        if raw is not None and not root.check([f"admit/{slot}/{int(raw)}"]):
            flags[slot] = int(raw) + 1
    return flags


def next_epoch(
    core: GroupCore,
    store: Store,
    addr: str,
    port: int,
    server: StoreServer | ServerLease | None,
    moved: bool,
    epoch: int,
    slots: list[int],
    deadline: float,
    wrap: Callable[[GroupCore], G],
    watch: Callable[[], None] | None = None,
) -> G:
    """Form the world group of ``slots`` (rank slots, in order) at ``epoch`` through
    ``store`` (a connection of its own, owned by the new group), then close ``core``'s.
    ``moved``: ``server`` is the old group's, and serves the new one from now on."""
    old = core.state
    me = old.slots[core.rank]
    new_cfg = dataclasses.replace(
        old.config,
        rank=slots.index(me),
        world_size=len(slots),
        master_addr=addr,
        master_port=port,
        timeout_s=core.timeout_s,
    )
    new_core = form_world(
        new_cfg,
        store_view(store, old.namespace, f"epoch/{epoch}"),
        server,
        port,
        epoch,
        watch=watch,
        namespace=old.namespace,
    )
    new = new_core.state
    new.owned_store = store  # the connection under the view (closed with the group)
    new.recorder = old.recorder  # the flight record goes on across epochs
    new.slots, new.slots_total = list(slots), old.slots_total
    pg = wrap(new_core)
    pg.barrier(timeout_s=max(0.1, deadline - time.monotonic()))  # all agreed and formed
    if moved:
        old.server = None  # the new group serves the store now
    core.closed = True
    old.shutdown(DEPART_CLOSE, checkout_s=0.0, linger_s=0.0)  # nobody waits on it now
    core.close_workspace()
    return pg


def rejoin(
    cfg: InitConfig, conn: Store, port: int, namespace: str, wrap: Callable[[GroupCore], G]
) -> G:
    """A restarted rank (``RINGCOMM_RESTART`` > 0): ask to join the running job under
    ``join/<slot>`` and wait until the survivors' :func:`grow` admits it
    (``admit/<slot>/<restart>``: the epoch and its rank slots), then form that group.
    Its keys are those of group instance ``namespace`` (the first group a restarted
    process forms joins the survivors' first)."""
    slot, restart = cfg.rank, cfg.restart
    store = store_view(conn, namespace)
    store.set(f"join/{slot}", str(restart).encode())
    key = f"admit/{slot}/{restart}"
    try:
        store.wait([key], timeout_s=cfg.timeout_s)
    except CommTimeoutError:
        raise CommTimeoutError(
            f"rank {slot} (restart {restart}): no survivor admitted it within "
            f"{cfg.timeout_s:g} s (the running ranks admit restarted ones when they call "
            "pg.grow(), e.g. at a step boundary)"
        ) from None
    epoch, slots = json.loads(store.get(key))
    new_cfg = dataclasses.replace(cfg, rank=slots.index(slot), world_size=len(slots))
    core = form_world(
        new_cfg,
        store_view(conn, namespace, f"epoch/{epoch}"),
        None,
        port,
        int(epoch),
        namespace=namespace,
    )
    state = core.state
    state.owned_store = conn
    state.slots, state.slots_total, state.rejoined = list(slots), cfg.world_size, True
    pg = wrap(core)
    pg.barrier()  # as the survivors' grow does
    return pg


def _wait_for_restarts(
    root: Store, job: Store, present: list[int], total: int, deadline: float, rank: int
) -> None:
    """Until every slot the launcher is starting again (``restarting/<slot>`` = n in the
    ``job`` store, where the launcher says it) has asked to join (``join/<slot>`` = n in
    the group's ``root``), or ``deadline``."""
    while True:
        pending = []
        for slot in range(total):
            if slot in present:
                continue
            n = job.try_get(f"restarting/{slot}")
            asked = root.try_get(f"join/{slot}")
            if n is not None and (asked is None or int(asked) < int(n)):
                pending.append(slot)
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise CommTimeoutError(
                f"rank {rank}: grow: slot(s) {pending} being restarted did not ask to join in time"
            )
        try:
            root.wait([f"join/{pending[0]}"], timeout_s=SHRINK_SLICE_S * 5)
        except CommTimeoutError:
            pass


def dead_view(core: GroupCore) -> set[int]:
    """Global ranks of ``core``'s group this process knows to be gone (failed, departed,
    or a same-host process that ended)."""
    progress = core.progress
    try:
        progress.poll_now()  # goodbyes, failure reports, dropped connections
    except RingcommError:
        pass
    me = core.global_rank
    dead = {g for g in core.ranks if g != me and progress.departed(g)}
    state = core.state
    for g in core.ranks:
        info = state.peers.get(g)
        same_host = info is not None and info.host_id == state.host_id
        if g != me and same_host and info is not None and wait_for_exit(info.pid, 0.0):
            dead.add(g)
    return dead


def agree_survivors(
    core: GroupCore,
    store: Store,
    epoch: int,
    deadline: float,
    timeout_s: float,
    dead: set[int] | None = None,
) -> list[int]:
    """The survivors of ``core``'s group (global ranks, in order), agreed by all of them
    through ``store`` (module docstring); ``dead``: ranks already known gone. A lost
    store raises ``RendezvousError``: :func:`explain_store_loss` says who went."""
    return _agree(core, store, epoch, deadline, timeout_s, dead)


def connect_store(
    core: GroupCore,
    addr: str,
    ports: Sequence[int],
    token: str | None,
    deadline: float,
    store_host: int | None,
    dead: set[int],
) -> tuple[Store, int]:
    """The shrink's store client and its port, connected by ``deadline``: the first of
    ``ports`` that answers (the failover candidates, tried in turn: the first free one
    is served); if its host (global rank ``store_host``) is gone before it answers,
    :func:`explain_store_loss` at once rather than retrying until the deadline."""
    label = f"rank {core.global_rank}"
    probe_s = 0.5 if len(ports) == 1 else 0.2
    while True:
        for port in ports:
            remaining = deadline - time.monotonic()
            try:  # a short first contact: a host that is gone is noticed between tries
                store = Store(
                    addr,
                    port,
                    token=token,
                    timeout_s=max(0.1, remaining),
                    connect_timeout_s=max(0.05, min(probe_s, remaining)),
                    label=label,
                    auth=token is not None,
                )
            except AuthenticationError:
                if len(ports) == 1:
                    raise
                continue  # another job's server holds that candidate port
            except RendezvousError as exc:
                if remaining <= probe_s or (
                    store_host is not None and store_host in dead_view(core)
                ):
                    raise explain_store_loss(core, exc, store_host, dead) from exc
                continue
            return store, port


def failover_ports(port: int) -> list[int]:
    """The ports a new store may take after its host died: the first free of these
    (``port`` is the old store's)."""
    return [p for p in range(port + 1, port + 1 + FAILOVER_PORTS) if p <= 65535]


def explain_store_loss(
    core: GroupCore,
    exc: RendezvousError,
    store_host: int | None,
    dead: set[int],
    wait_s: float = 1.0,
) -> RingcommError:
    """What to raise when the shrink's store went away (``exc``): a ``PeerFailedError``
    naming a rank that failed during the shrink (waiting up to ``wait_s`` for the
    detectors), preferring one other than the store's host (``store_host``, a global
    rank; None: a launcher serves it), which may only have left because it saw that
    failure first; ``exc`` itself if nobody is known gone. ``dead``: gone before."""
    what = f"rank {core.rank}: shrink"
    give_up = time.monotonic() + wait_s
    while True:
        gone = dead_view(core) - dead
        others = sorted(gone - {store_host})
        if others:
            who = _who_went(others)
            also = (
                f"; rank {store_host}, which served the store, is gone too"
                if store_host in gone
                else ""
            )
            return PeerFailedError(f"{what}: {who} during the shrink{also} ({exc})", peer=others[0])
        if time.monotonic() >= give_up:
            break
        time.sleep(SHRINK_SLICE_S)
    if store_host is not None and store_host in gone:
        return PeerFailedError(
            f"{what}: rank {store_host} failed during the shrink (it served the store): {exc}",
            peer=store_host,
        )
    return exc


def _agree(
    core: GroupCore,
    store: Store,
    epoch: int,
    deadline: float,
    timeout_s: float,
    dead: set[int] | None,
) -> list[int]:
    me = core.global_rank
    what = f"rank {core.rank}: shrink"
    prefix = f"shrink/{epoch}"
    known = set(dead or ()) | dead_view(core)
    gone_before = set(known)
    published: set[int] | None = None
    joined: set[int] = set()
    while True:
        known |= dead_view(core)
        if known != published:
            store.set(f"{prefix}/{me}", json.dumps(sorted(known)).encode())
            published = set(known)
        alive = [g for g in core.ranks if g not in known]
        views: dict[int, set[int]] = {}
        for g in alive:
            raw = store.try_get(f"{prefix}/{g}")
            if raw is not None:
                views[g] = {int(v) for v in json.loads(raw)}
        for g, view in views.items():
            if me in view:
                raise PeerFailedError(
                    f"{what}: rank {g} counts this rank as failed; it shrinks without it",
                    peer=g,
                )
            known |= view
        lost = sorted(joined & known)
        if lost:  # name every rank gone since the shrink began: the first to go is unknown
            went = sorted(_settled(core, known) - gone_before)
            raise PeerFailedError(
                f"{what}: {_who_went(went)} during the shrink (after rank {lost[0]} had joined it)",
                peer=went[0],
            )
        joined |= set(views)
        alive = [g for g in core.ranks if g not in known]
        if known == published and all(views.get(g) == known for g in alive):
            return alive
        if time.monotonic() >= deadline:
            missing = [g for g in alive if g not in views]
            differ = [g for g in alive if g in views and views[g] != known]
            why = (
                (
                    f"waiting for rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} to call shrink()"
                )
                if missing
                else (f"ranks {', '.join(map(str, differ))} see other failures")
            )
            raise CommTimeoutError(
                f"{what} timed out after {timeout_s:g} s: {why} (gone: {sorted(known)})"
            )
        pending = [f"{prefix}/{g}" for g in alive if g not in views]
        if pending:
            try:
                store.wait(pending, timeout_s=SHRINK_SLICE_S)
            except CommTimeoutError:
                pass
        else:
            time.sleep(SHRINK_SLICE_S)  # views differ: theirs are still growing


def watch_members(
    core: GroupCore, members: Sequence[int], dead: set[int] | None = None
) -> Callable[[], None]:
    """A check for the new group's rendezvous: raises ``PeerFailedError`` once one of
    ``members`` (global ranks of ``core``'s group) is known gone. The error names, besides
    the members gone, every rank gone since the shrink began (``dead``: those gone
    before): a member may have left because it saw a rank this one had already left out
    of the group die during the shrink (it read that rank's view first), and that rank
    is the failure to name."""
    what = f"rank {core.rank}: shrink"
    before = set(dead or ())

    def check() -> None:
        gone = sorted(dead_view(core) & set(members))
        if gone:  # one that gave up on seeing a failure may be seen first: look again
            gone = sorted(_settled(core, set(gone)) - before)
            raise PeerFailedError(
                f"{what}: {_who_went(gone)} during the shrink (before the new group formed)",
                peer=gone[0],
            )

    return check


def _settled(core: GroupCore, gone: set[int]) -> set[int]:
    """``gone`` and every rank this process sees gone within :data:`GONE_SETTLE_S`: a rank
    that gave up on seeing a failure may be seen before the failure it saw."""
    gone = set(gone)
    give_up = time.monotonic() + GONE_SETTLE_S
    while time.monotonic() < give_up:
        time.sleep(SHRINK_SLICE_S)
        gone |= dead_view(core)
    return gone | dead_view(core)


def _who_went(ranks: Sequence[int]) -> str:
    """ "rank 3 failed", or for several "ranks 2, 3 failed or gave up": which of them failed
    first, and which left because it saw that, a survivor cannot tell."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} failed"
    return f"ranks {', '.join(map(str, ranks))} failed or gave up"
