"""Agreeing on the survivors of a failed world group (``ProcessGroup.shrink``).

After a peer failed, every survivor calls ``shrink()``. Each publishes, in the store under
``shrink/<epoch>/<global rank>``, the ranks it knows to be gone (:func:`dead_view`: failed
or departed peers as the progress engine saw them, same-host peers whose process ended)
and reads the others'. A survivor adopts every rank another survivor reports gone (the
failure detectors here are exact: a dropped connection, an ended process, a goodbye), so
the views only grow and converge. It is done when every rank it believes alive has
published exactly its own view: the survivors, in old rank order, are the new group.

What goes wrong, and what each survivor then raises (never a hang):

* a survivor that had published its view dies before the others are done (a second
  failure during the shrink): ``PeerFailedError`` "failed during the shrink";
* a rank another survivor counts as gone is this one: ``PeerFailedError``;
* a rank believed alive does not publish before the deadline (it never calls ``shrink``):
  ``CommTimeoutError`` naming it.

A survivor that finished just before a second failure finds it when the new group forms
(its rendezvous watches the same detectors, :func:`watch_members`) or at the new group's
first call, which fails with ``PeerFailedError`` as any call does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

from ringcomm.core.group_core import GroupCore, wait_for_exit
from ringcomm.errors import (
    AuthenticationError,
    CommTimeoutError,
    PeerFailedError,
    RendezvousError,
    RingcommError,
)
from ringcomm.rendezvous import Store

__all__ = [
    "FAILOVER_PORTS",
    "GONE_SETTLE_S",
    "SHRINK_SLICE_S",
    "agree_survivors",
    "connect_store",
    "dead_view",
    "explain_store_loss",
    "failover_ports",
    "watch_members",
]

#: How often a shrinking survivor looks at the store and its failure detectors.
SHRINK_SLICE_S = 0.02

#: How long a survivor that saw a member go looks for others before it says who went.
GONE_SETTLE_S = 0.3

#: How many ports after the old store's a failover store may take (the first free one).
FAILOVER_PORTS = 8


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
    core: GroupCore, store: Store, epoch: int, deadline: float, timeout_s: float,
    dead: set[int] | None = None,
) -> list[int]:  # fmt: skip
    """The survivors of ``core``'s group (global ranks, in order), agreed by all of them
    through ``store`` (module docstring); ``dead``: ranks already known gone. A lost
    store raises ``RendezvousError``: :func:`explain_store_loss` says who went."""
    return _agree(core, store, epoch, deadline, timeout_s, dead)


def connect_store(
    core: GroupCore, addr: str, ports: Sequence[int], token: str | None, deadline: float,
    store_host: int | None, dead: set[int],
) -> tuple[Store, int]:  # fmt: skip
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
                store = Store(addr, port, token=token, timeout_s=max(0.1, remaining),
                              connect_timeout_s=max(0.05, min(probe_s, remaining)),
                              label=label, auth=token is not None)  # fmt: skip
            except AuthenticationError:
                if len(ports) == 1:
                    raise
                continue  # another job's server holds that candidate port
            except RendezvousError as exc:
                if remaining <= probe_s or (store_host is not None
                                            and store_host in dead_view(core)):  # fmt: skip
                    raise explain_store_loss(core, exc, store_host, dead) from exc
                continue
            return store, port


def failover_ports(port: int) -> list[int]:
    """The ports a new store may take after its host died: the first free of these
    (``port`` is the old store's)."""
    return [p for p in range(port + 1, port + 1 + FAILOVER_PORTS) if p <= 65535]


def explain_store_loss(
    core: GroupCore, exc: RendezvousError, store_host: int | None, dead: set[int],
    wait_s: float = 1.0,
) -> RingcommError:  # fmt: skip
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
            also = (f"; rank {store_host}, which served the store, is gone too"
                    if store_host in gone else "")  # fmt: skip
            return PeerFailedError(f"{what}: {who} during the shrink{also} ({exc})",
                                   peer=others[0])  # fmt: skip
        if time.monotonic() >= give_up:
            break
        time.sleep(SHRINK_SLICE_S)
    if store_host is not None and store_host in gone:
        return PeerFailedError(f"{what}: rank {store_host} failed during the shrink (it "
                               f"served the store): {exc}", peer=store_host)  # fmt: skip
    return exc


def _agree(
    core: GroupCore, store: Store, epoch: int, deadline: float, timeout_s: float,
    dead: set[int] | None,
) -> list[int]:  # fmt: skip
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
            went = sorted(known - gone_before)
            raise PeerFailedError(
                f"{what}: {_who_went(went)} during the shrink (after rank {lost[0]} had "
                "joined it)", peer=went[0],
            )  # fmt: skip
        joined |= set(views)
        alive = [g for g in core.ranks if g not in known]
        if known == published and all(views.get(g) == known for g in alive):
            return alive
        if time.monotonic() >= deadline:
            missing = [g for g in alive if g not in views]
            differ = [g for g in alive if g in views and views[g] != known]
            why = (f"waiting for rank{'s' if len(missing) > 1 else ''} "
                   f"{', '.join(map(str, missing))} to call shrink()") if missing else (
                   f"ranks {', '.join(map(str, differ))} see other failures")  # fmt: skip
            raise CommTimeoutError(f"{what} timed out after {timeout_s:g} s: {why} "
                                   f"(gone: {sorted(known)})")  # fmt: skip
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
            give_up = time.monotonic() + GONE_SETTLE_S
            while time.monotonic() < give_up:
                time.sleep(SHRINK_SLICE_S)
                gone = sorted(set(gone) | (dead_view(core) & set(members)))
            gone = sorted(set(gone) | (dead_view(core) - before))
            raise PeerFailedError(
                f"{what}: {_who_went(gone)} during the shrink (before the new group formed)",
                peer=gone[0],
            )  # fmt: skip

    return check


def _who_went(ranks: Sequence[int]) -> str:
    """"rank 3 failed", or for several "ranks 2, 3 failed or gave up": which of them failed
    first, and which left because it saw that, a survivor cannot tell."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} failed"
    return f"ranks {', '.join(map(str, ranks))} failed or gave up"
