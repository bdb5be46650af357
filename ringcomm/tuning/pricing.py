"""Pricing plans: the predicted time of a collective under a :class:`CostModel`.

A message costs ``alpha_s`` (once per piece of ``chunk_bytes``), a byte ``beta_s_per_byte``
on the busiest link of the step, a reduced byte ``gamma_s_per_byte`` on the busiest rank;
a step of ``k`` pieces overlaps transfer and reduction (``max + min / k``) and lasts at
least its CPU time; a call costs ``overhead_s`` once. :func:`predict` prices one
algorithm, :func:`best` ranks them all, :func:`crossovers` finds the sizes where the winner
changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringcomm.tuning.parameters import (
    ALGORITHMS,
    HIER_SEGMENT_BYTES,
    OPS,
    CostModel,
    busbw_factor,
)
from ringcomm.tuning.plans import Plan, Step, plan

__all__ = [
    "Crossover",
    "Prediction",
    "best",
    "crossovers",
    "plan_time",
    "predict",
    "uplink_bytes",
]


def _pieces(nbytes: float, chunk: int) -> int:
    return max(1, math.ceil(nbytes / chunk))


def _comm(model: CostModel, step: Step, size: float) -> tuple[float, int]:
    """The time the busiest link of ``step`` needs at ``size`` bytes, and its piece count."""
    comm, k_max = 0.0, 1
    for cls, load in step.loads:
        link = model.link(cls)
        k = _pieces(load.piece_frac * size, model.chunk_bytes)
        k_max = max(k_max, k)
        comm = max(
            comm, link.alpha_s * load.messages * k + link.beta_s_per_byte * load.link_frac * size
        )
    return comm, k_max


def _cpu_time(model: CostModel, step: Step, size: float, hosts: int) -> float:
    """The time the CPU pool of the busiest host needs for ``step`` (0 without a CPU term):
    its ranks' work times the hosts sharing the pool, over the pool's cores."""
    cpu = model.cpu
    if cpu is None:
        return 0.0
    work = (
        cpu.net_s_per_byte * step.cpu_net
        + cpu.local_s_per_byte * step.cpu_local
        + cpu.reduce_s_per_byte * step.cpu_reduce
    )
    return cpu.pool(hosts) * work * size / cpu.cores


def _step_time(model: CostModel, step: Step, size: float, hosts: int = 1) -> float:
    comm, k = _comm(model, step, size)
    red = model.gamma_s_per_byte * step.reduce_frac * size
    return max(max(comm, red) + min(comm, red) / k, _cpu_time(model, step, size, hosts))


def _crosses(step: Step) -> bool:
    return any(cls == "net" for cls, _ in step.loads)


def _segmented_time(model: CostModel, p: Plan, size: float, segment_bytes: int) -> float:
    """A hierarchical plan run in segments of ``segment_bytes`` (of ``S``), as
    :mod:`ringcomm.collectives.hierarchy` runs it: the host's steps of one segment overlap the steps
    across hosts of the one before. The call lasts as long as the slower of: the pipeline
    of those two stages (``m`` segments of the slower stage, plus the faster once: the
    pipeline fills and drains; each stage's steps at the segment's size, each step at least
    its CPU time), and the CPU pool doing all of the work (``m`` times the CPU work of every
    step at the segment's size plus a segment's own: ``CpuModel.segment_s`` and
    ``CpuModel.hier_s_per_byte`` times the segment's bytes, per rank)."""
    m = _pieces(size, segment_bytes)
    g = size / m
    host_t = sum(s.repeat * _step_time(model, s, g, p.hosts) for s in p.steps if not _crosses(s))
    cross_t = sum(s.repeat * _step_time(model, s, g, p.hosts) for s in p.steps if _crosses(s))
    cpu_t = sum(s.repeat * _cpu_time(model, s, g, p.hosts) for s in p.steps)
    cpu = model.cpu
    if cpu is not None:
        own = cpu.segment_s + cpu.hier_s_per_byte * g
        cpu_t += own * p.ranks_per_host * cpu.pool(p.hosts) / cpu.cores
    pipeline = m * max(host_t, cross_t) + min(host_t, cross_t)
    return model.overhead_s + max(pipeline, m * cpu_t)


def plan_time(model: CostModel, p: Plan, size: float, segment_bytes: int | None = None) -> float:
    """The time of one call by plan ``p`` at ``size`` bytes (``segment_bytes``: a
    hierarchical plan runs in segments of that many bytes, see :func:`predict`)."""
    if segment_bytes is not None and p.algo == "hierarchical":
        return _segmented_time(model, p, size, segment_bytes)
    if not p.pipelined:
        return model.overhead_s + sum(
            s.repeat * _step_time(model, s, size, p.hosts) for s in p.steps
        )
    if not p.steps:
        return model.overhead_s
    k = _pieces(size, model.chunk_bytes)
    piece = size / k
    stage = [s.repeat * _step_time(model, s, piece, p.hosts) for s in p.steps]
    # the first piece passes every stage; the other k-1 follow at the slowest stage's pace
    return model.overhead_s + sum(stage) + (k - 1) * max(stage)


@dataclass(frozen=True)
class Prediction:
    """One algorithm's predicted time for ``size`` bytes on ``hosts`` x ``ranks_per_host``."""

    op: str
    algo: str
    hosts: int
    ranks_per_host: int
    size: int
    time_s: float
    uplink_bytes: float  # bytes the busiest host sends over its uplink (0 on one host)

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def algbw_GBps(self) -> float:
        return self.size / self.time_s / 1e9 if self.time_s > 0 else 0.0

    @property
    def busbw_GBps(self) -> float:
        return self.algbw_GBps * busbw_factor(self.op, self.world_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "algo": self.algo,
            "hosts": self.hosts,
            "ranks_per_host": self.ranks_per_host,
            "world_size": self.world_size,
            "bytes": self.size,
            "time_us": self.time_s * 1e6,
            "algbw_GBps": self.algbw_GBps,
            "busbw_GBps": self.busbw_GBps,
            "uplink_bytes": self.uplink_bytes,
        }


def _check(op: str, hosts: int, ranks_per_host: int, size: int) -> None:
    if op not in ALGORITHMS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    if hosts < 1 or ranks_per_host < 1:
        raise ValueError(f"hosts and ranks per host must be >= 1, got {hosts} x {ranks_per_host}")
    if size < 0:
        raise ValueError(f"size must be >= 0 bytes, got {size}")


def uplink_bytes(op: str, algo: str, hosts: int, ranks_per_host: int, size: float) -> float:
    """Bytes the busiest host sends over its uplink during one call (0 on one host)."""
    p = plan(op, algo, hosts, ranks_per_host)
    return sum(s.repeat * s.uplink_frac for s in p.steps) * size


def predict(
    model: CostModel,
    op: str,
    algo: str,
    hosts: int,
    ranks_per_host: int,
    size: int,
    *,
    servers: int | None = None,
    segment_bytes: int | None = None,
) -> Prediction:
    """The predicted time of one call of ``op`` by ``algo`` on ``size`` bytes per rank
    (``servers``: the parameter server's, default one per host).

    ``segment_bytes``: ``hierarchical`` runs in segments of that many bytes of ``S``, the
    host's steps of one overlapping the steps across hosts of the one before (default: a
    model with a CPU term prices the :data:`HIER_SEGMENT_BYTES` segments ringcomm runs; one
    without prices the steps one after another, as before the CPU term existed)."""
    _check(op, hosts, ranks_per_host, size)
    if segment_bytes is not None and segment_bytes < 1:
        raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
    p = plan(op, algo, hosts, ranks_per_host, servers if algo == "ps" else None)
    if segment_bytes is None and model.cpu is not None:
        segment_bytes = HIER_SEGMENT_BYTES
    t = plan_time(model, p, float(size), segment_bytes)
    up = sum(s.repeat * s.uplink_frac for s in p.steps) * size
    return Prediction(op, algo, hosts, ranks_per_host, size, t, up)


def best(
    model: CostModel,
    hosts: int,
    ranks_per_host: int,
    size: int,
    op: str = "all_reduce",
    algos: Sequence[str] | None = None,
    *,
    servers: int | None = None,
) -> tuple[str, list[Prediction]]:
    """The fastest algorithm and every algorithm's prediction, in :data:`ALGORITHMS` order.

    Over the model's own algorithm names (the registry's choice, which maps them to what
    ringcomm runs and also prices piece sizes, is :mod:`ringcomm.collectives.choice`).
    """
    _check(op, hosts, ranks_per_host, size)
    names = ALGORITHMS[op] if algos is None else tuple(algos)
    preds = [predict(model, op, a, hosts, ranks_per_host, size, servers=servers) for a in names]
    winner = min(preds, key=lambda p: p.time_s)  # ties: the first in table order
    return winner.algo, preds


@dataclass(frozen=True)
class Crossover:
    """The winner changes from ``before`` to ``after`` at ``size`` bytes (the first size
    ``after`` wins)."""

    size: int
    before: str
    after: str


def crossovers(
    model: CostModel,
    hosts: int,
    ranks_per_host: int,
    op: str = "all_reduce",
    *,
    min_bytes: int = 1,
    max_bytes: int = 1 << 32,
    algos: Sequence[str] | None = None,
    servers: int | None = None,
) -> list[Crossover]:
    """Sizes in ``[min_bytes, max_bytes]`` where :func:`best`'s winner changes, found on a
    grid of powers of 2^(1/4) and refined to the byte by bisection."""

    def winner(size: int) -> str:
        return best(model, hosts, ranks_per_host, size, op, algos, servers=servers)[0]

    grid = sorted(
        {min_bytes, max_bytes}
        | {
            round(2 ** (e / 4))
            for e in range(4 * max_bytes.bit_length() + 1)
            if min_bytes <= 2 ** (e / 4) <= max_bytes
        }
    )
    found: list[Crossover] = []
    prev_size, prev = grid[0], winner(grid[0])
    for size in grid[1:]:
        cur = winner(size)
        if cur != prev:
            lo, hi = prev_size, size  # winner(lo) == prev, winner(hi) != prev
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if winner(mid) == prev:
                    lo = mid
                else:
                    hi = mid
            found.append(Crossover(hi, prev, winner(hi)))
            if winner(hi) != cur:  # two changes inside one grid cell
                found.append(Crossover(size, winner(hi), cur))
        prev_size, prev = size, cur
    return found
