"""Parameter server: sharded key-value push/pull over a ProcessGroup.

Roles: in a job of N ranks, ranks ``0..S-1`` serve and ``S..N-1`` work (:func:`start`), or
servers run as their own processes (``ringcomm ps-server``, :mod:`ringcomm.ps.membership`)
and survive restarts from checkpoints. Modules, bottom up:

* :mod:`~ringcomm.ps.slicer`: which server holds which part of a key (pure);
* :mod:`~ringcomm.ps.updaters`: server-side SGD/Adam over flat shards;
* :mod:`~ringcomm.ps.state`: consistency (bsp/ssp/asp), clocks, gaps, checkpoints (pure);
* :mod:`~ringcomm.ps.protocol`, :mod:`~ringcomm.ps.server`, :mod:`~ringcomm.ps.worker`;
* :mod:`~ringcomm.ps.membership`: standalone servers, re-forming the group after a restart.
"""

from __future__ import annotations

from typing import Any

from ringcomm.errors import GroupClosedError
from ringcomm.ps.config import PSConfig
from ringcomm.ps.server import PSServer
from ringcomm.ps.slicer import HashSlicer, Piece, RangeSlicer, Slicer
from ringcomm.ps.updaters import SGD, Adam, Updater, make_updater
from ringcomm.ps.worker import Handle, KVWorker, PSRequestError

__all__ = [
    "SGD",
    "Adam",
    "Handle",
    "HashSlicer",
    "KVWorker",
    "PSConfig",
    "PSRequestError",
    "PSServer",
    "Piece",
    "RangeSlicer",
    "Slicer",
    "Updater",
    "make_updater",
    "start",
]


def start(
    pg: Any, config: PSConfig, num_servers: int = 1, *, slicer: Slicer | None = None
) -> KVWorker | PSServer:
    """Split ``pg``'s ranks into servers (``0..num_servers-1``) and workers; every rank
    calls this. A server serves until every worker closed its client, writes its final
    checkpoint and returns its :class:`PSServer` (for stats); a worker gets its
    :class:`KVWorker` at once. The traffic runs in a sub-group of all ranks (its own tag
    space)."""
    n = pg.world_size
    if not 1 <= num_servers < n:
        raise ValueError(
            f"rank {pg.rank}: ps: num_servers must be in [1, {n - 1}] for {n} ranks, got {num_servers}"
        )
    if config.num_workers != n - num_servers:
        raise ValueError(
            f"rank {pg.rank}: ps: config.num_workers={config.num_workers} but "
            f"{n} ranks - {num_servers} servers = {n - num_servers} workers"
        )
    group = pg.new_group(list(range(n)))
    servers, workers = list(range(num_servers)), list(range(num_servers, n))
    if pg.rank < num_servers:
        server = PSServer(config, pg.rank)
        try:
            if not server.serve(group, workers):
                raise GroupClosedError(
                    f"rank {pg.rank}: ps server {pg.rank}: the group ended before every worker "
                    f"closed its client (workers done: {sorted(server.byes)})"
                )
        finally:
            server.close()
        return server
    return KVWorker(
        group, pg.rank - num_servers, servers, slicer=slicer, timeout_s=config.timeout_s
    )
