"""Fitting the cost model to measured times.

:func:`fit_local`: a same-host fit of overhead, alpha, beta and gamma by non-negative
least squares over :func:`design_row` (``ringcomm tune``). :func:`fit_hosts`: the network's
effective alpha and beta and the CPU terms (:class:`~ringcomm.tuning.parameters.CpuModel`)
fitted to probes across hosts (``ringcomm tune --hostfile``) by a robust simplex search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ringcomm.config import DEFAULT_CHUNK_BYTES
from ringcomm.tuning.parameters import HIER_SEGMENT_BYTES, CostModel, CpuModel, LinkModel
from ringcomm.tuning.plans import plan, probe_plan
from ringcomm.tuning.pricing import plan_time

__all__ = [
    "FIT_PARAMETERS",
    "HOST_FIT_PARAMETERS",
    "ROBUST_SCALE",
    "Fit",
    "HostFit",
    "HostSample",
    "Sample",
    "design_row",
    "fit_hosts",
    "fit_local",
    "predict_sample",
]

#: The columns of :func:`design_row`: a same-host fit's unknowns.
FIT_PARAMETERS: tuple[str, ...] = ("overhead_s", "alpha_s", "beta_s_per_byte", "gamma_s_per_byte")


def design_row(
    op: str, algo: str, world_size: int, size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> np.ndarray:
    """Coefficients of (overhead, alpha, beta, gamma) in the predicted time of ``op`` by
    ``algo`` on ``world_size`` ranks of one host at ``size`` bytes.

    Linear only where every step's reduction is not overlapped with its transfer: one
    piece per transfer, i.e. ``size`` small enough that no transfer exceeds
    ``chunk_bytes`` (:func:`~ringcomm.tuning.pricing.predict` prices ``k`` pieces as an overlap).
    """
    p = plan(op, algo, 1, world_size)
    row = np.zeros(4)
    row[0] = 1.0
    for s in p.steps:
        for _cls, load in s.loads:
            if load.piece_frac * size > chunk_bytes:
                raise ValueError(
                    f"design_row: {op} {size} B on {world_size} ranks sends pieces larger "
                    f"than {chunk_bytes} B (not linear in the parameters)"
                )
            row[1] += s.repeat * load.messages
            row[2] += s.repeat * load.link_frac * size
        row[3] += s.repeat * s.reduce_frac * size
    return row


@dataclass(frozen=True)
class Sample:
    """One measured time: ``op`` by ``algo`` on ``world_size`` ranks of one host."""

    op: str
    algo: str
    world_size: int
    size: int
    time_s: float


@dataclass(frozen=True)
class Fit:
    """A same-host fit: the parameters (:data:`FIT_PARAMETERS` order) and how well they fit."""

    overhead_s: float
    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    predicted_s: tuple[float, ...]  # per sample, in order
    rms_relative_error: float

    def apply(self, model: CostModel, source: str = "fit") -> CostModel:
        """``model`` with its local link, reduction and overhead replaced by the fit."""
        return replace(
            model,
            local=LinkModel(self.alpha_s, self.beta_s_per_byte),
            gamma_s_per_byte=self.gamma_s_per_byte,
            overhead_s=self.overhead_s,
            source=source,
        )


def fit_local(samples: Sequence[Sample], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Fit:
    """Least squares (``numpy.linalg.lstsq``) of the :func:`design_row` model to ``samples``.

    Each row is weighted by 1/time, so the error minimised is relative (an 8 B sample counts
    as much as a 4 MiB one). A parameter that comes out negative is fixed at 0 and the others
    refitted (an active-set non-negative fit): times never shrink as a size grows.
    """
    if not samples:
        raise ValueError("fit_local: no samples")
    if any(not s.time_s > 0 for s in samples):
        raise ValueError("fit_local: every sample needs a time > 0")
    a = np.array([design_row(s.op, s.algo, s.world_size, s.size, chunk_bytes) for s in samples])
    t = np.array([s.time_s for s in samples])
    w = 1.0 / t
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free] * w[:, None], t * w, rcond=None)
        if (sol >= 0).all():
            x[:] = 0.0
            x[free] = sol
            break
        free = [c for c, v in zip(free, sol) if v > 0] if (sol > 0).any() else []
    pred = a @ x
    rms = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    o, alpha, beta, gamma = (float(v) for v in x)
    return Fit(o, alpha, beta, gamma, tuple(float(p) for p in pred), rms)


# --- fitting across hosts ----------------------------------------------------------------

#: The parameters :func:`fit_hosts` fits, in the order of :attr:`HostFit.parameters`.
HOST_FIT_PARAMETERS: tuple[str, ...] = (
    "net.alpha_s",
    "net.beta_s_per_byte",
    "cpu.net_s_per_byte",
    "cpu.local_s_per_byte",
    "cpu.reduce_s_per_byte",
    "cpu.segment_s",
    "cpu.hier_s_per_byte",
)


#: The log error (about 5 %) beyond which :func:`fit_hosts` counts a probe's error as its
#: size, not its square (soft L1): one probe the model cannot describe does not pull the
#: others off.
ROBUST_SCALE = 0.05


@dataclass(frozen=True)
class HostSample:
    """One measured probe across hosts: ``kind`` (:data:`PROBE_KINDS`) on ``hosts`` x
    ``ranks_per_host`` ranks, ``size`` bytes per rank, the hierarchical one in segments of
    ``segment_bytes``."""

    kind: str
    hosts: int
    ranks_per_host: int
    size: int
    time_s: float
    segment_bytes: int | None = None


def predict_sample(model: CostModel, sample: HostSample) -> float:
    """The model's time of ``sample``'s probe."""
    p = probe_plan(sample.kind, sample.hosts, sample.ranks_per_host)
    segment = None
    if sample.kind == "hier":
        segment = sample.segment_bytes or HIER_SEGMENT_BYTES
    return plan_time(model, p, float(sample.size), segment)


@dataclass(frozen=True)
class HostFit:
    """What :func:`fit_hosts` found: the model, its time for each sample, the errors."""

    model: CostModel
    predicted_s: tuple[float, ...]
    rms_relative_error: float
    max_relative_error: float

    @property
    def parameters(self) -> tuple[float, ...]:
        m, cpu = self.model, self.model.cpu
        assert cpu is not None
        return (
            m.net.alpha_s,
            m.net.beta_s_per_byte,
            cpu.net_s_per_byte,
            cpu.local_s_per_byte,
            cpu.reduce_s_per_byte,
            cpu.segment_s,
            cpu.hier_s_per_byte,
        )


def _with(base: CostModel, x: np.ndarray, cores: float, shared_hosts: int) -> CostModel:
    v = np.exp(x)
    return replace(
        base,
        net=LinkModel(float(v[0]), float(v[1])),
        cpu=CpuModel(
            float(v[2]), float(v[3]), float(v[4]), float(v[5]), cores, shared_hosts, float(v[6])
        ),
    )


def _nelder_mead(f: Any, x0: np.ndarray, step: float, iters: int) -> tuple[np.ndarray, float]:
    """Minimise ``f`` from ``x0`` (Nelder and Mead's simplex, the usual coefficients)."""
    n = len(x0)
    pts = [x0.copy()] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts = [pts[i] for i in order]
        vals = [vals[i] for i in order]
        if vals[-1] - vals[0] < 1e-12:
            break
        centre = np.mean(pts[:-1], axis=0)
        refl = centre + (centre - pts[-1])
        fr = f(refl)
        if fr < vals[0]:
            exp = centre + 2.0 * (centre - pts[-1])
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = centre + 0.5 * (pts[-1] - centre)
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:  # shrink towards the best
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    i = int(np.argmin(vals))
    return pts[i], float(vals[i])


def fit_hosts(
    samples: Sequence[HostSample],
    base: CostModel,
    *,
    cores: float,
    shared_hosts: int,
    source: str = "fit across hosts",
) -> HostFit:
    """The network's effective alpha and beta and the CPU terms (:class:`CpuModel`) that
    make :func:`predict_sample` closest to ``samples``, measured on one world.

    ``base`` gives the rest (the same-host link, gamma, overhead, piece size); ``cores`` and
    ``shared_hosts`` are what the probe found (the cores a host's ranks may run on, and how
    many of the hosts share them). The model is not linear in the parameters (a step lasts
    as long as the slower of its link and its CPU pool), so the fit minimises the sum of
    squared log ratios (predicted / measured) over the log of the seven parameters by Nelder
    and Mead's simplex, restarted twice from the best point, with a small pull (weight
    1e-3 per squared log-unit) towards the start: a parameter the samples do not show (the
    CPU cost of a byte across hosts where every probe waits on the link) keeps its
    starting value. The start: beta from the largest ``cross`` probe (its time over the
    bytes its busiest uplink carries), alpha from ``base``, every CPU cost per byte
    (``hier_s_per_byte`` too) from the largest ``host`` probe (its time over the work of its
    busiest pool), 100 us per segment. (The two ``hier`` probes, in two segment sizes, tell
    the cost per segment from the cost per byte.)
    """
    if not samples:
        raise ValueError("fit_hosts: no samples")
    if any(not s.time_s > 0 for s in samples):
        raise ValueError("fit_hosts: every sample needs a time > 0")
    if not cores > 0:
        raise ValueError(f"fit_hosts: cores must be > 0, got {cores}")
    pool0 = CpuModel(cores=cores, shared_hosts=shared_hosts)

    def largest(kind: str) -> HostSample | None:
        of = [s for s in samples if s.kind == kind]
        return max(of, key=lambda s: s.size) if of else None

    beta0 = base.net.beta_s_per_byte
    cross = largest("cross")
    if cross is not None:
        p = probe_plan("cross", cross.hosts, cross.ranks_per_host)
        up = sum(s.repeat * s.uplink_frac for s in p.steps) * cross.size
        if up > 0:
            beta0 = cross.time_s / up
    c0 = 1e-10
    host = largest("host")
    if host is not None:
        p = probe_plan("host", host.hosts, host.ranks_per_host)
        work = sum(s.repeat * (s.cpu_local + s.cpu_reduce) for s in p.steps) * host.size
        if work > 0:
            c0 = host.time_s * cores / (pool0.pool(host.hosts) * work)
    x0 = np.log(np.maximum([base.net.alpha_s or 1e-6, beta0, c0, c0, c0, 1e-4, c0], 1e-15))
    measured = np.array([s.time_s for s in samples])

    def predictions(x: np.ndarray) -> np.ndarray:
        model = _with(base, x, cores, shared_hosts)
        return np.array([predict_sample(model, s) for s in samples])

    def cost(x: np.ndarray) -> float:
        err = np.log(predictions(x) / measured)
        robust = 2 * ROBUST_SCALE**2 * (np.sqrt(1 + (err / ROBUST_SCALE) ** 2) - 1)
        return float(np.sum(robust) + 1e-3 * np.sum((x - x0) ** 2))

    x, _ = _nelder_mead(cost, x0, 1.0, 1500)
    for _ in range(2):
        x, _ = _nelder_mead(cost, x, 0.3, 1500)
    model = replace(_with(base, x, cores, shared_hosts), source=source)
    pred = np.array([predict_sample(model, s) for s in samples])
    rel = (pred - measured) / measured
    return HostFit(
        model,
        tuple(float(p) for p in pred),
        float(np.sqrt(np.mean(rel**2))),
        float(np.max(np.abs(rel))),
    )
