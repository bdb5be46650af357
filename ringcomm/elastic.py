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

from .errors import CommTimeoutError, PeerFailedError, RendezvousError, RingcommError
from .group_core import GroupCore, wait_for_exit
from .rendezvous import Store

__all__ = [
    "SHRINK_SLICE_S",
    "agree_survivors",
    "dead_view",
    "wait_for_store_host",
    "watch_members",
]

#: How often a shrinking survivor looks at the store and its failure detectors.
SHRINK_SLICE_S = 0.02


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
    dead: set[int] | None = None, store_host: int | None = None,
) -> list[int]:  # fmt: skip
    """The survivors of ``core``'s group (global ranks, in order), agreed by all of them
    through ``store`` (module docstring); ``dead``: ranks already known gone;
    ``store_host``: the global rank serving ``store`` (None: a launcher does)."""
    try:
        return _agree(core, store, epoch, deadline, timeout_s, dead)
    except RendezvousError as exc:  # the store went: its host died during the shrink?
        host = store_host
        if host is not None and (host in dead_view(core) or wait_for_store_host(core, host)):
            raise PeerFailedError(
                f"rank {core.rank}: shrink: rank {host} failed during the shrink (it served "
                f"the store): {exc}", peer=host,
            ) from exc  # fmt: skip
        raise


def _agree(
    core: GroupCore, store: Store, epoch: int, deadline: float, timeout_s: float,
    dead: set[int] | None,
) -> list[int]:  # fmt: skip
    me = core.global_rank
    what = f"rank {core.rank}: shrink"
    prefix = f"shrink/{epoch}"
    known = set(dead or ()) | dead_view(core)
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
        if lost:
            raise PeerFailedError(
                f"{what}: rank {lost[0]} failed during the shrink (after it had joined it)",
                peer=lost[0],
            )
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


def wait_for_store_host(core: GroupCore, host: int, wait_s: float = 1.0) -> bool:
    """Whether global rank ``host`` is gone (waiting up to ``wait_s`` for its detection)."""
    give_up = time.monotonic() + wait_s
    while time.monotonic() < give_up:
        if host in dead_view(core):
            return True
        time.sleep(SHRINK_SLICE_S)
    return False


def watch_members(core: GroupCore, members: Sequence[int]) -> Callable[[], None]:
    """A check for the new group's rendezvous: raises ``PeerFailedError`` once one of
    ``members`` (global ranks of ``core``'s group) is known gone."""
    what = f"rank {core.rank}: shrink"

    def check() -> None:
        gone = sorted(dead_view(core) & set(members))
        if gone:
            raise PeerFailedError(
                f"{what}: rank {gone[0]} failed during the shrink (before the new group "
                "formed)", peer=gone[0],
            )  # fmt: skip

    return check
