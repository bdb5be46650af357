"""An alpha-beta-gamma cost model of the collectives (pure: stdlib and NumPy only, layer 0).

A world is ``H`` hosts of ``L`` ranks each (``n = H * L``), ranks numbered host by host
(host-contiguous: rank ``r`` sits on host ``r // L``). Two link classes:

* ``local`` (same host): every rank has its own link to the others at ``beta_s_per_byte``
  (memory and the kernel are not modelled as shared);
* ``net`` (across hosts): every host has ONE full-duplex uplink, shared by its ``L`` ranks:
  the bytes all of a host's ranks send off-host in one step queue on it (and the bytes they
  receive, on its downlink).

A message costs ``alpha_s`` of latency (paid by its sender and its receiver, once per
piece: messages of different ranks overlap their latency), a byte ``beta_s_per_byte`` on
the busiest link of the step, a reduced byte ``gamma_s_per_byte`` on the busiest rank; one
call costs ``overhead_s`` once. Pieces: a transfer of ``b`` bytes goes as
``ceil(b / chunk_bytes)`` messages, and while piece ``j`` is reduced piece ``j+1`` moves,
so a step of ``k`` pieces takes ``max(comm, reduce) + min(comm, reduce) / k`` (the plain sum
when ``k == 1``).

An algorithm is a :class:`Plan` (pure data, like :mod:`ringcomm.schedule`): a list of
:class:`Step` shapes, each the worst link load, message count and reduced bytes of one
round, as fractions of the size ``S`` (so a plan is built once per world and priced at any
size). The algorithms (``S`` = the per-rank buffer as nccl-tests counts it, docs/contracts.md):

* ``ring`` over all ``n`` ranks: ``2(n-1)`` steps of ``S/n`` (all_reduce); with H > 1 each
  uplink carries one piece per step, ``2(n-1)/n * S`` in all, and each step waits for it;
* ``tree``: binomial reduce to rank 0 then binomial broadcast, ``ceil(log2 n)`` rounds each
  of the whole ``S`` (host-contiguous order: the rounds of distance ``>= L`` cross hosts,
  one sender per host);
* ``rd``: recursive doubling, ``log2 n`` exchanges of the whole ``S`` (MPICH's pre- and
  post-step when n is not a power of two); an exchange at distance ``>= L`` puts ``L * S``
  on the uplink; for reduce_scatter recursive halving (near partners first, so the large
  halves stay on the host), for all_gather recursive doubling (far partners first);
* ``hierarchical``: intra-host reduce-scatter (``L-1`` steps of ``S/L``), then ``L``
  concurrent inter-host rings, one per local rank, over its ``S/L`` slice (``2(H-1)``
  steps; the uplink carries ``L * S/(L*H) = S/H`` per step, ``2(H-1)/H * S`` in all), then
  an intra-host all-gather;
* ``ps`` (all_reduce): a parameter server of ``P`` servers (default one per worker host)
  on hosts of their own (on the workers' host when ``H == 1``): each worker pushes ``S``
  (``S/P`` to each server), each server reduces ``n`` slices and every worker pulls ``S``
  back; a server's link carries ``n * S / P`` each way;
* ``chain`` (broadcast): the pipelined chain ``0 -> 1 -> ... -> n-1``.

:func:`predict` prices one algorithm, :func:`best` ranks them all, :func:`crossovers` finds
the sizes where the winner changes. Nothing here runs a collective: a group with a model
(:func:`load_tune_file`, ``RINGCOMM_TUNE_FILE``) chooses its algorithms and piece sizes by
:func:`predict` through :mod:`ringcomm.collectives.choice`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

__all__ = [
    "ALGORITHMS",
    "DEFAULT_CHUNK_BYTES",
    "FIT_PARAMETERS",
    "FORMAT_VERSION",
    "HIER_SEGMENT_BYTES",
    "HOST_FIT_PARAMETERS",
    "OPS",
    "PROBE_KINDS",
    "READ_VERSIONS",
    "CostModel",
    "CpuModel",
    "Crossover",
    "Fit",
    "HostFit",
    "HostSample",
    "LinkModel",
    "Plan",
    "Prediction",
    "Sample",
    "Step",
    "best",
    "busbw_factor",
    "crossovers",
    "design_row",
    "fit_hosts",
    "fit_local",
    "load_tune_file",
    "plan",
    "predict",
    "predict_sample",
    "probe_plan",
    "uplink_bytes",
]

#: The modelled operations, and their algorithms in table order.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "tree", "rd", "hierarchical", "ps"),
    "reduce_scatter": ("ring", "rd", "hierarchical"),
    "all_gather": ("ring", "rd", "hierarchical"),
    "broadcast": ("tree", "chain"),
    "sendrecv": ("direct",),
}
OPS: tuple[str, ...] = tuple(ALGORITHMS)
#: Piece size of pipelined transfers (ringcomm's own default, RINGCOMM_CHUNK_BYTES).
DEFAULT_CHUNK_BYTES = 4 << 20
#: ``"version"`` of the JSON a :class:`CostModel` is saved as: 1 without a CPU term (what
#: ringcomm wrote before the term existed, still written and read), 2 with one.
FORMAT_VERSION = 2
#: The versions :meth:`CostModel.from_dict` reads.
READ_VERSIONS = (1, 2)
#: Bytes (of the per-rank buffer ``S``) per segment of a hierarchical call when nothing
#: chose another (``ringcomm.collectives.hierarchy.SEGMENT_BYTES``).
HIER_SEGMENT_BYTES = 8 << 20
_CLASSES = ("local", "net")


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor (docs/contracts.md, JSON output): busbw = size / time * factor."""
    n = world_size
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    if op in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")


# --- the parameters ------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkModel:
    """One link class: ``alpha_s`` seconds per message, ``beta_s_per_byte`` per byte."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s_per_byte"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"LinkModel.{name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def from_rate(cls, gbps: float, latency_us: float) -> LinkModel:
        """A link of ``gbps`` gigabits per second (1e9 bit/s) and ``latency_us`` per message."""
        if not gbps > 0:
            raise ValueError(f"link rate must be > 0 Gbit/s, got {gbps!r}")
        return cls(alpha_s=latency_us * 1e-6, beta_s_per_byte=8.0 / (gbps * 1e9))

    @property
    def gbps(self) -> float:
        """The rate in Gbit/s (inf for a free link)."""
        return math.inf if self.beta_s_per_byte == 0 else 8.0 / self.beta_s_per_byte / 1e9

    def describe(self) -> str:
        rate = "free" if self.beta_s_per_byte == 0 else f"{1 / self.beta_s_per_byte / 1e9:.3g} GB/s"
        return f"{self.alpha_s * 1e6:.3g} us/message, {rate} ({self.gbps:.3g} Gbit/s)"


@dataclass(frozen=True)
class CpuModel:
    """The CPU work of a collective, shared by the ranks of a host (and by co-located hosts).

    Per-byte costs in core-seconds: ``net_s_per_byte`` at each end of a transfer between
    hosts (the socket calls, the kernel's TCP and whatever shapes the link), and
    ``local_s_per_byte`` at each end of one on a host (a lane's copy in and its read out, a
    workspace step's pass), ``reduce_s_per_byte`` per byte reduced, ``segment_s`` per rank
    per segment of a hierarchical call (its sub-calls, hand-offs and waits) and
    ``hier_s_per_byte`` per rank per byte of a hierarchical call's buffer: what its two
    stages cost beyond their own transfers and reductions when they run at once on the same
    cores (measured on the netns bed at 10 Gbit/s: the hierarchical all_reduce took about a
    third more than its host steps and its cross-host steps each took alone). The ranks of
    ``shared_hosts`` hosts (0: every host of the world, as on a test bed of network
    namespaces on one machine) share one pool of ``cores`` cores.

    A step's CPU time is the work of the busiest host's ranks over one step, times the hosts
    in its pool, over ``cores``; the step lasts at least that long (:func:`predict`). Why
    not per rank: on a host whose ranks outnumber its cores (or on one machine holding
    several "hosts") the ranks, the kernel's network stack and the shaping take turns on the
    same cores, so their work adds up; measured on the netns bed at 10 Gbit/s, where the
    link is not the bottleneck, the flat ring and the hierarchical schedule both took about
    twice the link-only prediction. Fitted from probes across the hosts (:func:`fit_hosts`,
    ``ringcomm tune --hostfile``), not set by hand.
    """

    net_s_per_byte: float = 0.0
    local_s_per_byte: float = 0.0
    reduce_s_per_byte: float = 0.0
    segment_s: float = 0.0
    cores: float = 1.0
    shared_hosts: int = 1
    hier_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        for name in ("net_s_per_byte", "local_s_per_byte", "reduce_s_per_byte", "segment_s",
                     "hier_s_per_byte"):  # fmt: skip
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"CpuModel.{name} must be a finite number >= 0, got {v!r}")
        if not (isinstance(self.cores, (int, float)) and math.isfinite(self.cores)
                and self.cores > 0):  # fmt: skip
            raise ValueError(f"CpuModel.cores must be a finite number > 0, got {self.cores!r}")
        if isinstance(self.shared_hosts, bool) or not (
            isinstance(self.shared_hosts, int) and self.shared_hosts >= 0
        ):
            raise ValueError(
                f"CpuModel.shared_hosts must be an int >= 0, got {self.shared_hosts!r}"
            )

    def pool(self, hosts: int) -> int:
        """How many of ``hosts`` hosts share one pool of cores."""
        return hosts if self.shared_hosts == 0 else min(self.shared_hosts, hosts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "net_s_per_byte": self.net_s_per_byte,
            "local_s_per_byte": self.local_s_per_byte,
            "reduce_s_per_byte": self.reduce_s_per_byte,
            "segment_s": self.segment_s,
            "cores": self.cores,
            "shared_hosts": self.shared_hosts,
            "hier_s_per_byte": self.hier_s_per_byte,
        }

    @classmethod
    def from_dict(cls, data: Any) -> CpuModel:
        if not isinstance(data, dict):
            raise ValueError("cost model: 'cpu' is not a JSON object")  # noqa: TRY004
        try:
            return cls(
                net_s_per_byte=float(data["net_s_per_byte"]),
                local_s_per_byte=float(data["local_s_per_byte"]),
                reduce_s_per_byte=float(data["reduce_s_per_byte"]),
                segment_s=float(data.get("segment_s", 0.0)),
                cores=float(data["cores"]),
                shared_hosts=int(data.get("shared_hosts", 1)),
                hier_s_per_byte=float(data.get("hier_s_per_byte", 0.0)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"cost model: missing or malformed cpu field {exc}") from None

    def describe(self) -> str:
        pool = "every host" if self.shared_hosts == 0 else f"{self.shared_hosts} host(s)"
        return (
            f"cpu: net {self.net_s_per_byte * 1e12:.3g} ps/B, local "
            f"{self.local_s_per_byte * 1e12:.3g} ps/B (per end), reduce "
            f"{self.reduce_s_per_byte * 1e12:.3g} ps/B, hierarchical {self.segment_s * 1e6:.3g} "
            f"us per segment + {self.hier_s_per_byte * 1e12:.3g} ps/B; {self.cores:g} core(s) "
            f"shared by the ranks of {pool}"
        )


@dataclass(frozen=True)
class CostModel:
    """Parameters of both link classes, the reduction and the per-call overhead.

    The defaults: a same-host link of this project's 2-core VMs as measured by
    BENCHMARKING.md (about 20 us per message, 2.5 GB/s), a 1 Gbit/s, 50 us network,
    reductions at 6 GB/s (numpy add), 10 us per call, ringcomm's 4 MiB pieces.
    """

    local: LinkModel = field(default_factory=lambda: LinkModel(20e-6, 1 / 2.5e9))
    net: LinkModel = field(default_factory=lambda: LinkModel.from_rate(1.0, 50.0))
    gamma_s_per_byte: float = 1 / 6e9
    overhead_s: float = 10e-6
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    source: str = "defaults"  # where the numbers came from (printed with predictions)
    cpu: CpuModel | None = None  # None: CPU is not a shared resource (format version 1)

    def __post_init__(self) -> None:
        for name in ("gamma_s_per_byte", "overhead_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {v!r}")
        if isinstance(self.chunk_bytes, bool) or not (
            isinstance(self.chunk_bytes, int) and self.chunk_bytes > 0
        ):
            raise ValueError(f"CostModel.chunk_bytes must be an int > 0, got {self.chunk_bytes!r}")

    def link(self, cls: str) -> LinkModel:
        return self.local if cls == "local" else self.net

    def replace(self, **changes: Any) -> CostModel:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The JSON of the model: version 1 (what every ringcomm reads) without a CPU
        term, version 2 with one."""
        data: dict[str, Any] = {
            "version": 1 if self.cpu is None else FORMAT_VERSION,
            "local": {"alpha_s": self.local.alpha_s, "beta_s_per_byte": self.local.beta_s_per_byte},
            "net": {"alpha_s": self.net.alpha_s, "beta_s_per_byte": self.net.beta_s_per_byte},
            "gamma_s_per_byte": self.gamma_s_per_byte,
            "overhead_s": self.overhead_s,
            "chunk_bytes": self.chunk_bytes,
            "source": self.source,
        }
        if self.cpu is not None:
            data["cpu"] = self.cpu.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Any) -> CostModel:
        """The inverse of :meth:`to_dict`; ``ValueError`` naming what is wrong or missing."""
        if not isinstance(data, dict):
            raise ValueError("a cost model is a JSON object")  # noqa: TRY004 (a bad file)
        version = data.get("version", 1)
        if isinstance(version, bool) or version not in READ_VERSIONS:
            raise ValueError(
                f"cost model version {version!r}; this ringcomm reads "
                + " and ".join(map(str, READ_VERSIONS))
            )
        cpu = data.get("cpu")
        if cpu is not None and version < 2:
            raise ValueError("cost model: a 'cpu' term needs version 2")
        try:
            links = {
                c: LinkModel(float(data[c]["alpha_s"]), float(data[c]["beta_s_per_byte"]))
                for c in _CLASSES
            }
            return cls(
                local=links["local"],
                net=links["net"],
                gamma_s_per_byte=float(data["gamma_s_per_byte"]),
                overhead_s=float(data["overhead_s"]),
                chunk_bytes=int(data.get("chunk_bytes", DEFAULT_CHUNK_BYTES)),
                source=str(data.get("source", "file")),
                cpu=None if cpu is None else CpuModel.from_dict(cpu),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"cost model: missing or malformed field {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)}: not JSON ({exc})") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{os.fspath(path)}: {exc}") from None

    def describe(self) -> str:
        gamma = (
            "free" if self.gamma_s_per_byte == 0 else f"{1 / self.gamma_s_per_byte / 1e9:.3g} GB/s"
        )
        return (
            f"local {self.local.describe()}; net {self.net.describe()} per host uplink; "
            f"reduce {gamma}; {self.overhead_s * 1e6:.3g} us per call; "
            f"pieces of {self.chunk_bytes} B"
            + ("" if self.cpu is None else f"; {self.cpu.describe()}")
            + f" [{self.source}]"
        )


def load_tune_file(path: str | None, *, required: bool) -> CostModel | None:
    """The cost model a group chooses with (``RINGCOMM_TUNE_FILE``, see
    :attr:`ringcomm.config.InitConfig.tune_file`): :meth:`CostModel.load` of ``path``.

    None when ``path`` is None, or does not exist and was not ``required``. A file that was
    ``required`` (named by the variable) and is missing, unreadable or invalid raises
    ``ValueError`` naming it; one found at the default place but invalid is skipped with a
    ``RuntimeWarning`` naming it (the group then chooses as without a model).
    """
    if path is None:
        return None
    if not required and not os.path.exists(path):
        return None
    try:
        return CostModel.load(path)
    except (OSError, ValueError) as exc:
        text = str(exc) if isinstance(exc, ValueError) else f"{path}: {exc.strerror or exc}"
        if required:
            raise ValueError(f"RINGCOMM_TUNE_FILE: {text}") from None
        warnings.warn(
            f"ringcomm: ignoring the cost model at {text} (write a new one with "
            "ringcomm tune, or set RINGCOMM_TUNE_FILE=none)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


# --- plans: pure data ------------------------------------------------------------------------
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


# --- pricing ---------------------------------------------------------------------------------
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


def _plan_time(model: CostModel, p: Plan, size: float, segment_bytes: int | None = None) -> float:
    if segment_bytes is not None and p.algo == "hierarchical":
        return _segmented_time(model, p, size, segment_bytes)
    if not p.pipelined:
        return model.overhead_s + sum(s.repeat * _step_time(model, s, size, p.hosts)
                                      for s in p.steps)  # fmt: skip
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
    t = _plan_time(model, p, float(size), segment_bytes)
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


# --- fitting ---------------------------------------------------------------------------------
#: The columns of :func:`design_row`: a same-host fit's unknowns.
FIT_PARAMETERS: tuple[str, ...] = ("overhead_s", "alpha_s", "beta_s_per_byte", "gamma_s_per_byte")


def design_row(
    op: str, algo: str, world_size: int, size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> np.ndarray:
    """Coefficients of (overhead, alpha, beta, gamma) in the predicted time of ``op`` by
    ``algo`` on ``world_size`` ranks of one host at ``size`` bytes.

    Linear only where every step's reduction is not overlapped with its transfer: one
    piece per transfer, i.e. ``size`` small enough that no transfer exceeds
    ``chunk_bytes`` (:func:`ringcomm.tuning.costmodel` prices ``k`` pieces as an overlap).
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
#: What ``ringcomm tune --hostfile`` runs, every rank of every host at once (all_reduce):
#: ``flat`` the ring over the whole group, ``hier`` the hierarchical schedule (in segments),
#: ``cross`` only its steps across hosts (every local rank's ring with the ranks of its
#: local index on the other hosts, all at once), ``host`` only its steps on the hosts (each
#: host's reduce_scatter then all_gather, all hosts at once).
PROBE_KINDS: tuple[str, ...] = ("flat", "hier", "cross", "host")
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
    return _plan_time(model, p, float(sample.size), segment)


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
        return (m.net.alpha_s, m.net.beta_s_per_byte, cpu.net_s_per_byte,
                cpu.local_s_per_byte, cpu.reduce_s_per_byte, cpu.segment_s,
                cpu.hier_s_per_byte)  # fmt: skip


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
