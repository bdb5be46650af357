"""The cost model's parameters: link classes, the CPU term, the whole model, and their JSON.

:class:`CostModel` holds both link classes (``local``: same host, every rank its own link;
``net``: one full-duplex uplink per host, shared by its ranks), the reduction rate, the
per-call overhead, the piece size and, from ``ringcomm tune --hostfile``, a
:class:`CpuModel`. It is saved as JSON (:data:`FORMAT_VERSION`; :data:`READ_VERSIONS` are
read) and loaded for a group by :func:`load_tune_file`. Pure: the stdlib (and config).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ringcomm.config import DEFAULT_CHUNK_BYTES

__all__ = [
    "ALGORITHMS",
    "FORMAT_VERSION",
    "HIER_SEGMENT_BYTES",
    "OPS",
    "READ_VERSIONS",
    "CostModel",
    "CpuModel",
    "LinkModel",
    "busbw_factor",
    "load_tune_file",
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
def _check_non_negative(model: object, names: tuple[str, ...]) -> None:
    """Refuse, naming it, a field of ``model`` among ``names`` that is not a finite number >= 0."""
    for name in names:
        v = getattr(model, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(
                f"{type(model).__name__}.{name} must be a finite number >= 0, got {v!r}"
            )


@dataclass(frozen=True)
class LinkModel:
    """One link class: ``alpha_s`` seconds per message, ``beta_s_per_byte`` per byte."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        _check_non_negative(self, ("alpha_s", "beta_s_per_byte"))

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
        _check_non_negative(
            self,
            (
                "net_s_per_byte",
                "local_s_per_byte",
                "reduce_s_per_byte",
                "segment_s",
                "hier_s_per_byte",
            ),
        )
        if not (
            isinstance(self.cores, (int, float)) and math.isfinite(self.cores) and self.cores > 0
        ):
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
        return asdict(self)

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
        _check_non_negative(self, ("gamma_s_per_byte", "overhead_s"))
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
            **asdict(self),
        }
        if self.cpu is None:
            del data["cpu"]
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
