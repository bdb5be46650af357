"""Groups of one process over the in-memory transport, for deterministic protocol tests.

:func:`memory_groups` builds, per rank, what ``init_process_group`` builds over zmq -- an
``InitConfig``, an ``Progress`` over a :class:`~ringcomm.transport.memory.MemoryTransport`,
a ``ProcessState`` (no store, no store server) and the world ``ProcessGroup`` -- all on
one :class:`~ringcomm.transport.memory.MemoryHub` (:func:`hub_of` finds it). :func:`run_ranks` runs one function per rank on threads, as every rank of
a job runs the same test body (mpi4py's habit).

Not registered with :mod:`ringcomm.core.lifecycle` (no exit hook): close the groups at the
end (:func:`close_all`, or the :func:`memory_world` context manager).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ringcomm.config import InitConfig
from ringcomm.core.group_core import WORLD_GROUP_ID, GroupCore, ProcessState
from ringcomm.core.progress import Progress
from ringcomm.group import DEFAULT_CHUNK_BYTES, ProcessGroup
from ringcomm.transport.memory import MemoryHub, MemoryTransport

__all__ = ["close_all", "hub_of", "memory_groups", "memory_world", "run_ranks"]


def memory_groups(
    world_size: int,
    *,
    seed: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float = 10.0,
    hub: MemoryHub | None = None,
) -> list[ProcessGroup]:
    """The world group of each rank ``0..world_size-1``, in rank order, over one hub
    (a new one with ``seed`` unless ``hub`` is given)."""
    if hub is None:
        hub = MemoryHub(world_size, seed=seed)
    groups = []
    for rank in range(world_size):
        config = InitConfig(
            rank=rank,
            world_size=world_size,
            local_rank=rank,
            master_addr="127.0.0.1",
            master_port=0,
            timeout_s=timeout_s,
            chunk_bytes=chunk_bytes,
            source="explicit",
            local_lane=False,
            shm=False,
            bind="none",
        )
        progress = Progress(MemoryTransport(rank, hub), rank)
        state = ProcessState(config, progress, None, None, chunk_bytes)
        groups.append(ProcessGroup(GroupCore(state, range(world_size), WORLD_GROUP_ID)))
    return groups


def hub_of(pg: ProcessGroup) -> MemoryHub:
    """The hub a group of :func:`memory_groups` runs on."""
    transport = pg.core.progress.transport
    assert isinstance(transport, MemoryTransport)
    return transport.hub


def close_all(groups: Sequence[ProcessGroup]) -> None:
    """Close every group (each rank says goodbye to the others; nothing blocks)."""
    for pg in groups:
        pg.close()


@contextmanager
def memory_world(world_size: int, **kwargs: Any) -> Iterator[list[ProcessGroup]]:
    """:func:`memory_groups`, closed on the way out."""
    groups = memory_groups(world_size, **kwargs)
    try:
        yield groups
    finally:
        close_all(groups)


def run_ranks(
    groups: Sequence[ProcessGroup],
    fn: Callable[[ProcessGroup], Any],
    timeout_s: float = 20.0,
    *,
    return_exceptions: bool = False,
) -> list[Any]:
    """Run ``fn(pg)`` for every group on a thread of its own; the results in rank order.

    The first error in rank order is raised again, with a note naming its rank
    (``return_exceptions``: errors are returned in place of results instead). A rank
    still running after ``timeout_s`` raises TimeoutError naming the ranks (their
    threads are daemons: they end with the process, or when their calls time out).
    """
    n = len(groups)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(i: int) -> None:
        try:
            results[i] = fn(groups[i])
        except BaseException as exc:  # noqa: BLE001 (reported below, with its rank)
            errors[i] = exc

    threads = [
        threading.Thread(target=body, args=(i,), name=f"memory-rank-{i}", daemon=True)
        for i in range(n)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise TimeoutError(f"ranks {stuck} still running after {timeout_s:g} s")
    if return_exceptions:
        return [e if e is not None else r for r, e in zip(results, errors)]
    for i, exc in enumerate(errors):
        if exc is not None:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(raised on rank {i} of {n})")
            raise exc
    return results
