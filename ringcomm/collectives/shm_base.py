"""What the shared-memory collectives (``shm``) are made of: a call's :class:`Job`, what
they use of the engine (:class:`ShmEngine`: the one in :mod:`ringcomm.collectives.workspace`),
and the rounds every family runs in.

A round moves at most a buffer (and at most the group's ``chunk_bytes``): each rank copies
its part into its own buffer, every rank syncs, each reads what it needs from the others'.
Rounds alternate each rank's two buffers. The first sync of a call is followed by the
fingerprint check, before any rank reads a byte of another's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ringcomm.collectives.base import Call, describe_fingerprint, fingerprint

if TYPE_CHECKING:
    from ringcomm.core.group_core import GroupCore
    from ringcomm.core.op import Op
    from ringcomm.transport.workspace import Window, Workspace

__all__ = ["HostCall", "Job", "ShmEngine", "barrier", "flat_rounds", "row_rounds"]


@dataclass(slots=True, eq=False)
class Job:
    """One collective call on the workspace: what the algorithms carry from call to sync.
    ``device``: a device algorithm's state taken at the call (the caller's stream): see
    :attr:`WorkspaceCollectives.extensions`."""

    core: GroupCore
    call: Call
    seq: int
    deadline: float
    timeout_s: float
    device: Any = None
    #: The group's asynchronous collective on the engine called just before this one, if
    #: any (``GroupCore.engine_tail``, a weak reference): this call waits for it first.
    after: weakref.ref[Op] | None = None
    note: str = ""  # where it waits (a sync), for the progress map

    @property
    def desc(self) -> str:
        """As the engine's collectives say it, plus where it runs."""
        fp = describe_fingerprint(fingerprint(self.call, self.core.chunk_bytes))
        return (
            f"{fp} (collective #{self.seq} of group {self.core.group_id}, on the shared workspace)"
        )


class ShmEngine(Protocol):
    """What a host algorithm uses of the workspace engine (one call at a time, under its
    lock): the workspace, its symmetric windows, the fingerprints, the syncs, the buffers."""

    ws: Workspace
    windows: list[Window]
    #: all_reduce calls that read this rank's x in place from its window.
    in_place_calls: int

    def publish(self, job: Job, call: Call) -> None: ...
    def sync(self, job: Job, where: str) -> None: ...
    def check(self, job: Job) -> None: ...
    def next_buffer(self) -> int: ...
    def view(self, r: int, b: int, dtype: np.dtype[Any], count: int) -> np.ndarray: ...
    def all_views(self, b: int, dtype: np.dtype[Any], count: int) -> list[np.ndarray]: ...
    def round_cap(self, least: int) -> int: ...
    def rounds(self, nbytes: int, itemsize: int, rows: int = 1) -> tuple[int, int]: ...
    def fingerprints(self) -> np.ndarray: ...
    def own_fingerprint(self) -> np.ndarray: ...
    def symmetric(self, x: np.ndarray) -> tuple[int, int]: ...


#: A host algorithm: runs ``call`` of ``job`` on the engine, returns the call's result.
HostCall = Callable[[ShmEngine, Job, Call], Any]


def row_rounds(
    engine: ShmEngine, job: Job, call: Call, rows: np.ndarray
) -> Iterator[tuple[int, int, list[np.ndarray]]]:
    """Rounds of a call on ``(W, m)`` rows: copy this rank's columns ``lo:hi`` of every
    row into its buffer, sync (the first time: check); yield ``(lo, hi, blocks)``,
    ``blocks[r]`` rank r's ``(W, hi - lo)`` copy."""
    ws = engine.ws
    n, me = ws.world_size, ws.rank
    dtype, m = rows.dtype, rows.shape[1]
    engine.publish(job, call)
    per, rounds = engine.rounds(m * dtype.itemsize, dtype.itemsize, n)
    for i in range(rounds):
        lo = i * per
        hi = min(lo + per, m)
        c = hi - lo
        b = engine.next_buffer()
        blocks = [engine.view(r, b, dtype, n * c).reshape(n, c) for r in range(n)]
        np.copyto(blocks[me], rows[:, lo:hi])
        engine.sync(job, f"sync 1 of round {i + 1}/{rounds}")
        if i == 0:
            engine.check(job)
        yield lo, hi, blocks


def flat_rounds(
    engine: ShmEngine, job: Job, call: Call, flat: np.ndarray, writes: bool = True
) -> Iterator[tuple[int, int, list[np.ndarray]]]:
    """Rounds of a call on a flat buffer: copy ``flat[lo:hi]`` into this rank's buffer
    (if it ``writes``), sync (the first time: check); yield ``(lo, hi, views)``,
    ``views[r]`` rank r's copy."""
    dtype = flat.dtype
    engine.publish(job, call)
    per, rounds = engine.rounds(flat.nbytes, dtype.itemsize)
    for i in range(rounds):
        lo = i * per
        hi = min(lo + per, flat.size)
        views = engine.all_views(engine.next_buffer(), dtype, hi - lo)
        if writes:
            np.copyto(views[engine.ws.rank], flat[lo:hi])
        engine.sync(job, f"sync 1 of round {i + 1}/{rounds}")
        if i == 0:
            engine.check(job)
        yield lo, hi, views


def barrier(engine: ShmEngine, job: Job, call: Call) -> None:
    """One sync (and the check: every rank is in the barrier)."""
    engine.publish(job, call)
    engine.next_buffer()
    engine.sync(job, "the barrier")
    engine.check(job)
