"""The copying collectives on the shared workspace (``shm``): all_gather, gather, broadcast.

Each rank (broadcast: the root only) copies its input into its own buffer, every rank
syncs, then every rank (gather: the root only) copies the buffers it needs out, round by
round.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.collectives.base import Call
from ringcomm.collectives.shm_base import Job, ShmEngine, flat_rounds

__all__ = ["all_gather", "broadcast", "gather"]


def all_gather(engine: ShmEngine, job: Job, call: Call) -> Any:
    """Copy in, sync, copy every buffer out."""
    x, out = call.x, call.out
    assert x is not None and out is not None
    dst = out.reshape(engine.ws.world_size, -1)
    for lo, hi, views in flat_rounds(engine, job, call, x.reshape(-1)):
        for r, view in enumerate(views):
            np.copyto(dst[r, lo:hi], view)
    return out


def gather(engine: ShmEngine, job: Job, call: Call) -> Any:
    """Copy in, sync, the root copies every buffer out."""
    x, out = call.x, call.out
    assert x is not None
    mine = call.root == engine.ws.rank
    dst = out.reshape(engine.ws.world_size, -1) if mine and out is not None else None
    for lo, hi, views in flat_rounds(engine, job, call, x.reshape(-1)):
        if dst is not None:
            for r, view in enumerate(views):
                np.copyto(dst[r, lo:hi], view)
    return out if mine else None


def broadcast(engine: ShmEngine, job: Job, call: Call) -> Any:
    """The root copies in, sync, the others copy out."""
    x = call.x
    assert x is not None and call.root is not None
    root = call.root
    flat = x.reshape(-1)
    mine = engine.ws.rank == root
    for lo, hi, views in flat_rounds(engine, job, call, flat, writes=mine):
        if not mine:
            np.copyto(flat[lo:hi], views[root])
    return x
