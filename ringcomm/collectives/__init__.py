"""Collective algorithms, one per module, picked by name from :data:`ALGORITHMS`.

Every algorithm is a :class:`~ringcomm.collectives.base.CollectiveOp` subclass with the same
signature, ``Algorithm(comm: Comm, call: Call, *, async_op=False)`` (see ``base``). The
public calls live in :mod:`ringcomm.collectives.api` (``ProcessGroup`` methods delegate
there): they check the arguments on the calling rank before anything is sent, choose the
algorithm (``algo=`` keyword, else ``RINGCOMM_ALGO``, else by size), and run it.

=================  =========================================================
collective         algorithms (default first)
=================  =========================================================
all_reduce         ``star`` (<= :data:`ALL_REDUCE_STAR_MAX_BYTES` on 3 to
                   :data:`ALL_REDUCE_STAR_MAX_WORLD` ranks), ``direct`` (<=
                   :data:`ALL_REDUCE_DIRECT_MAX_BYTES` and at most
                   :data:`ALL_REDUCE_DIRECT_MAX_WORLD` ranks), ``rd``
                   (<= :data:`ALL_REDUCE_RD_MAX_BYTES`), ``ring``
reduce_scatter     ``ring``
all_gather         ``ring``
broadcast          ``tree`` (<= :data:`BROADCAST_TREE_MAX_BYTES`), ``chain``
reduce             ``tree``
gather             ``direct``
scatter            ``direct``
all_to_all         ``direct``
barrier            ``dissemination``
all_gather_v       ``ring`` (rows of different counts per rank)
reduce_scatter_v   ``ring``
all_to_all_v       ``direct``
=================  =========================================================

With a cost model loaded (``RINGCOMM_TUNE_FILE``: :mod:`ringcomm.collectives.choice`),
all_reduce (past ``star`` and ``direct``, which keep their switch points), broadcast,
reduce_scatter and all_gather take the algorithm and piece size it predicts cheapest.

The uneven (``_v``) collectives have no ``shm`` algorithm: on a group with a workspace
they run over the engine like elsewhere (after the group's earlier workspace calls).

Device arrays (CuPy, or the host stand-in) on a group with a workspace take ``ipc``
(:mod:`ringcomm.collectives.ipc`: device windows over CUDA IPC), every collective but
scatter (a rank may pass ``x=None`` there, not knowing where the source's rows live: it
runs on host copies unless ``algo="ipc"``), the uneven ones included. ``algo="shm"`` on
device arrays means the same (the same-host algorithm's device form); ``algo=`` or
``RINGCOMM_ALGO`` naming another algorithm of the collective stages through the host as
elsewhere; ``RINGCOMM_ALGO=ipc`` is ignored where it does not fit (host arrays).

A group whose ranks share one host and a workspace (``ringcomm.transport.workspace``)
runs every collective on host arrays as ``shm`` (:mod:`ringcomm.collectives.workspace`)
unless ``algo=`` or ``RINGCOMM_ALGO`` names another of the collective's algorithms;
``algo="shm"`` on a group without a workspace is an error (a group of one runs its
default), ``RINGCOMM_ALGO=shm`` there picks by size as usual.

:mod:`ringcomm.collectives.reference` keeps naive implementations over point-to-point
(gather to rank 0, ``reference_reduce``, send back) as a test oracle.

This package never imports zmq: it talks to the engine (``progress``) and the pure wire
format only.
"""

from __future__ import annotations

from ringcomm.collectives.all_gather_ring import AllGatherRing
from ringcomm.collectives.all_gather_v_ring import AllGatherVRing
from ringcomm.collectives.all_to_all_direct import AllToAllDirect
from ringcomm.collectives.all_to_all_v_direct import AllToAllVDirect
from ringcomm.collectives.allreduce_direct import AllReduceDirect
from ringcomm.collectives.allreduce_rd import AllReduceRd
from ringcomm.collectives.allreduce_ring import AllReduceRing
from ringcomm.collectives.allreduce_star import AllReduceStar
from ringcomm.collectives.barrier import BarrierDissemination
from ringcomm.collectives.base import Call, CollectiveOp, Comm
from ringcomm.collectives.broadcast_chain import BroadcastChain
from ringcomm.collectives.broadcast_tree import BroadcastTree
from ringcomm.collectives.choice import ModelChooser
from ringcomm.collectives.gather_direct import GatherDirect
from ringcomm.collectives.ipc import IPC_ALGO
from ringcomm.collectives.reduce_scatter_ring import ReduceScatterRing
from ringcomm.collectives.reduce_scatter_v_ring import ReduceScatterVRing
from ringcomm.collectives.reduce_tree import ReduceTree
from ringcomm.collectives.scatter_direct import ScatterDirect

__all__ = [
    "ALGORITHMS",
    "ALL_REDUCE_DIRECT_MAX_BYTES",
    "ALL_REDUCE_DIRECT_MAX_WORLD",
    "ALL_REDUCE_RD_MAX_BYTES",
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

#: collective -> {algorithm name -> class}; the first entry is the size-independent default.
ALGORITHMS: dict[str, dict[str, type[CollectiveOp]]] = {
    "all_reduce": {
        "ring": AllReduceRing,
        "rd": AllReduceRd,
        "direct": AllReduceDirect,
        "star": AllReduceStar,
    },
    "reduce_scatter": {"ring": ReduceScatterRing},
    "all_gather": {"ring": AllGatherRing},
    "broadcast": {"chain": BroadcastChain, "tree": BroadcastTree},
    "reduce": {"tree": ReduceTree},
    "gather": {"direct": GatherDirect},
    "scatter": {"direct": ScatterDirect},
    "all_to_all": {"direct": AllToAllDirect},
    "barrier": {"dissemination": BarrierDissemination},
}

#: The uneven collectives (rows of different counts per rank), apart: they have no shared
#: workspace algorithm (every collective of :data:`ALGORITHMS` has ``shm``).
UNEVEN_ALGORITHMS: dict[str, dict[str, type[CollectiveOp]]] = {
    "all_gather_v": {"ring": AllGatherVRing},
    "reduce_scatter_v": {"ring": ReduceScatterVRing},
    "all_to_all_v": {"direct": AllToAllVDirect},
}

#: all_reduce takes recursive doubling up to this many bytes, the ring above. Measured
#: (benchmarks/results/collectives_switch.md, W=2 and W=4, ipc://, 2 shared cores): rd
#: 0.5-0.75x the ring's time up to 512 KiB, even at 1 MiB, 1.2-1.9x from 2 MiB on. (rd
#: moves log2(n) buffers per rank, the ring 2(n-1)/n: at larger n the crossover falls.)
ALL_REDUCE_RD_MAX_BYTES = 512 * 1024
#: all_reduce takes the one-step direct exchange up to this many bytes on at most
#: ALL_REDUCE_DIRECT_MAX_WORLD ranks. Measured (collectives_switch.md, "direct vs rd"):
#: direct/rd 0.67-0.82 at W=3 (rd needs a pre- and post-step there), 0.87-1.0 at W=4,
#: even at W=2 (both are one exchange), 0.94-1.0 at W=5, 1.03-1.18 at W=6 and W=8.
ALL_REDUCE_DIRECT_MAX_BYTES = 32 * 1024
ALL_REDUCE_DIRECT_MAX_WORLD = 4
#: all_reduce takes the star (through rank 0) up to this many bytes on 3 to
#: ALL_REDUCE_STAR_MAX_WORLD ranks, ahead of direct and rd. Measured (2 cores, same-host
#: lane, benchmarks/results/local_lane.md): 8 B star/direct 0.57 at W=3, 0.6 at W=4,
#: 0.5 at W=5 and W=8 (star/rd 0.2-0.3 at W=5 and 8); 1 KiB even to 0.6 at W=4, 0.5 at
#: W=8; 4 KiB (past the fast lane) star 1.1-1.5x direct at W=3. At W=2 direct is one
#: exchange, the star two hops (24 vs 16 us).
ALL_REDUCE_STAR_MAX_BYTES = 1024
ALL_REDUCE_STAR_MAX_WORLD = 8
#: broadcast takes the binomial tree up to this many bytes, the pipelined chain above.
#: Measured alongside (W=4 and W=8): within noise of each other up to 4 MiB on one host,
#: the tree a little ahead at W=8; the chain is kept for large messages, where its
#: one-send-per-rank matters once links (not cores) are the limit.
BROADCAST_TREE_MAX_BYTES = 1024 * 1024


#: The name of the shared-workspace algorithm (every collective has it on one host).
WORKSPACE_ALGO = "shm"
#: The hierarchical collectives of a group spanning hosts (ringcomm.collectives.hierarchy, above this
#: layer: ``RINGCOMM_ALGO=hier`` is valid here and means "no flat preference").
HIER_ALGO = "hier"


def get_algorithm(collective: str, algo: str) -> type[CollectiveOp]:
    """The class implementing ``collective`` with ``algo``; ValueError if there is none."""
    table = ALGORITHMS.get(collective) or UNEVEN_ALGORITHMS.get(collective)
    if table is None:
        known = ", ".join([*ALGORITHMS, *UNEVEN_ALGORITHMS])
        raise ValueError(f"unknown collective {collective!r}; known: {known}")
    try:
        return table[algo]
    except KeyError:
        raise ValueError(
            f"unknown algo {algo!r} for {collective}; choose from {', '.join(table)}"
        ) from None


def choose_algorithm(
    collective: str,
    requested: str | None,
    env_algo: str | None,
    nbytes: int,
    world_size: int = 2,
    *,
    local: bool = False,
    model: ModelChooser | None = None,
    hier: bool = False,
    device: bool = False,
) -> str:
    """The algorithm to run: ``requested`` (the ``algo=`` keyword), else ``env_algo``
    (``RINGCOMM_ALGO``) when it names one of this collective's algorithms, else
    :data:`WORKSPACE_ALGO` when the group has a workspace (``local``), else by size.

    By size: all_reduce's ``star`` and ``direct`` at their measured switch points (the cost
    model does not price them), then, with a cost model loaded (``model``, see
    :mod:`ringcomm.collectives.choice`), the algorithm it predicts cheapest for the
    collectives it prices; else the measured switch points. ``hier``: the group runs the
    hierarchical all_reduce, so the model may answer :data:`HIER_ALGO`.

    An ``algo=`` naming no algorithm of the collective raises ValueError (``"shm"``
    without a workspace too); so does a ``RINGCOMM_ALGO`` that names no algorithm of any
    collective.

    ``device``: the call's arrays are device arrays on a group with a workspace: then
    :data:`IPC_ALGO` is the default, and ``"shm"`` asks for it too (``"ipc"`` anywhere else
    is a ValueError, but on a barrier, which has no arrays: there it is ``"shm"``).
    """
    table = ALGORITHMS.get(collective) or UNEVEN_ALGORITHMS[collective]
    if requested in (IPC_ALGO, WORKSPACE_ALGO) and device:
        return IPC_ALGO
    if requested == IPC_ALGO:
        if collective == "barrier":
            requested = WORKSPACE_ALGO if local else None
        elif world_size == 1:
            return next(iter(table))
        else:
            raise ValueError(
                f"algo {IPC_ALGO!r} needs device arrays (CuPy) on a group whose ranks share "
                "one host and a workspace"
            )
    if requested is not None:
        if requested == WORKSPACE_ALGO:
            if world_size == 1 and not local:
                return next(iter(table))  # a group of one needs no workspace
            if not local:
                raise ValueError(
                    f"algo {WORKSPACE_ALGO!r} needs a group whose ranks share one host and a "
                    "workspace, and host (NumPy) arrays"
                )
            return requested
        get_algorithm(collective, requested)
        return requested
    if env_algo:
        if env_algo in table:
            return env_algo
        if env_algo not in (WORKSPACE_ALGO, HIER_ALGO, IPC_ALGO) and not any(
            env_algo in t for t in ALGORITHMS.values()
        ):
            names = sorted({a for t in ALGORITHMS.values() for a in t}
                           | {WORKSPACE_ALGO, HIER_ALGO, IPC_ALGO})  # fmt: skip
            raise ValueError(f"RINGCOMM_ALGO={env_algo!r} names no algorithm; known: {names}")
    if device:
        return IPC_ALGO
    if local:
        return WORKSPACE_ALGO
    if collective == "all_reduce":
        if 3 <= world_size <= ALL_REDUCE_STAR_MAX_WORLD and nbytes <= ALL_REDUCE_STAR_MAX_BYTES:
            return "star"
        if nbytes <= ALL_REDUCE_DIRECT_MAX_BYTES and world_size <= ALL_REDUCE_DIRECT_MAX_WORLD:
            return "direct"
    if model is not None:
        choice = model.choose(collective, nbytes, hier)
        if choice is not None:
            return choice.algo
    if collective == "all_reduce":
        return "rd" if nbytes <= ALL_REDUCE_RD_MAX_BYTES else "ring"
    if collective == "broadcast":
        return "tree" if nbytes <= BROADCAST_TREE_MAX_BYTES else "chain"
    return next(iter(table))
