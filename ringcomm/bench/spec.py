"""What a benchmark measures (pure): the config, the sweep plan, element counts and shapes.

Conventions are nccl-tests' (see BENCHMARKING.md):

* ``bytes`` is the per-rank buffer as nccl-tests counts it: all_reduce's in/out buffer,
  reduce_scatter's *input*, all_gather's *output*, broadcast's buffer, all_to_all's input
  (= output), sendrecv's message.
* ``count`` is the number of elements of that same buffer, so ``bytes == count * itemsize``.
  It is ``bytes // itemsize`` (at least 1); for reduce_scatter, all_gather and all_to_all it
  is rounded up to a multiple of the world size (at least the world size), so each rank's
  block (``count // world_size`` elements) is whole.
* busbw = algbw x factor: all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all
  (n-1)/n; broadcast and sendrecv 1.

Sizes of the sweep are ``begin, begin*factor, ...`` up to ``end`` (inclusive, nccl-tests'
``-b/-e/-f``); sizes that round to the same buffer are measured once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEVICES",
    "GLOO_DTYPES",
    "IMPLS",
    "OPS",
    "REDUCING_OPS",
    "ROOTED_OPS",
    "SPLIT_OPS",
    "STAGED_DEVICES",
    "BenchConfig",
    "SizeSpec",
    "busbw_factor",
    "device_impl",
    "element_count",
    "plan_sizes",
    "sweep_bytes",
]

#: The benchmarked operations, in help order (docs/contracts.md, Command line).
OPS: tuple[str, ...] = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "all_to_all",
    "sendrecv",
)
#: Operations that take a reduce op (the table's ``redop`` column; "none" for the others).
REDUCING_OPS = frozenset({"all_reduce", "reduce_scatter"})
#: Operations with a root (the table's ``root`` column; -1 for the others).
ROOTED_OPS = frozenset({"broadcast"})
#: Operations whose buffer is split in world_size blocks: counts round up to a multiple of n.
SPLIT_OPS = frozenset({"reduce_scatter", "all_gather", "all_to_all"})
#: NumPy dtypes Gloo handles (it refuses uint16/32/64).
GLOO_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"}
)
#: Implementations a row can come from (the JSON ``impl`` key).
IMPLS: tuple[str, ...] = (
    "ringcomm",
    "gloo",
    "mpi",
    "ringcomm-cuda",
    "ringcomm-staged",
    "ringcomm-standin",
    "ringcomm-cuda-staged",
    "gloo-cuda",
    "nccl",
)
#: Where ``--device`` puts ringcomm's buffers: NumPy arrays (``host``), CuPy arrays on the
#: rank's GPU (``cuda``), or the host stand-in for CuPy arrays: ``standin`` (through exactly
#: the algorithm a CuPy array takes: device windows on one host), ``host-staged`` (through
#: host staging, as CuPy across hosts), to test and measure them without a GPU;
#: ``cuda-staged``: CuPy arrays through host staging (the path before device windows).
DEVICES: tuple[str, ...] = (
    "host",
    "cuda",
    "host-staged",
    "standin",
    "cuda-staged",
    "symmetric",
    "copy",
)
#: Devices whose calls go through host staging (device windows off for their calls).
STAGED_DEVICES = frozenset({"host-staged", "cuda-staged"})


def device_impl(device: str) -> str:
    """The ``impl`` name of ringcomm's rows on ``device`` (host: plain ``ringcomm``)."""
    return {
        "host": "ringcomm",
        "cuda": "ringcomm-cuda",
        "host-staged": "ringcomm-staged",
        "standin": "ringcomm-standin",
        "cuda-staged": "ringcomm-cuda-staged",
        "symmetric": "ringcomm-symmetric",
        "copy": "numpy-copyto",
    }[device]


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor."""
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {n}")
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in SPLIT_OPS:
        return (n - 1) / n
    if op in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")


def element_count(op: str, nbytes: int, itemsize: int, world_size: int) -> int:
    """Elements of the per-rank buffer for a requested size of ``nbytes`` (see module doc)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    count = max(1, nbytes // itemsize)
    if op in SPLIT_OPS:
        n = world_size
        count = max(n, -(-count // n) * n)
    return count


def sweep_bytes(begin: int, end: int, factor: int) -> list[int]:
    """``begin, begin*factor, ...`` while <= ``end`` (nccl-tests' -b/-e/-f)."""
    if begin < 1:
        raise ValueError(f"the smallest size must be >= 1 byte, got {begin}")
    if end < begin:
        raise ValueError(f"the largest size ({end}) is below the smallest ({begin})")
    if factor < 2 and end != begin:
        raise ValueError(f"the size factor must be >= 2, got {factor}")
    sizes = [begin]
    while factor >= 2 and sizes[-1] * factor <= end:
        sizes.append(sizes[-1] * factor)
    return sizes


@dataclass(frozen=True)
class BenchConfig:
    """One ``ringcomm bench`` invocation, parsed once (what the ranks need travels too)."""

    op: str
    world_size: int
    begin: int = 8
    end: int = 64 << 20
    factor: int = 2
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    redop: str = "sum"
    root: int = 0
    check: bool = False
    compare: str | None = None  # None | "gloo" | "mpi" | "nccl"
    rounds: int = 1  # alternations A B A B per size (pooled)
    timeout_s: float = 1800.0  # the whole job
    op_timeout_s: float = 120.0  # one collective call
    quiet: bool = False
    seed: int = 1234
    mpi_tcp: bool = False  # mpirun --mca btl tcp,self (like-for-like with sockets)
    devices: tuple[str, ...] = ("host",)  # where ringcomm's buffers live (DEVICES)
    bind: str | None = None  # RINGCOMM_BIND for the spawned ranks (None: as inherited)
    multihost: bool = False  # ranks on several hosts (--hostfile/-H): Gloo's store at MASTER_ADDR

    @property
    def peer_impl(self) -> str | None:
        """The ``impl`` of the peer's rows: ``gloo`` (CPU tensors), ``gloo-cuda`` (CUDA
        tensors: with ``--device cuda``), ``mpi``, ``nccl``; None without ``--compare``."""
        if self.compare == "gloo" and {"cuda", "cuda-staged"} & set(self.devices):
            return "gloo-cuda"
        return self.compare

    @property
    def impls(self) -> tuple[str, ...]:
        ours = tuple(device_impl(d) for d in self.devices)
        peer = self.peer_impl
        return ours if peer is None else (*ours, peer)

    def sizes(self) -> list[SizeSpec]:
        return plan_sizes(self)


@dataclass(frozen=True)
class SizeSpec:
    """One size of the sweep: the buffers every implementation allocates for it."""

    op: str
    world_size: int
    dtype: str
    count: int  # elements of the buffer nccl-tests counts (see module doc)
    redop: str | None  # None for ops that do not reduce
    root: int  # -1 for ops without a root

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize)

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    @property
    def block(self) -> int:
        """Elements per rank's block (split ops); the whole count otherwise."""
        return self.count // self.world_size if self.op in SPLIT_OPS else self.count

    @property
    def in_shape(self) -> tuple[int, ...]:
        """Shape of each rank's input buffer."""
        if self.op in ("reduce_scatter", "all_to_all"):
            return (self.world_size, self.block)
        if self.op == "all_gather":
            return (self.block,)
        return (self.count,)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Shape of each rank's output buffer (in-place ops: the input's)."""
        if self.op == "reduce_scatter":
            return (self.block,)
        if self.op == "all_gather":
            return (self.world_size, self.block)
        return self.in_shape

    @property
    def busbw_factor(self) -> float:
        return busbw_factor(self.op, self.world_size)


def plan_sizes(config: BenchConfig) -> list[SizeSpec]:
    """The sweep of ``config``: one :class:`SizeSpec` per distinct buffer, smallest first."""
    itemsize = int(np.dtype(config.dtype).itemsize)
    redop = config.redop if config.op in REDUCING_OPS else None
    root = config.root if config.op in ROOTED_OPS else -1
    specs: list[SizeSpec] = []
    seen: set[int] = set()
    for nbytes in sweep_bytes(config.begin, config.end, config.factor):
        count = element_count(config.op, nbytes, itemsize, config.world_size)
        if count in seen:
            continue
        seen.add(count)
        specs.append(SizeSpec(config.op, config.world_size, config.dtype, count, redop, root))
    return specs
