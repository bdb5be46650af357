"""What a group runs on, in one screen: ``RINGCOMM_LOG=info`` prints it when a group forms.

:func:`describe` reads it from a group's core (pure: no message is sent): the store and the
group instance, how this rank reaches each peer (ipc:// or tcp://, with the same-host
datagram lane and shared-memory pieces where they are on), the shared workspace, how
algorithms are chosen (``RINGCOMM_ALGO``, rank 0's cost model, or the measured switch
points), the piece size, the deadline, the token and core binding. Rank 0 logs it (its
view of every peer); the others log nothing at this level.
"""

from __future__ import annotations

import os

from ringcomm.config import binds_to_core, format_size
from ringcomm.core.group_core import GroupCore
from ringcomm.transport.endpoints import choose_endpoint

__all__ = ["describe"]

#: Peers listed one by one up to this many; beyond, counted per path.
_LISTED_PEERS = 16


def describe(core: GroupCore) -> str:
    """The summary of ``core``'s group as this rank sees it (several lines)."""
    state, cfg = core.state, core.config
    me = state.peers.get(core.global_rank)
    hosts = len({i.host_id for i in state.peers.values()}) or 1
    head = (
        f"ringcomm: rank {core.rank} of {core.world_size} ({hosts} host"
        f"{'s' if hosts > 1 else ''}), group {state.namespace or 'pg0'} at the store "
        f"{cfg.master_addr}:{state.store_port} ({_source(cfg.source, cfg.store_external)})"
    )
    lines = [head]
    paths: dict[str, list[int]] = {}
    for g in core.ranks:
        info = state.peers.get(g)
        if g == core.global_rank or info is None or me is None:
            continue
        try:
            endpoint = choose_endpoint(me, info, cfg.transport)
        except ValueError:
            endpoint = "?"
        path = "ipc" if endpoint.startswith("ipc://") else "tcp"
        if path == "ipc" and info.lane is not None and cfg.local_lane:
            path += " + datagram lane" + (" + shm pieces" if info.shm and me.shm else "")
        paths.setdefault(path, []).append(g)
    for path, peers in sorted(paths.items()):
        shown = ", ".join(map(str, peers[:_LISTED_PEERS]))
        more = f" ... ({len(peers)} ranks)" if len(peers) > _LISTED_PEERS else ""
        lines.append(f"  peers {shown}{more}: {path}")
    ws = core.workspace
    lines.append(
        "  collectives: shared workspace (all ranks on this host)"
        if ws is not None
        else "  collectives: messages (no shared workspace: "
        + ("ranks on several hosts)" if hosts > 1 else "off or unavailable)")
    )
    if cfg.algo:
        how = f"RINGCOMM_ALGO={cfg.algo}"
    elif state.costmodel is not None:
        how = f"rank 0's cost model ({cfg.tune_file})"
    else:
        how = "the measured switch points (no cost model)"
    lines.append(f"  algorithms: {how}; pieces of {format_size(state.chunk_bytes)} bytes")
    bound = binds_to_core(cfg.bind, cfg.local_world_size, len(os.sched_getaffinity(0)))
    token = f"on ({cfg.security})" if cfg.token else "off"
    lines.append(
        f"  deadline {cfg.timeout_s:g} s per call; token {token}; "
        f"bound to a core: {'yes' if bound else 'no'} (RINGCOMM_BIND={cfg.bind})"
    )
    return "\n".join(lines)


def _source(source: str, external: bool) -> str:
    served = "served by the launcher" if external else "served by rank 0"
    return f"{served}; ranks from {source}"
