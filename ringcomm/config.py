"""Process-group configuration: explicit arguments and environment variables -> ``InitConfig``.

Pure: reads only the mapping it is given (``os.environ`` by default), opens no sockets.

Each setting is resolved on its own, the first source that has it wins (docs/contracts.md, Python API):

1. the explicit argument of :func:`resolve_init_config`;
2. ``RINGCOMM_RANK`` / ``RINGCOMM_WORLD_SIZE`` / ``RINGCOMM_MASTER_ADDR`` /
   ``RINGCOMM_MASTER_PORT`` / ``RINGCOMM_LOCAL_RANK`` (``ringcomm run``);
3. ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` / ``LOCAL_RANK`` (torchrun;
   also what ``mpirun -x MASTER_ADDR -x MASTER_PORT`` exports);
4. ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_LOCAL_RANK`` (mpirun);
5. ``PMI_RANK`` / ``PMI_SIZE`` / ``MPI_LOCALRANKID`` (MPICH, Intel MPI);
6. ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` (srun).

Under srun with no store address or port, the first host of ``SLURM_JOB_NODELIST`` and a
port derived from ``SLURM_JOB_ID`` serve (:func:`slurm_master_port`). Under mpirun with
every rank on one host (``OMPI_COMM_WORLD_LOCAL_SIZE == OMPI_COMM_WORLD_SIZE``) and no
port, 127.0.0.1 and a port derived from Open MPI's job id serve (:func:`mpirun_job_id`,
:func:`mpirun_master_port`); across hosts mpirun needs ``MASTER_ADDR``/``MASTER_PORT``.

With nothing set the process is a singleton: rank 0 of 1, store on 127.0.0.1 at port 0
("pick a free one"). Tunables: ``RINGCOMM_TIMEOUT_S``, ``RINGCOMM_TOKEN``,
``RINGCOMM_CHUNK_BYTES`` (suffixes K/M/G), ``RINGCOMM_ALGO``, ``RINGCOMM_LOG``,
``RINGCOMM_STORE_EXTERNAL``, ``RINGCOMM_TRANSPORT``, ``RINGCOMM_SECURITY``,
``RINGCOMM_MAX_UNEXPECTED_MESSAGES``/``_BYTES``, ``RINGCOMM_LOCAL_LANE``, ``RINGCOMM_SHM``,
``RINGCOMM_BIND``, ``RINGCOMM_TRACE_DIR``/``RINGCOMM_TRACE``/``RINGCOMM_TRACE_ENTRIES``
(the flight recorder, ringcomm.core.flight), ``RINGCOMM_HOST_ID`` (pretend hosts), ``RINGCOMM_RESTART`` (set by the launcher for a
restarted rank), ``RINGCOMM_TUNE_FILE`` (the cost model the group chooses algorithms
with: :attr:`InitConfig.tune_file`; only its name is resolved here, the group reads it).
Every invalid value raises :class:`RendezvousError` naming the variable, its value and the
convention it came from.

Settings that belong to no group are small pure functions of the same mapping, each
raising :class:`ValueError` naming the variable: :func:`bind_mode` (``RINGCOMM_BIND``,
with :func:`binds_to_core`, the one core-binding rule), :func:`staging_max_bytes`
(``RINGCOMM_STAGING_MAX_BYTES``), :func:`ipc_enabled`, :func:`ipc_window_bytes` and
:func:`ipc_small_bytes` (``RINGCOMM_IPC``, ``RINGCOMM_IPC_WINDOW_BYTES``,
``RINGCOMM_IPC_SMALL_BYTES``: the device windows), :func:`ps_log_level` (``RINGCOMM_PS_LOG``),
:func:`env_token` (``RINGCOMM_TOKEN``), :func:`security_mode` (``RINGCOMM_SECURITY``),
:func:`env_trace_dir` (``RINGCOMM_TRACE_DIR``) and :func:`env_master_addr`
(``RINGCOMM_MASTER_ADDR``, then ``MASTER_ADDR``). No other module reads a ``RINGCOMM_*``
variable: they take these values as arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import numbers
import os
import re
import zlib
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ringcomm.errors import RendezvousError

__all__ = [
    "BIND_MODES",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_IPC_SMALL_BYTES",
    "DEFAULT_IPC_WINDOW_BYTES",
    "DEFAULT_PS_LOG_LEVEL",
    "DEFAULT_STAGING_MAX_BYTES",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_TUNE_FILE",
    "LOG_LEVELS",
    "MAX_TUNED_CHUNK_BYTES",
    "MPIRUN_JOB_ID_VARS",
    "PS_LOG_LEVELS",
    "SECURITY_MODES",
    "TRANSPORT_MODES",
    "TUNE_FILE_OFF",
    "InitConfig",
    "TorchAgentStore",
    "UsageError",
    "bind_mode",
    "binds_to_core",
    "check_output_path",
    "default_of",
    "env_master_addr",
    "env_token",
    "env_trace_dir",
    "environ_changed",
    "format_size",
    "ipc_enabled",
    "ipc_small_bytes",
    "ipc_window_bytes",
    "mpirun_job_id",
    "mpirun_master_port",
    "parse_size",
    "parse_slurm_nodelist",
    "ps_log_level",
    "resolve_init_config",
    "security_mode",
    "size_arg",
    "slurm_master_port",
    "staging_max_bytes",
]

#: The group's default per-call deadline when neither ``timeout_s=`` nor RINGCOMM_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 300.0
#: Default piece size of pipelined transfers (measured: benchmarks/results/README.md).
DEFAULT_CHUNK_BYTES = 4 << 20
#: RINGCOMM_LOG values (any case): nothing; a summary of the group at init (rank 0);
#: that and every op's start and end.
LOG_LEVELS = ("off", "info", "debug")
#: The largest piece size the cost model may choose (collectives/choice.py's candidates).
MAX_TUNED_CHUNK_BYTES = 8 << 20
#: RINGCOMM_SECURITY values: the data plane's mechanism with the job token
#: (ringcomm.transport.zmq_transport), or "none": no token anywhere.
SECURITY_MODES = ("none", "handshake", "curve")
#: RINGCOMM_BIND values (see InitConfig.bind).
BIND_MODES = ("auto", "none", "core")
#: RINGCOMM_TRANSPORT / ``transport=`` values: ipc:// to peers on this host and tcp://
#: to the others (``auto``), or one of them for every peer.
TRANSPORT_MODES = ("auto", "ipc", "tcp")
#: Most pinned bytes one staging pool keeps, without RINGCOMM_STAGING_MAX_BYTES.
DEFAULT_STAGING_MAX_BYTES = 1 << 30
#: Bytes of each of the two buffers of a rank's device window (ringcomm.collectives.ipc),
#: without RINGCOMM_IPC_WINDOW_BYTES: a round of a large device collective.
DEFAULT_IPC_WINDOW_BYTES = 64 << 20
#: Device collectives up to this many bytes go through the host (a pinned copy), without
#: RINGCOMM_IPC_SMALL_BYTES.
DEFAULT_IPC_SMALL_BYTES = 16 << 10
#: RINGCOMM_PS_LOG values (logging's level names, any case) and the default.
PS_LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "NOTSET")
DEFAULT_PS_LOG_LEVEL = "WARNING"
#: Where ``ringcomm tune`` writes its cost model unless ``--out`` says otherwise, and where
#: a group looks for one when RINGCOMM_TUNE_FILE is unset (relative: the working directory
#: of the group's rank 0, whose model every rank uses).
DEFAULT_TUNE_FILE = "ringcomm-model.json"
#: RINGCOMM_TUNE_FILE values (any case) that turn the cost model off.
TUNE_FILE_OFF = ("none", "off", "0")
#: Where a group of more than one process looks for the store when no address is given.
DEFAULT_MASTER_ADDR = "127.0.0.1"

# The launcher conventions in precedence order: (source name, human label, variable names).
# A variable name of None means the convention does not define that setting.
_CONVENTIONS: tuple[tuple[str, str, dict[str, str | None]], ...] = (
    (
        "ringcomm",
        "RINGCOMM_* variables",
        {
            "rank": "RINGCOMM_RANK",
            "world_size": "RINGCOMM_WORLD_SIZE",
            "local_rank": "RINGCOMM_LOCAL_RANK",
            "local_world_size": "RINGCOMM_LOCAL_WORLD_SIZE",
            "master_addr": "RINGCOMM_MASTER_ADDR",
            "master_port": "RINGCOMM_MASTER_PORT",
        },
    ),
    (
        "torchrun",
        "torchrun variables",
        {
            "rank": "RANK",
            "world_size": "WORLD_SIZE",
            "local_rank": "LOCAL_RANK",
            "local_world_size": "LOCAL_WORLD_SIZE",
            "master_addr": "MASTER_ADDR",
            "master_port": "MASTER_PORT",
        },
    ),
    (
        "mpirun",
        "mpirun variables",
        {
            "rank": "OMPI_COMM_WORLD_RANK",
            "world_size": "OMPI_COMM_WORLD_SIZE",
            "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
            "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
            "master_addr": None,
            "master_port": None,
        },
    ),
    (
        "pmi",
        "PMI variables",
        {
            "rank": "PMI_RANK",
            "world_size": "PMI_SIZE",
            "local_rank": "MPI_LOCALRANKID",
            "local_world_size": "MPI_LOCALNRANKS",
            "master_addr": None,
            "master_port": None,
        },
    ),
    (
        "slurm",
        "Slurm variables",
        {
            "rank": "SLURM_PROCID",
            "world_size": "SLURM_NTASKS",
            "local_rank": "SLURM_LOCALID",
            "local_world_size": None,
            "master_addr": None,
            "master_port": None,
        },
    ),
)
_SOURCE_ORDER = ("explicit",) + tuple(c[0] for c in _CONVENTIONS) + ("singleton",)

_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 40000  # derived ports fall in 20000..59999
# mpirun's derived ports fall in 61000..65535: above Linux's default ephemeral range
# (32768..60999), so no outgoing connection holds one by chance.
_MPIRUN_PORT_BASE = 61000
_MPIRUN_PORT_SPAN = 4536
#: Where Open MPI names its job, read in this order (the first set one wins): PMIx's
#: namespace (Open MPI 4 and 5), then the ORTE job id (4.x: ``ess_base_jobid``; older
#: releases ``orte_ess_jobid``). Every rank of one ``mpirun`` sees the same value.
MPIRUN_JOB_ID_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid")


@dataclass(frozen=True)
class TorchAgentStore:
    """torchrun's agent store (a torch ``TCPStore``) and the key prefix of this job's
    attempt in it (``ringcomm/<TORCHELASTIC_RUN_ID>/attempt_<TORCHELASTIC_RESTART_COUNT>``)."""

    host: str
    port: int
    prefix: str


@dataclass(frozen=True)
class InitConfig:
    """Everything a process needs to join a group, resolved once.

    ``master_port == 0`` means "pick a free port" and only occurs for a single process.
    ``store_external``: a launcher already serves the store at ``master_addr:master_port``,
    so rank 0 must not host one. ``source`` names the convention that gave rank and world
    size: ``"explicit"``, ``"ringcomm"``, ``"torchrun"``, ``"mpirun"``, ``"pmi"``,
    ``"slurm"`` or ``"singleton"``.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    token: str | None = None
    #: Piece size of pipelined transfers (``chunk_bytes=`` / ``RINGCOMM_CHUNK_BYTES``, > 0);
    #: None: :data:`DEFAULT_CHUNK_BYTES` (see :attr:`effective_chunk_bytes`).
    chunk_bytes: int | None = None
    algo: str | None = None
    log: str | None = None
    store_external: bool = False
    source: str = "singleton"
    #: How the job authenticates (``RINGCOMM_SECURITY``, :data:`SECURITY_MODES`): with a
    #: token (given, handed out by the launcher, or minted by the store's host), the data
    #: plane by "handshake" or "curve" (ringcomm.transport.zmq_transport); "none": no token.
    security: str = "handshake"
    #: Per-peer cap on buffered unexpected messages (``RINGCOMM_MAX_UNEXPECTED_MESSAGES``,
    #: ``RINGCOMM_MAX_UNEXPECTED_BYTES``); None: the engine's defaults.
    max_unexpected_messages: int | None = None
    max_unexpected_bytes: int | None = None
    #: Small collective messages to peers on this host take AF_UNIX datagrams instead of
    #: zmq (``RINGCOMM_LOCAL_LANE``, default on; see ringcomm.transport.unix_lane).
    local_lane: bool = True
    #: Large payloads to peers on this host go through shared memory (``RINGCOMM_SHM``,
    #: default on where the lane is; see ringcomm.transport.shm_lane).
    shm: bool = True
    #: Collectives of a group whose ranks share one host go through one shared workspace
    #: (``RINGCOMM_WORKSPACE``, default on; see ringcomm.transport.workspace).
    workspace: bool = True
    #: ``"core"``: the thread that joins the group runs on one core, local rank modulo
    #: the cores it may use; ``"auto"`` (the default): so when the host has more ranks
    #: than those cores (``local_world_size`` known), else as ``"none"``: the OS places
    #: it (``RINGCOMM_BIND``).
    bind: str = "auto"
    #: Ranks on this host, from the launcher (``LOCAL_WORLD_SIZE`` and the like), or None.
    local_world_size: int | None = None
    #: How peers are reached (``transport=`` / ``RINGCOMM_TRANSPORT``): one of
    #: :data:`TRANSPORT_MODES`.
    transport: str = "auto"
    #: The flight recorder (ringcomm.core.flight): operations each rank remembers
    #: (``RINGCOMM_TRACE_ENTRIES``, 0: off), where the record is written
    #: (``RINGCOMM_TRACE_DIR``), and whether ``close()`` writes it too (``RINGCOMM_TRACE=1``).
    trace_entries: int = 4096
    #: This rank's host identity (``RINGCOMM_HOST_ID``); None: hostname and boot id. Ranks
    #: with different ones treat each other as on other hosts (tcp://, no shared memory):
    #: several "hosts" on one machine, for tests and benchmarks of the multi-host paths.
    host_id: str | None = None
    trace_dir: str | None = None
    trace_at_close: bool = False
    #: How many times the launcher restarted this rank (``RINGCOMM_RESTART``, set by
    #: ``ringcomm run --max-restarts``): > 0 joins the running job (``ProcessGroup.grow``).
    restart: int = 0
    #: The cost model the group chooses algorithms and piece sizes with (ringcomm.tuning.costmodel,
    #: written by ``ringcomm tune``): ``RINGCOMM_TUNE_FILE``, else :data:`DEFAULT_TUNE_FILE`
    #: if it exists; None: none (``RINGCOMM_TUNE_FILE=none``). Rank 0 reads it when the
    #: group forms and every rank uses rank 0's. ``tune_file_required``: the variable named
    #: it, so a missing or invalid file is an error (at the default place: a warning).
    tune_file: str | None = DEFAULT_TUNE_FILE
    tune_file_required: bool = False
    #: Where :attr:`master_port` came from when no one set it, for error messages, e.g.
    #: ``"derived from Open MPI's job id (PMIX_NAMESPACE=...)"``; None: it was set.
    master_port_origin: str | None = None
    #: Under torchrun (its agent serving a ``TCPStore`` at MASTER_ADDR:MASTER_PORT): that
    #: store, where rank 0 publishes the address of ringcomm's own store (served on a port
    #: from the OS: :attr:`master_port` is 0); None elsewhere.
    torch_store: TorchAgentStore | None = None

    @property
    def effective_chunk_bytes(self) -> int:
        """The piece size the group uses: :attr:`chunk_bytes`, else the default (4 MiB)."""
        return DEFAULT_CHUNK_BYTES if self.chunk_bytes is None else self.chunk_bytes

    @functools.cached_property
    def max_piece_bytes(self) -> int:
        """The largest piece a call of the group may send: what its peers' receive sockets
        accept (a larger frame is refused before anything is authenticated)."""
        return max(self.effective_chunk_bytes, MAX_TUNED_CHUNK_BYTES)

    @property
    def log_debug(self) -> bool:
        """``RINGCOMM_LOG=debug``: log every op's start and end."""
        return self.log == "debug"

    @property
    def log_info(self) -> bool:
        """``RINGCOMM_LOG=info`` (or debug): a summary of the group when it forms."""
        return self.log in ("info", "debug")


@dataclass(frozen=True)
class _Found:
    """One resolved setting and where it came from (for error messages)."""

    value: str | int | float | bool
    name: str  # variable or argument name, e.g. "RANK" or "rank"
    source: str  # "explicit", "ringcomm", "torchrun", ..., or "default"
    label: str  # e.g. "torchrun variables"

    def describe(self) -> str:
        """``RANK=5``: the name and the value as the user wrote it."""
        return f"{self.name}={self.value}"


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30}


def parse_size(text: str) -> int:
    """Parse a byte count with an optional K/M/G suffix (powers of 1024, any case).

    ``"64M"`` -> 67108864, ``"8"`` -> 8, ``"4k"``/``"4KB"``/``"4KiB"`` -> 4096. Fractions
    (``"1.5K"``), signs and empty strings raise :class:`ValueError`.
    """
    match = _SIZE_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"invalid size {text!r}: expected a non-negative integer with an optional "
            "K, M or G suffix (powers of 1024), e.g. 8, 64K, 16M, 1G"
        )
    return int(match.group(1)) << _SIZE_SHIFT[match.group(2).lower()]


def format_size(nbytes: int) -> str:
    """The shortest exact :func:`parse_size` spelling: 67108864 -> ``"64M"``, 8 -> ``"8"``."""
    for shift, suffix in ((30, "G"), (20, "M"), (10, "K")):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{suffix}"
    return str(nbytes)


def size_arg(text: str) -> int:
    """:func:`parse_size` as an argparse ``type=`` (a bad size is a usage error)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_output_path(path: str | None, flag: str, *, directory: bool = False) -> None:
    """Refuse, before any work, an output path a command could not write at the end:
    raise :class:`UsageError` naming ``flag`` (one line; ``ringcomm`` exits 2). A file's
    folder must exist and be writable, and the path must not be a folder; ``directory``:
    a folder to write into (made if missing: its nearest existing parent must be
    writable). None: no output asked for."""
    if path is None or path == "":
        return
    full = os.path.abspath(path)
    if directory:
        probe = full
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            raise UsageError(f"{flag} {path}: {probe} is not a directory")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: cannot write in {probe}")
        return
    if os.path.isdir(full):
        raise UsageError(f"{flag} {path}: is a directory (give a file name)")
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: no such directory: {parent}")
    if not os.access(parent, os.W_OK | os.X_OK) or (
        os.path.exists(full) and not os.access(full, os.W_OK)
    ):
        raise UsageError(f"{flag} {path}: not writable")


class UsageError(Exception):
    """A command line that cannot run: ``ringcomm``'s entry point (:mod:`ringcomm.cli`)
    prints ``ringcomm <command>: error: <message>`` and exits 2."""


def default_of(cls: Any, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (a ``default_factory`` is
    called): what a command line's ``default=`` takes, so each default is written once."""
    for f in dataclasses.fields(cls):
        if f.name != name:
            continue
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        raise ValueError(f"{cls.__name__}.{name} has no default")
    raise ValueError(f"{cls.__name__} has no field {name!r}")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"invalid Slurm host list {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"invalid Slurm host list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"invalid Slurm host list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return parts


def _expand_bracket(body: str, whole: str) -> list[str]:
    """Expand the inside of one ``[...]``: ``"01-03,07"`` -> ``["01", "02", "03", "07"]``."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"invalid Slurm host list {whole!r}: bad range {item!r}")
        if not sep:
            out.append(lo)
            continue
        first, last = int(lo), int(hi)
        if last < first:
            raise ValueError(f"invalid Slurm host list {whole!r}: descending range {item!r}")
        width = len(lo)  # Slurm keeps the zero padding of the range's first bound
        out.extend(f"{n:0{width}d}" for n in range(first, last + 1))
    return out


def parse_slurm_nodelist(text: str) -> list[str]:
    """Expand a Slurm compressed host list, in Slurm's order, zero padding kept.

    ``"node[01-03,07],gpu5,a[1-2]b"`` ->
    ``["node01", "node02", "node03", "node07", "gpu5", "a1b", "a2b"]``; several bracket
    groups in one name expand as a product (``"r[1-2]n[1-2]"`` -> r1n1, r1n2, r2n1, r2n2).
    Malformed lists raise :class:`ValueError`.
    """
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        part = part.strip()
        if not part:
            continue
        names = [""]
        for piece in re.split(r"(\[[^\]]*\])", part):
            if piece.startswith("["):
                choices = _expand_bracket(piece[1:-1], text)
            else:
                choices = [piece]
            names = [name + choice for name in names for choice in choices]
        hosts.extend(names)
    return hosts


def slurm_master_port(job_id: int) -> int:
    """The store port every rank of Slurm job ``job_id`` agrees on: 20000 + id % 40000."""
    return _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN


def mpirun_job_id(env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(variable, value)`` naming this Open MPI job (:data:`MPIRUN_JOB_ID_VARS`), or None."""
    for name in MPIRUN_JOB_ID_VARS:
        value = (env.get(name) or "").strip()
        if value:
            return name, value
    return None


def mpirun_master_port(job_id: str) -> int:
    """The store port every rank of Open MPI job ``job_id`` agrees on:
    61000 + crc32(job_id) % 4536 (61000..65535; a stable hash, the same in every process)."""
    return _MPIRUN_PORT_BASE + zlib.crc32(job_id.encode()) % _MPIRUN_PORT_SPAN


def _lookup(env: Mapping[str, str], setting: str) -> _Found | None:
    """The first launcher convention that sets ``setting`` (empty values count as unset)."""
    for source, label, names in _CONVENTIONS:
        name = names[setting]
        if name is None:
            continue
        raw = env.get(name)
        if raw is not None and raw.strip():
            return _Found(raw.strip(), name, source, label)
    return None


def _as_int(found: _Found) -> int:
    """The setting as an int; strings must be plain decimal integers."""
    value = found.value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value):
        return int(value)
    raise RendezvousError(f"{found.name}={value!r} is not an integer (from {found.label})")


def _explicit(name: str, value: str | float | None) -> _Found | None:
    if value is None:
        return None
    return _Found(value, name, "explicit", "explicit argument")


def _env_setting(env: Mapping[str, str], name: str) -> _Found | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    return _Found(raw.strip(), name, "ringcomm", "environment")


def _parse_bool(found: _Found) -> bool:
    text = str(found.value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise RendezvousError(f"{found.describe()} is not a boolean (use 1/0, true/false)")


def _origin(*found: _Found | None) -> str:
    """``"(from torchrun variables)"``, or one clause per setting when sources differ."""
    present = [f for f in found if f is not None]
    labels = {f.label for f in present}
    if len(labels) == 1:
        return f"(from {labels.pop()})"
    return "(" + ", ".join(f"{f.name} from {f.label}" for f in present) + ")"


def environment() -> MutableMapping[str, str]:
    """The process's environment. The one place ringcomm reaches it: other modules ask
    here (a launcher copies it for the ranks it starts, a setting is parsed below)."""
    return os.environ


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return environment() if env is None else env


def bind_mode(env: Mapping[str, str] | None = None) -> str:
    """``RINGCOMM_BIND``: one of :data:`BIND_MODES` (any case); ``"auto"`` when unset."""
    found = _env_setting(_environ(env), "RINGCOMM_BIND")
    if found is None:
        return "auto"
    mode = str(found.value).lower()
    if mode not in BIND_MODES:
        raise ValueError(f"RINGCOMM_BIND must be one of {BIND_MODES}, got {found.value!r}")
    return mode


def binds_to_core(bind: str, local_world_size: int | None, ncores: int) -> bool:
    """The core-binding rule: whether a rank's driving thread is bound to one core.

    ``bind`` (``RINGCOMM_BIND``): ``"core"`` always; ``"auto"`` when the host runs more
    ranks (``local_world_size``, None: unknown) than the ``ncores`` cores a rank may use;
    ``"none"`` never. Why: :func:`ringcomm.group._bind_to_core`.
    """
    if bind not in BIND_MODES:
        raise ValueError(f"bind must be one of {BIND_MODES}, got {bind!r}")
    if bind == "auto":
        return local_world_size is not None and local_world_size > ncores
    return bind == "core"


def staging_max_bytes(env: Mapping[str, str] | None = None) -> int:
    """``RINGCOMM_STAGING_MAX_BYTES``: most pinned bytes one staging pool keeps (suffixes
    K/M/G, powers of 1024); :data:`DEFAULT_STAGING_MAX_BYTES` (1 GiB) when unset."""
    found = _env_setting(_environ(env), "RINGCOMM_STAGING_MAX_BYTES")
    if found is None:
        return DEFAULT_STAGING_MAX_BYTES
    try:
        return parse_size(str(found.value))
    except ValueError as exc:
        raise ValueError(f"{found.describe()}: {exc}") from None


def _size_setting(env: Mapping[str, str] | None, name: str, default: int, least: int) -> int:
    found = _env_setting(_environ(env), name)
    if found is None:
        return default
    try:
        value = parse_size(str(found.value))
    except ValueError as exc:
        raise ValueError(f"{found.describe()}: {exc}") from None
    if value < least:
        raise ValueError(f"{found.describe()}: must be at least {least} bytes")
    return value


def ipc_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``RINGCOMM_IPC``: whether device arrays on a group of one host use device windows
    (``algo="ipc"``, the default); ``0`` sends them through host staging as across hosts
    (what ``--device host-staged`` measures and trains with)."""
    found = _env_setting(_environ(env), "RINGCOMM_IPC")
    return True if found is None else _parse_bool(found)


def ipc_window_bytes(env: Mapping[str, str] | None = None) -> int:
    """``RINGCOMM_IPC_WINDOW_BYTES``: bytes of each of the two buffers of a rank's device
    window (K/M/G suffixes; at least 256): a round of a large device collective;
    :data:`DEFAULT_IPC_WINDOW_BYTES` (64 MiB) when unset. Tests set it small to force many
    rounds."""
    return _size_setting(env, "RINGCOMM_IPC_WINDOW_BYTES", DEFAULT_IPC_WINDOW_BYTES, 256)


def ipc_small_bytes(env: Mapping[str, str] | None = None) -> int:
    """``RINGCOMM_IPC_SMALL_BYTES``: device collectives up to this many bytes go through
    the host (K/M/G suffixes; 0: never); :data:`DEFAULT_IPC_SMALL_BYTES` when unset."""
    return _size_setting(env, "RINGCOMM_IPC_SMALL_BYTES", DEFAULT_IPC_SMALL_BYTES, 0)


def ps_log_level(env: Mapping[str, str] | None = None) -> str:
    """``RINGCOMM_PS_LOG``: the ``ringcomm ps-server`` log level, one of
    :data:`PS_LOG_LEVELS` (any case, returned upper case); ``"WARNING"`` when unset."""
    found = _env_setting(_environ(env), "RINGCOMM_PS_LOG")
    if found is None:
        return DEFAULT_PS_LOG_LEVEL
    level = str(found.value).upper()
    if level not in PS_LOG_LEVELS:
        raise ValueError(
            f"{found.describe()} is not a log level: use one of {', '.join(PS_LOG_LEVELS)}"
        )
    return level


def mps_active(env: Mapping[str, str] | None = None) -> bool:
    """Whether an NVIDIA MPS control daemon serves this host: its pipe directory
    (``CUDA_MPS_PIPE_DIRECTORY``, else ``/tmp/nvidia-mps``) holds its ``control`` pipe.
    Without MPS, kernels of different processes on one GPU do not run concurrently."""
    pipe_dir = _environ(env).get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return os.path.exists(os.path.join(pipe_dir, "control"))


def security_mode(env: Mapping[str, str] | None = None) -> str:
    """``RINGCOMM_SECURITY`` (:data:`SECURITY_MODES`, any case; default ``handshake``)."""
    text = (_environ(env).get("RINGCOMM_SECURITY") or "handshake").strip().lower()
    if text not in SECURITY_MODES:
        raise ValueError(
            f"RINGCOMM_SECURITY must be one of {', '.join(SECURITY_MODES)}, got {text!r}"
        )
    return text


def env_token(env: Mapping[str, str] | None = None) -> str | None:
    """``RINGCOMM_TOKEN`` as written (a secret: not stripped); None when unset or empty."""
    return _environ(env).get("RINGCOMM_TOKEN") or None


def env_trace_dir(env: Mapping[str, str] | None = None) -> str | None:
    """``RINGCOMM_TRACE_DIR``: where ranks write their flight records; None when unset."""
    return (_environ(env).get("RINGCOMM_TRACE_DIR") or "").strip() or None


def env_master_addr(env: Mapping[str, str] | None = None) -> str:
    """The store address of the environment: ``RINGCOMM_MASTER_ADDR``, else
    ``MASTER_ADDR``, else 127.0.0.1 (no Slurm derivation: see :func:`resolve_init_config`)."""
    found = _lookup(_environ(env), "master_addr")
    return DEFAULT_MASTER_ADDR if found is None else str(found.value)


def resolve_init_config(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_s: float | None = None,
    token: str | None = None,
    host_store: bool | None = None,
    chunk_bytes: int | None = None,
    transport: str | None = None,
    env: Mapping[str, str] | None = None,
) -> InitConfig:
    """Resolve a process's group configuration; see the module docstring for the order.

    ``env`` defaults to ``os.environ``. ``host_store`` overrides RINGCOMM_STORE_EXTERNAL:
    True makes rank 0 host the store, False means an external one serves it.
    ``chunk_bytes`` overrides RINGCOMM_CHUNK_BYTES (a positive int; 0 is an error, not
    "the default"), ``transport`` RINGCOMM_TRANSPORT (:data:`TRANSPORT_MODES`).
    Raises :class:`RendezvousError` for missing or invalid settings (:class:`ValueError`
    for an invalid ``chunk_bytes`` argument).
    """
    env = _environ(env)

    rank_f = _explicit("rank", rank) or _lookup(env, "rank")
    world_f = _explicit("world_size", world_size) or _lookup(env, "world_size")
    local_f = _lookup(env, "local_rank")
    addr_f = _explicit("master_addr", master_addr) or _lookup(env, "master_addr")
    port_f = _explicit("master_port", master_port) or _lookup(env, "master_port")

    # The convention that placed this process: the highest-precedence one among rank/world.
    used = [f.source for f in (rank_f, world_f) if f is not None]
    source = min(used, key=_SOURCE_ORDER.index) if used else "singleton"

    world = 1
    if world_f is not None:
        world = _as_int(world_f)
        if world < 1:
            raise RendezvousError(f"{world_f.describe()} must be >= 1 {_origin(world_f)}")
    rank_value = 0
    if rank_f is not None:
        rank_value = _as_int(rank_f)
        if rank_value < 0:
            raise RendezvousError(f"{rank_f.describe()} must be >= 0 {_origin(rank_f)}")
        if rank_value >= world:
            world_text = (
                world_f.describe() if world_f is not None else "world size 1 (none was set)"
            )
            raise RendezvousError(f"{rank_f.describe()} >= {world_text} {_origin(rank_f, world_f)}")
    elif world > 1:
        assert world_f is not None
        raise RendezvousError(
            f"{world_f.describe()} {_origin(world_f)} but no rank is set: pass rank= or set "
            "RINGCOMM_RANK (or RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID)"
        )

    local_rank = 0
    if local_f is not None:
        local_rank = _as_int(local_f)
        if local_rank < 0:
            raise RendezvousError(f"{local_f.describe()} must be >= 0 {_origin(local_f)}")
    local_world_size = None
    local_ws_f = _lookup(env, "local_world_size")
    if local_ws_f is not None:
        local_world_size = _as_int(local_ws_f)
        if local_world_size < 1:
            raise RendezvousError(f"{local_ws_f.describe()} must be >= 1 {_origin(local_ws_f)}")

    addr = str(addr_f.value) if addr_f is not None else None
    port = _as_int(port_f) if port_f is not None else None
    torch_store = _torch_agent_store(env, addr_f, port_f)
    if torch_store is not None:
        # torchrun's elastic agent serves its own TCPStore on MASTER_PORT (the workers
        # reuse it instead of hosting one), so that port is taken: rank 0 serves ours on a
        # port from the OS and publishes it there (ringcomm.rendezvous.torchstore).
        port = 0
    if port_f is not None and port is not None and not 0 <= port <= 65535:
        raise RendezvousError(f"{port_f.describe()} is not in 0..65535 {_origin(port_f)}")
    _check_launcher_world(env, world_f, world, port_f)
    port_origin: str | None = None
    if source == "slurm" and world > 1 and (addr is None or port is None):
        addr, port, port_origin = _slurm_defaults(env, addr, port)
    spans_hosts = ""
    if source == "mpirun" and world > 1 and port is None:
        port, port_origin, spans_hosts = _mpirun_defaults(env, world)

    if world > 1:
        if addr is None:
            addr = DEFAULT_MASTER_ADDR
        if (port is None or port == 0) and torch_store is None:
            given = f" ({port_f.describe()} means 'pick a free port')" if port_f else ""
            raise RendezvousError(
                f"world_size={world} {_origin(world_f)} but no store port to meet at{given}: "
                "pass master_port= or set RINGCOMM_MASTER_PORT (or MASTER_PORT); "
                f"port 0 only works for a single process{spans_hosts}"
            )
        port = port or 0  # (0 under torchrun's agent store: ringcomm's comes from the OS)
    else:
        addr = addr if addr is not None else DEFAULT_MASTER_ADDR
        port = port if port is not None else 0

    timeout_f = _explicit("timeout_s", timeout_s) or _env_setting(env, "RINGCOMM_TIMEOUT_S")
    timeout = DEFAULT_TIMEOUT_S
    if timeout_f is not None:
        try:
            timeout = float(timeout_f.value)
        except (TypeError, ValueError):
            raise RendezvousError(
                f"{timeout_f.describe()} is not a number of seconds ({timeout_f.label})"
            ) from None
        if not (math.isfinite(timeout) and timeout > 0):
            raise RendezvousError(
                f"{timeout_f.describe()} must be a finite number of seconds > 0 ({timeout_f.label})"
            )

    if chunk_bytes is not None:
        if (
            isinstance(chunk_bytes, bool)
            or not isinstance(chunk_bytes, numbers.Integral)
            or chunk_bytes <= 0
        ):
            raise ValueError(
                f"chunk_bytes={chunk_bytes!r} must be an int > 0 (the piece size of pipelined "
                f"transfers; None: RINGCOMM_CHUNK_BYTES, else {DEFAULT_CHUNK_BYTES >> 20} MiB)"
            )
        chunk_bytes = int(chunk_bytes)
    else:
        chunk_f = _env_setting(env, "RINGCOMM_CHUNK_BYTES")
        if chunk_f is not None:
            try:
                chunk_bytes = parse_size(str(chunk_f.value))
            except ValueError as exc:
                raise RendezvousError(f"{chunk_f.describe()}: {exc}") from None
            if chunk_bytes <= 0:
                raise RendezvousError(f"{chunk_f.describe()} must be > 0")

    # An empty transport= means "not given", as it always has.
    transport_f = _explicit("transport", transport or None) or _env_setting(
        env, "RINGCOMM_TRANSPORT"
    )
    mode = "auto" if transport_f is None else str(transport_f.value)
    if mode not in TRANSPORT_MODES:
        assert transport_f is not None
        name = "RINGCOMM_TRANSPORT"
        if transport_f.source == "explicit":
            name = "transport= (as RINGCOMM_TRANSPORT)"
        raise RendezvousError(f"{name} must be one of {TRANSPORT_MODES}, got {mode!r}")

    try:
        security = security_mode(env)
    except ValueError as exc:
        raise RendezvousError(str(exc)) from None
    if security == "none":
        if token:
            raise RendezvousError(
                "token= was given but RINGCOMM_SECURITY=none (no token): choose one"
            )
        token = None
    elif token is None:
        token = env_token(env)
    caps: list[int | None] = []
    for name in ("RINGCOMM_MAX_UNEXPECTED_MESSAGES", "RINGCOMM_MAX_UNEXPECTED_BYTES"):
        text = (env.get(name) or "").strip()
        if not text:
            caps.append(None)
            continue
        try:
            value = parse_size(text)
        except ValueError as exc:
            raise RendezvousError(f"{name}={text!r}: {exc}") from None
        if value <= 0:
            raise RendezvousError(f"{name} must be > 0, got {text!r}")
        caps.append(value)

    try:
        bind = bind_mode(env)
    except ValueError as exc:
        raise RendezvousError(str(exc)) from None
    lane_f = _env_setting(env, "RINGCOMM_LOCAL_LANE")
    local_lane = _parse_bool(lane_f) if lane_f is not None else True
    shm_f = _env_setting(env, "RINGCOMM_SHM")
    shm = _parse_bool(shm_f) if shm_f is not None else True
    workspace_f = _env_setting(env, "RINGCOMM_WORKSPACE")
    workspace = _parse_bool(workspace_f) if workspace_f is not None else True

    entries_text = (env.get("RINGCOMM_TRACE_ENTRIES") or "").strip()
    try:
        trace_entries = parse_size(entries_text) if entries_text else 4096
    except ValueError as exc:
        raise RendezvousError(f"RINGCOMM_TRACE_ENTRIES={entries_text!r}: {exc}") from None
    restart_text = (env.get("RINGCOMM_RESTART") or "").strip()
    if restart_text and not restart_text.isdigit():
        raise RendezvousError(f"RINGCOMM_RESTART must be a count >= 0, got {restart_text!r}")
    tune_file, tune_file_required = _tune_file(env)
    trace_f = _env_setting(env, "RINGCOMM_TRACE")
    trace_at_close = _parse_bool(trace_f) if trace_f is not None else False

    if host_store is not None:
        store_external = not host_store
    else:
        external_f = _env_setting(env, "RINGCOMM_STORE_EXTERNAL")
        store_external = _parse_bool(external_f) if external_f is not None else False

    return InitConfig(
        rank=rank_value,
        world_size=world,
        local_rank=local_rank,
        master_addr=addr,
        master_port=port,
        timeout_s=timeout,
        token=token,
        chunk_bytes=chunk_bytes,
        algo=(env.get("RINGCOMM_ALGO") or "").strip() or None,
        host_id=(env.get("RINGCOMM_HOST_ID") or "").strip() or None,
        log=_log_level(env),
        store_external=store_external,
        source=source,
        security=security,
        max_unexpected_messages=caps[0],
        max_unexpected_bytes=caps[1],
        local_lane=local_lane,
        shm=shm,
        workspace=workspace,
        bind=bind,
        local_world_size=local_world_size,
        transport=mode,
        trace_entries=trace_entries,
        trace_dir=(env.get("RINGCOMM_TRACE_DIR") or "").strip() or None,
        trace_at_close=trace_at_close,
        restart=int(restart_text or 0),
        tune_file=tune_file,
        tune_file_required=tune_file_required,
        master_port_origin=port_origin,
        torch_store=torch_store,
    )


def _torch_agent_store(
    env: Mapping[str, str], addr_f: _Found | None, port_f: _Found | None
) -> TorchAgentStore | None:
    """torchrun's agent store, when the workers use it (``TORCHELASTIC_USE_AGENT_STORE``)
    and MASTER_PORT names it; None otherwise."""
    if port_f is None or port_f.source != "torchrun":
        return None
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower()
    if agent not in ("true", "1"):
        return None
    port = _as_int(port_f)
    if not 0 < port <= 65535:
        raise RendezvousError(f"{port_f.describe()} is not in 1..65535 {_origin(port_f)}")
    host = str(addr_f.value) if addr_f is not None else DEFAULT_MASTER_ADDR
    run_id = (env.get("TORCHELASTIC_RUN_ID") or "none").strip()
    attempt = (env.get("TORCHELASTIC_RESTART_COUNT") or "0").strip()
    return TorchAgentStore(host, port, f"ringcomm/{run_id}/attempt_{attempt}")


def _check_launcher_world(
    env: Mapping[str, str], world_f: _Found | None, world: int, port_f: _Found | None
) -> None:
    """A world size passed by hand that disagrees with the launcher's, while the ranks
    meet at the launcher's store address: every rank would wait for ranks that were never
    started (or ignore some that were). Raises naming both values. A store address passed
    by hand, or a world of one, is the caller's own business."""
    if world_f is None or world_f.source != "explicit" or world == 1:
        return
    if port_f is not None and port_f.source == "explicit":
        return
    launched_f = _lookup(env, "world_size")
    if launched_f is None:
        return
    launched = _as_int(launched_f)
    if launched != world:
        raise RendezvousError(
            f"world_size={world} (explicit argument) disagrees with the launcher: "
            f"{launched_f.describe()} {_origin(launched_f)} started {launched} rank(s); pass "
            "the same world size (or none), or a store address of your own (master_port=)"
        )


def _log_level(env: Mapping[str, str]) -> str | None:
    """``RINGCOMM_LOG``: one of :data:`LOG_LEVELS` (any case, returned lower case), None
    when unset or ``off``."""
    text = (env.get("RINGCOMM_LOG") or "").strip()
    if not text:
        return None
    level = text.lower()
    if level not in LOG_LEVELS:
        raise RendezvousError(
            f"RINGCOMM_LOG={text!r} is not a level: use one of {', '.join(LOG_LEVELS)} "
            "(info: a summary of the group at init; debug: also every op's start and end)"
        )
    return None if level == "off" else level


def _tune_file(env: Mapping[str, str]) -> tuple[str | None, bool]:
    """``RINGCOMM_TUNE_FILE``: (the path, whether it was named); unset or empty:
    (:data:`DEFAULT_TUNE_FILE`, False); one of :data:`TUNE_FILE_OFF`: (None, False)."""
    text = (env.get("RINGCOMM_TUNE_FILE") or "").strip()
    if not text:
        return DEFAULT_TUNE_FILE, False
    if text.lower() in TUNE_FILE_OFF:
        return None, False
    return text, True


def _mpirun_defaults(env: Mapping[str, str], world: int) -> tuple[int | None, str | None, str]:
    """A port for an mpirun job whose ranks all run on this host: ``(port, origin, "")``;
    else ``(None, None, why)``, ``why`` completing the "no store port" error."""
    local = (env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or "").strip()
    if local != str(world):
        why = (
            f"The ranks span hosts (OMPI_COMM_WORLD_LOCAL_SIZE={local}, "
            f"OMPI_COMM_WORLD_SIZE={world})"
            if local
            else "Without OMPI_COMM_WORLD_LOCAL_SIZE the ranks may span hosts"
        )
        return (
            None,
            None,
            (
                f". {why}: export rank 0's host and a free port to every rank, "
                "mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port>"
            ),
        )
    job = mpirun_job_id(env)
    if job is None:
        names = ", ".join(MPIRUN_JOB_ID_VARS)
        return None, None, f" (mpirun set none of {names} to derive one from)"
    name, value = job
    return mpirun_master_port(value), f"derived from Open MPI's job id ({name}={value})", ""


def _slurm_defaults(
    env: Mapping[str, str], addr: str | None, port: int | None
) -> tuple[str | None, int | None, str | None]:
    """Fill a missing address/port from the Slurm job: first node, port from the job id."""
    if addr is None:
        nodelist = (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "").strip()
        if nodelist:
            try:
                hosts = parse_slurm_nodelist(nodelist)
            except ValueError as exc:
                raise RendezvousError(f"SLURM_JOB_NODELIST: {exc}") from None
            addr = hosts[0] if hosts else None
    origin = None
    if port is None:
        job_id = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
        if job_id:
            if not job_id.isdigit():
                raise RendezvousError(f"SLURM_JOB_ID={job_id!r} is not an integer")
            port = slurm_master_port(int(job_id))
            origin = f"derived from the Slurm job id (SLURM_JOB_ID={job_id})"
    return addr, port, origin


@contextmanager
def environ_changed(changes: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``changes`` (None: the variable unset) for the block, then as it
    was (what a command sets for the ranks it starts: they inherit the environment)."""
    saved = {k: os.environ.get(k) for k in changes}
    for k, v in changes.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old
