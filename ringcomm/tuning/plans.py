"""Algorithms as data: a :class:`Plan` is the list of :class:`Step` shapes of one
algorithm on ``H`` hosts of ``L`` ranks (host-contiguous), each step the worst link load,
message count and reduced bytes of one round as fractions of the size ``S``, so a plan is
built once per world and priced at any size (:mod:`ringcomm.tuning.pricing`). Pure, like
:mod:`ringcomm.schedule`. :func:`plan` builds the collectives' algorithms,
:func:`probe_plan` the probes ``ringcomm tune --hostfile`` runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ringcomm.tuning.parameters import ALGORITHMS, OPS

__all__ = ["PROBE_KINDS", "Load", "Plan", "Step", "plan", "probe_plan"]


@dataclass(frozen=True)
class Load:
    """One link class in one step, as fractions of the size ``S``."""

    link_frac: float  # bytes on the busiest link (a host's uplink/downlink, or a rank's own)
    messages: int  # transfers sent or received by the busiest rank (each ceil(b/chunk) pieces)
    piece_frac: float  # the largest transfer


@dataclass(frozen=True)
class Step:
    """One round of an algorithm, repeated ``repeat`` times."""

    repeat: int
    loads: tuple[tuple[str, Load], ...]  # ("local" | "net", load) for the classes it uses
    reduce_frac: float  # bytes reduced by the busiest rank, / S
    uplink_frac: float  # bytes the busiest host sends over its uplink, / S
    # The CPU work of the busiest host's ranks (each the most any host has, / S): bytes
    # sent plus received across hosts, the same on the host, and bytes reduced.
    cpu_net: float = 0.0
    cpu_local: float = 0.0
    cpu_reduce: float = 0.0


@dataclass(frozen=True)
class Plan:
    """An algorithm on a world: its steps; ``pipelined``: the steps are stages of a
    pipeline every piece passes through (a chain), not rounds one after another."""

    op: str
    algo: str
    hosts: int
    ranks_per_host: int
    steps: tuple[Step, ...]
    pipelined: bool = False


def _step(
    host_of: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    frac: float | np.ndarray,
    *,
    reduce: bool,
    repeat: int = 1,
) -> Step | None:
    """The shape of a round in which ``src[i]`` sends ``frac[i] * S`` bytes to ``dst[i]``."""
    if repeat < 1 or len(src) == 0:
        return None
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    f = np.broadcast_to(np.asarray(frac, dtype=np.float64), src.shape)
    net = host_of[src] != host_of[dst]
    loads: list[tuple[str, Load]] = []
    uplink = 0.0
    hosts = int(host_of.max()) + 1
    cpu_ends = {"local": 0.0, "net": 0.0}
    for cls, mask in (("local", ~net), ("net", net)):
        if not mask.any():
            continue
        s, d, fm = src[mask], dst[mask], f[mask]
        ends = (host_of[s], host_of[d]) if cls == "net" else (s, d)
        out = np.bincount(ends[0], fm)
        link = max(float(out.max()), float(np.bincount(ends[1], fm).max()))
        if cls == "net":
            uplink = float(out.max())
        msgs = max(int(np.bincount(s).max()), int(np.bincount(d).max()))
        loads.append((cls, Load(link, msgs, float(fm.max()))))
        per_host = np.bincount(host_of[s], fm, hosts) + np.bincount(host_of[d], fm, hosts)
        cpu_ends[cls] = float(per_host.max())
    red = float(np.bincount(dst, f).max()) if reduce else 0.0
    host_red = float(np.bincount(host_of[dst], f, hosts).max()) if reduce else 0.0
    return Step(repeat, tuple(loads), red, uplink, cpu_ends["net"], cpu_ends["local"], host_red)


def _ring_steps(
    host_of: np.ndarray, members: np.ndarray, frac: float, *, reduce: bool, repeat: int
) -> Step | None:
    """``members`` is an (rings, size) array: each row a ring; everyone sends to the next."""
    if members.shape[1] < 2:
        return None
    src = members.ravel()
    dst = np.roll(members, -1, axis=1).ravel()
    return _step(host_of, src, dst, frac, reduce=reduce, repeat=repeat)


def _binomial(n: int, *, up: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rounds of a binomial tree rooted at 0: (senders, receivers); ``up``: reduce order."""
    rounds = []
    ranks = np.arange(n)
    for r in range(max(0, math.ceil(math.log2(n))) if n > 1 else 0):
        child = ranks[(ranks % (2 << r)) == (1 << r)]
        parent = child - (1 << r)
        rounds.append((child, parent) if up else (parent, child))
    return rounds if up else rounds[::-1]


def _rd_steps(host_of: np.ndarray, n: int, op: str) -> list[Step | None]:
    """Recursive doubling / halving with MPICH's fold for a non-power-of-two ``n``."""
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    extra = np.arange(rem) * 2  # sit out: even ranks below 2*rem
    keeper = extra + 1
    active = np.concatenate([keeper, np.arange(2 * rem, n)])  # virtual rank v -> active[v]
    logp = p2.bit_length() - 1
    steps: list[Step | None] = []
    v = np.arange(p2)
    if op == "all_reduce":
        steps.append(_step(host_of, extra, keeper, 1.0, reduce=True))
        for r in range(logp):
            steps.append(_step(host_of, active[v], active[v ^ (1 << r)], 1.0, reduce=True))
        steps.append(_step(host_of, keeper, extra, 1.0, reduce=False))
    elif op == "reduce_scatter":  # halving, near partners first: S/2, S/4, ... on the host
        steps.append(_step(host_of, extra, keeper, 1.0, reduce=True))
        for r in range(logp):
            steps.append(
                _step(host_of, active[v], active[v ^ (1 << r)], 1.0 / (2 << r), reduce=True)
            )
        steps.append(_step(host_of, keeper, extra, 1.0 / n, reduce=False))
    else:  # all_gather: doubling, far partners first (small blocks cross hosts)
        steps.append(_step(host_of, extra, keeper, 1.0 / n, reduce=False))
        for t, r in enumerate(reversed(range(logp))):
            steps.append(
                _step(host_of, active[v], active[v ^ (1 << r)], (1 << t) / p2, reduce=False)
            )
        steps.append(_step(host_of, keeper, extra, 1.0, reduce=False))
    return steps


@functools.lru_cache(maxsize=512)
def plan(op: str, algo: str, hosts: int, ranks_per_host: int, servers: int | None = None) -> Plan:
    """The :class:`Plan` of ``algo`` for ``op`` on ``hosts`` x ``ranks_per_host`` ranks.

    ``servers``: the parameter server's server count (``ps`` only; default one per host).
    """
    if op not in ALGORITHMS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    if algo not in ALGORITHMS[op]:
        raise ValueError(
            f"{op} has no algorithm {algo!r}; expected one of {', '.join(ALGORITHMS[op])}"
        )
    H, L = hosts, ranks_per_host
    if H < 1 or L < 1:
        raise ValueError(f"hosts and ranks per host must be >= 1, got {H} x {L}")
    n = H * L
    host_of = np.arange(n) // L
    world = np.arange(n).reshape(1, n)
    grid = np.arange(n).reshape(H, L)  # grid[h, l]: local rank l of host h
    steps: list[Step | None] = []
    pipelined = False
    if algo == "ring":
        phases = {"all_reduce": (True, False), "reduce_scatter": (True,), "all_gather": (False,)}
        for reduce in phases[op]:
            steps.append(_ring_steps(host_of, world, 1.0 / n, reduce=reduce, repeat=n - 1))
    elif algo == "hierarchical":
        intra, inter = grid, grid.T  # rings within each host; rings of local rank l across hosts
        if op in ("all_reduce", "reduce_scatter"):
            steps.append(_ring_steps(host_of, intra, 1.0 / L, reduce=True, repeat=L - 1))
            steps.append(_ring_steps(host_of, inter, 1.0 / n, reduce=True, repeat=H - 1))
        if op in ("all_reduce", "all_gather"):
            steps.append(_ring_steps(host_of, inter, 1.0 / n, reduce=False, repeat=H - 1))
            steps.append(_ring_steps(host_of, intra, 1.0 / L, reduce=False, repeat=L - 1))
    elif algo == "tree":
        if op == "all_reduce":
            for s, d in _binomial(n, up=True):
                steps.append(_step(host_of, s, d, 1.0, reduce=True))
        for s, d in _binomial(n, up=False):
            steps.append(_step(host_of, s, d, 1.0, reduce=False))
    elif algo == "rd":
        if n > 1:
            steps.extend(_rd_steps(host_of, n, op))
    elif algo == "chain":
        pipelined = True
        for r in range(n - 1):
            steps.append(_step(host_of, np.array([r]), np.array([r + 1]), 1.0, reduce=False))
    elif algo == "ps":
        P = servers if servers is not None else H
        if P < 1:
            raise ValueError(f"servers must be >= 1, got {P}")
        srv = np.arange(n, n + P)
        host_of = np.concatenate([host_of, (H + np.arange(P)) if H > 1 else np.zeros(P, np.int64)])
        workers = np.repeat(np.arange(n), P)
        to = np.tile(srv, n)
        steps.append(_step(host_of, workers, to, 1.0 / P, reduce=True))  # push, servers reduce
        steps.append(_step(host_of, to, workers, 1.0 / P, reduce=False))  # pull
    elif algo == "direct" and n > 1:  # sendrecv: each rank sends S right, receives S from left
        steps.append(_ring_steps(host_of, world, 1.0, reduce=False, repeat=1))
    return Plan(op, algo, H, L, tuple(s for s in steps if s is not None), pipelined)


#: What ``ringcomm tune --hostfile`` runs, every rank of every host at once (all_reduce):
#: ``flat`` the ring over the whole group, ``hier`` the hierarchical schedule (in segments),
#: ``cross`` only its steps across hosts (every local rank's ring with the ranks of its
#: local index on the other hosts, all at once), ``host`` only its steps on the hosts (each
#: host's reduce_scatter then all_gather, all hosts at once).
PROBE_KINDS: tuple[str, ...] = ("flat", "hier", "cross", "host")


@functools.lru_cache(maxsize=64)
def probe_plan(kind: str, hosts: int, ranks_per_host: int) -> Plan:
    """The :class:`Plan` of a probe of :data:`PROBE_KINDS` on ``hosts`` x ``ranks_per_host``
    (each rank's buffer is the size priced)."""
    H, L = hosts, ranks_per_host
    if kind == "flat":
        return plan("all_reduce", "ring", H, L)
    if kind == "hier":
        return plan("all_reduce", "hierarchical", H, L)
    if H < 1 or L < 1:
        raise ValueError(f"hosts and ranks per host must be >= 1, got {H} x {L}")
    host_of = np.arange(H * L) // L
    grid = np.arange(H * L).reshape(H, L)
    steps: list[Step | None] = []
    if kind == "cross":  # L rings of H ranks, each over the whole buffer
        for reduce in (True, False):
            steps.append(_ring_steps(host_of, grid.T, 1.0 / H, reduce=reduce, repeat=H - 1))
    elif kind == "host":  # H rings of L ranks
        for reduce in (True, False):
            steps.append(_ring_steps(host_of, grid, 1.0 / L, reduce=reduce, repeat=L - 1))
    else:
        raise ValueError(f"unknown probe {kind!r}; expected one of {', '.join(PROBE_KINDS)}")
    return Plan("all_reduce", kind, H, L, tuple(s for s in steps if s is not None))
