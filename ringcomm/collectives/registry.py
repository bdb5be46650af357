"""The registry: every collective's algorithms by name, one module each, one signature.

Every algorithm is a :class:`~ringcomm.collectives.base.CollectiveOp` subclass built as
``Algorithm(comm, call, *, async_op=False)``; the first entry of a collective's table is its
size-independent default. Which one a call runs is :mod:`ringcomm.collectives.chooser`'s
answer; the names outside the tables (:data:`WORKSPACE_ALGO`, :data:`IPC_ALGO`,
:data:`HIER_ALGO`) are run by the group's workspace, its device windows or the hierarchy.
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
from ringcomm.collectives.base import CollectiveOp
from ringcomm.collectives.broadcast_chain import BroadcastChain
from ringcomm.collectives.broadcast_tree import BroadcastTree
from ringcomm.collectives.gather_direct import GatherDirect
from ringcomm.collectives.ipc import IPC_ALGO
from ringcomm.collectives.reduce_scatter_ring import ReduceScatterRing
from ringcomm.collectives.reduce_scatter_v_ring import ReduceScatterVRing
from ringcomm.collectives.reduce_tree import ReduceTree
from ringcomm.collectives.scatter_direct import ScatterDirect

__all__ = [
    "ALGORITHMS",
    "HIER_ALGO",
    "IPC_ALGO",
    "UNEVEN_ALGORITHMS",
    "WORKSPACE_ALGO",
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

#: The name of the shared-workspace algorithm (every collective has it on one host).
WORKSPACE_ALGO = "shm"
#: The hierarchical collectives of a group spanning hosts (ringcomm.collectives.hierarchy,
#: above this layer: ``RINGCOMM_ALGO=hier`` is valid here and means "no flat preference").
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
