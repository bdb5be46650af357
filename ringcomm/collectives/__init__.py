"""Collective algorithms, one per module, picked by name from :data:`ALGORITHMS`.

Every algorithm is a :class:`~ringcomm.collectives.base.CollectiveOp` subclass with one
signature, ``Algorithm(comm: Comm, call: Call, *, async_op=False)``
(:mod:`~ringcomm.collectives.registry`). The public calls live in
:mod:`ringcomm.collectives.api` (``ProcessGroup`` methods delegate there): they check the
arguments on the calling rank before anything is sent, ask
:mod:`~ringcomm.collectives.chooser` for the call's plan (algorithm, piece size,
hierarchical segments) and run it. The table of algorithms and how one is chosen:
docs/architecture.md ("One collective call").

:mod:`ringcomm.collectives.reference` keeps naive implementations over point-to-point as a
test oracle. This package never imports zmq: it talks to the engine (``progress``) and the
pure wire format only.
"""

from __future__ import annotations

from ringcomm.collectives.base import Call, CollectiveOp, Comm
from ringcomm.collectives.chooser import (
    ALL_REDUCE_DIRECT_MAX_BYTES,
    ALL_REDUCE_DIRECT_MAX_WORLD,
    ALL_REDUCE_RD_MAX_BYTES,
    ALL_REDUCE_STAR_MAX_BYTES,
    ALL_REDUCE_STAR_MAX_WORLD,
    BROADCAST_TREE_MAX_BYTES,
    ModelChooser,
    choose_algorithm,
)
from ringcomm.collectives.registry import (
    ALGORITHMS,
    HIER_ALGO,
    IPC_ALGO,
    UNEVEN_ALGORITHMS,
    WORKSPACE_ALGO,
    get_algorithm,
)

__all__ = [
    "ALGORITHMS",
    "ALL_REDUCE_DIRECT_MAX_BYTES",
    "ALL_REDUCE_DIRECT_MAX_WORLD",
    "ALL_REDUCE_RD_MAX_BYTES",
    "ALL_REDUCE_STAR_MAX_BYTES",
    "ALL_REDUCE_STAR_MAX_WORLD",
    "BROADCAST_TREE_MAX_BYTES",
    "HIER_ALGO",
    "IPC_ALGO",
    "UNEVEN_ALGORITHMS",
    "WORKSPACE_ALGO",
    "Call",
    "CollectiveOp",
    "Comm",
    "ModelChooser",
    "choose_algorithm",
    "get_algorithm",
]
