"""Process-group configuration: explicit arguments and environment variables -> ``InitConfig``.

Pure: reads only the mapping it is given (``os.environ`` by default, through
:func:`environment`, the one place ringcomm reaches the process's environment), opens no
sockets. Each setting is resolved on its own, the first source that has it wins: the
explicit argument of :func:`resolve_init_config`, then ``RINGCOMM_*``, torchrun, mpirun,
PMI and Slurm variables (:mod:`ringcomm._conventions`); nothing set: a singleton, rank 0
of 1. Every invalid value raises :class:`RendezvousError` naming the variable, its value
and the convention it came from. The order, the derived store ports and every tunable:
docs/architecture.md, "Resolving a group's configuration".

Settings that belong to no group (:func:`bind_mode`, :func:`staging_max_bytes`,
:func:`security_mode`, ...) are small functions of the same mapping, each raising
:class:`ValueError` naming the variable. No other module reads a variable: they ask here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import numbers
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ringcomm._conventions import (
    DEFAULT_MASTER_ADDR,
    MPIRUN_JOB_ID_VARS,
    SOURCE_ORDER,
    Found,
    as_int,
    env_setting,
    explicit,
    lookup,
    mpirun_defaults,
    mpirun_job_id,
    mpirun_master_port,
    origin,
    parse_bool,
    parse_slurm_nodelist,
    slurm_defaults,
    slurm_master_port,
)
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
    "bench_mpi_interfaces",
    "bind_mode",
    "binds_to_core",
    "check_output_path",
    "default_of",
    "env_chunk_bytes",
    "env_master_addr",
    "env_token",
    "env_trace_dir",
    "environ_changed",
    "environment",
    "format_size",
    "ipc_enabled",
    "ipc_small_bytes",
    "ipc_window_bytes",
    "mpirun_job_id",
    "mpirun_master_port",
    "mps_active",
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
#: The largest piece size the cost model may choose (collectives/chooser.py's candidates).
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


def environment() -> MutableMapping[str, str]:
    """The process's environment. The one place ringcomm reaches it: other modules ask
    here (a launcher copies it for the ranks it starts, a setting is parsed below)."""
    return os.environ


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return environment() if env is None else env


def bind_mode(env: Mapping[str, str] | None = None) -> str:
    """``RINGCOMM_BIND``: one of :data:`BIND_MODES` (any case); ``"auto"`` when unset."""
    found = env_setting(_environ(env), "RINGCOMM_BIND")
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
    ``"none"`` never. Why: :func:`ringcomm.core.forming.bind_to_core`.
    """
    if bind not in BIND_MODES:
        raise ValueError(f"bind must be one of {BIND_MODES}, got {bind!r}")
    if bind == "auto":
        return local_world_size is not None and local_world_size > ncores
    return bind == "core"


def staging_max_bytes(env: Mapping[str, str] | None = None) -> int:
    """``RINGCOMM_STAGING_MAX_BYTES``: most pinned bytes one staging pool keeps (suffixes
    K/M/G, powers of 1024); :data:`DEFAULT_STAGING_MAX_BYTES` (1 GiB) when unset."""
    return _size_setting(env, "RINGCOMM_STAGING_MAX_BYTES", DEFAULT_STAGING_MAX_BYTES, 0)


def _size_setting(env: Mapping[str, str] | None, name: str, default: int, least: int) -> int:
    found = env_setting(_environ(env), name)
    if found is None:
        return default
    value = _found_size(found, ValueError)
    if value < least:
        raise ValueError(f"{found.describe()}: must be at least {least} bytes")
    return value


def _found_size(found: Found, error: type[Exception]) -> int:
    """A size setting (:func:`parse_size`); a bad one raises ``error`` naming the variable."""
    try:
        return parse_size(str(found.value))
    except ValueError as exc:
        raise error(f"{found.describe()}: {exc}") from None


def _text(env: Mapping[str, str], name: str) -> str:
    """Variable ``name`` without surrounding blanks; empty when unset."""
    return (env.get(name) or "").strip()


def _text_size(name: str, text: str) -> int:
    """The size ``text`` of variable ``name`` (:func:`parse_size`); a bad one raises
    :class:`RendezvousError` naming both."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise RendezvousError(f"{name}={text!r}: {exc}") from None


def ipc_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``RINGCOMM_IPC``: whether device arrays on a group of one host use device windows
    (``algo="ipc"``, the default); ``0`` sends them through host staging as across hosts
    (what ``--device host-staged`` measures and trains with)."""
    found = env_setting(_environ(env), "RINGCOMM_IPC")
    return True if found is None else parse_bool(found)


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
    found = env_setting(_environ(env), "RINGCOMM_PS_LOG")
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
    """``RINGCOMM_SECURITY`` (:data:`SECURITY_MODES`, any case; default ``handshake`` when
    unset or blank, as every text setting)."""
    text = (_text(_environ(env), "RINGCOMM_SECURITY") or "handshake").lower()
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
    return _text(_environ(env), "RINGCOMM_TRACE_DIR") or None


def env_master_addr(env: Mapping[str, str] | None = None) -> str:
    """The store address of the environment: ``RINGCOMM_MASTER_ADDR``, else
    ``MASTER_ADDR``, else 127.0.0.1 (no Slurm derivation: see :func:`resolve_init_config`)."""
    found = lookup(_environ(env), "master_addr")
    return DEFAULT_MASTER_ADDR if found is None else str(found.value)


def env_chunk_bytes(env: Mapping[str, str] | None = None) -> int:
    """``RINGCOMM_CHUNK_BYTES`` as a group reads it (K/M/G suffixes, > 0), for ``ringcomm
    tune``: :data:`DEFAULT_CHUNK_BYTES` when unset or blank; a bad size raises ValueError
    naming the variable, in the group's words."""
    found = env_setting(_environ(env), "RINGCOMM_CHUNK_BYTES")
    if found is None:
        return DEFAULT_CHUNK_BYTES
    return _chunk_size(found, ValueError)


def bench_mpi_interfaces(env: Mapping[str, str] | None = None) -> str | None:
    """``RINGCOMM_BENCH_MPI_IF``: the interfaces (names or CIDRs) ``ringcomm bench
    --compare mpi`` across hosts gives mpirun's TCP transports; None when unset."""
    return _environ(env).get("RINGCOMM_BENCH_MPI_IF")


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
    """Resolve a process's group configuration (the order: docs/architecture.md,
    "Resolving a group's configuration").

    ``env`` defaults to ``os.environ``. ``host_store`` overrides RINGCOMM_STORE_EXTERNAL:
    True makes rank 0 host the store, False means an external one serves it.
    ``chunk_bytes`` overrides RINGCOMM_CHUNK_BYTES (a positive int; 0 is an error, not
    "the default"), ``transport`` RINGCOMM_TRANSPORT (:data:`TRANSPORT_MODES`).
    Raises :class:`RendezvousError` for missing or invalid settings (:class:`ValueError`
    for an invalid ``chunk_bytes`` argument).
    """
    env = _environ(env)
    # Resolved in this order, so that of several bad settings the same one is reported.
    place = _resolve_placement(env, rank, world_size)
    store = _resolve_store(env, place, master_addr, master_port)
    timeout = _resolve_timeout(env, timeout_s)
    chunk = _resolve_chunk_bytes(env, chunk_bytes)
    mode = _resolve_transport(env, transport)
    security, token = _resolve_security(env, token)
    max_messages, max_bytes = _unexpected_caps(env)
    try:
        bind = bind_mode(env)
    except ValueError as exc:
        raise RendezvousError(str(exc)) from None
    local_lane = _flag(env, "RINGCOMM_LOCAL_LANE", True)
    shm = _flag(env, "RINGCOMM_SHM", True)
    workspace = _flag(env, "RINGCOMM_WORKSPACE", True)
    trace_entries = _trace_entries(env)
    restart = _restart_count(env)
    tune_file, tune_file_required = _tune_file(env)
    trace_at_close = _flag(env, "RINGCOMM_TRACE", False)
    if host_store is not None:
        store_external = not host_store
    else:
        store_external = _flag(env, "RINGCOMM_STORE_EXTERNAL", False)

    return InitConfig(
        rank=place.rank,
        world_size=place.world,
        local_rank=place.local_rank,
        master_addr=store.addr,
        master_port=store.port,
        timeout_s=timeout,
        token=token,
        chunk_bytes=chunk,
        algo=_text(env, "RINGCOMM_ALGO") or None,
        host_id=_text(env, "RINGCOMM_HOST_ID") or None,
        log=_log_level(env),
        store_external=store_external,
        source=place.source,
        security=security,
        max_unexpected_messages=max_messages,
        max_unexpected_bytes=max_bytes,
        local_lane=local_lane,
        shm=shm,
        workspace=workspace,
        bind=bind,
        local_world_size=place.local_world_size,
        transport=mode,
        trace_entries=trace_entries,
        trace_dir=env_trace_dir(env),
        trace_at_close=trace_at_close,
        restart=restart,
        tune_file=tune_file,
        tune_file_required=tune_file_required,
        master_port_origin=store.port_origin,
        torch_store=store.torch_store,
    )


@dataclass(frozen=True)
class _Placement:
    """Where this process sits in the job, and the settings that said so."""

    rank: int
    world: int
    local_rank: int
    local_world_size: int | None
    source: str  # the convention that placed it: InitConfig.source
    world_f: Found | None


@dataclass(frozen=True)
class _Store:
    """Where the ranks meet: the store's address and port, and where the port came from."""

    addr: str
    port: int
    port_origin: str | None
    torch_store: TorchAgentStore | None


def _at_least(found: Found, least: int) -> int:
    """The setting as an int, refused naming its variable when below ``least``."""
    value = as_int(found)
    if value < least:
        raise RendezvousError(f"{found.describe()} must be >= {least} {origin(found)}")
    return value


def _resolve_placement(
    env: Mapping[str, str], rank: int | None, world_size: int | None
) -> _Placement:
    """Rank, world size and the host's share: explicit arguments, else the first launcher
    convention that sets each; none: rank 0 of 1 (a singleton)."""
    rank_f = explicit("rank", rank) or lookup(env, "rank")
    world_f = explicit("world_size", world_size) or lookup(env, "world_size")
    # The convention that placed this process: the highest-precedence one among rank/world.
    used = [f.source for f in (rank_f, world_f) if f is not None]
    source = min(used, key=SOURCE_ORDER.index) if used else "singleton"

    world = 1 if world_f is None else _at_least(world_f, 1)
    rank_value = 0
    if rank_f is not None:
        rank_value = _at_least(rank_f, 0)
        if rank_value >= world:
            world_text = (
                world_f.describe() if world_f is not None else "world size 1 (none was set)"
            )
            raise RendezvousError(f"{rank_f.describe()} >= {world_text} {origin(rank_f, world_f)}")
    elif world > 1:
        assert world_f is not None
        raise RendezvousError(
            f"{world_f.describe()} {origin(world_f)} but no rank is set: pass rank= or set "
            "RINGCOMM_RANK (or RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID)"
        )

    local_f = lookup(env, "local_rank")
    local_rank = 0 if local_f is None else _at_least(local_f, 0)
    local_ws_f = lookup(env, "local_world_size")
    local_world_size = None if local_ws_f is None else _at_least(local_ws_f, 1)
    return _Placement(rank_value, world, local_rank, local_world_size, source, world_f)


def _resolve_store(
    env: Mapping[str, str],
    place: _Placement,
    master_addr: str | None,
    master_port: int | None,
) -> _Store:
    """The store's address and port: explicit, else a convention's variables, else derived
    from the Slurm or Open MPI job; a group of more than one process must have a port."""
    addr_f = explicit("master_addr", master_addr) or lookup(env, "master_addr")
    port_f = explicit("master_port", master_port) or lookup(env, "master_port")
    world, world_f = place.world, place.world_f
    addr = str(addr_f.value) if addr_f is not None else None
    port = as_int(port_f) if port_f is not None else None
    torch_store = _torch_agent_store(env, addr_f, port_f)
    if torch_store is not None:
        # torchrun's elastic agent serves its own TCPStore on MASTER_PORT (the workers
        # reuse it instead of hosting one), so that port is taken: rank 0 serves ours on a
        # port from the OS and publishes it there (ringcomm.rendezvous.torchstore).
        port = 0
    if port_f is not None and port is not None and not 0 <= port <= 65535:
        raise RendezvousError(f"{port_f.describe()} is not in 0..65535 {origin(port_f)}")
    _check_launcher_world(env, world_f, world, port_f)
    port_origin: str | None = None
    if place.source == "slurm" and world > 1 and (addr is None or port is None):
        addr, port, port_origin = slurm_defaults(env, addr, port)
    spans_hosts = ""
    if place.source == "mpirun" and world > 1 and port is None:
        port, port_origin, spans_hosts = mpirun_defaults(env, world)

    if world == 1:
        return _Store(
            addr if addr is not None else DEFAULT_MASTER_ADDR,
            port if port is not None else 0,
            port_origin,
            torch_store,
        )
    if (port is None or port == 0) and torch_store is None:
        given = f" ({port_f.describe()} means 'pick a free port')" if port_f else ""
        raise RendezvousError(
            f"world_size={world} {origin(world_f)} but no store port to meet at{given}: "
            "pass master_port= or set RINGCOMM_MASTER_PORT (or MASTER_PORT); "
            f"port 0 only works for a single process{spans_hosts}"
        )
    # (port 0 under torchrun's agent store: ringcomm's comes from the OS)
    addr = addr if addr is not None else DEFAULT_MASTER_ADDR
    return _Store(addr, port or 0, port_origin, torch_store)


def _resolve_timeout(env: Mapping[str, str], timeout_s: float | None) -> float:
    """``timeout_s=``, else ``RINGCOMM_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`."""
    timeout_f = explicit("timeout_s", timeout_s) or env_setting(env, "RINGCOMM_TIMEOUT_S")
    if timeout_f is None:
        return DEFAULT_TIMEOUT_S
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
    return timeout


def _resolve_chunk_bytes(env: Mapping[str, str], chunk_bytes: int | None) -> int | None:
    """``chunk_bytes=`` (ValueError unless an int > 0), else ``RINGCOMM_CHUNK_BYTES``, else
    None (the default)."""
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
        return int(chunk_bytes)
    chunk_f = env_setting(env, "RINGCOMM_CHUNK_BYTES")
    return None if chunk_f is None else _chunk_size(chunk_f, RendezvousError)


def _chunk_size(found: Found, error: type[Exception]) -> int:
    """``RINGCOMM_CHUNK_BYTES``'s size (> 0); a bad one raises ``error`` naming it."""
    value = _found_size(found, error)
    if value <= 0:
        raise error(f"{found.describe()} must be > 0")
    return value


def _resolve_transport(env: Mapping[str, str], transport: str | None) -> str:
    """``transport=`` (empty: not given, as it always was), else ``RINGCOMM_TRANSPORT``,
    else ``"auto"``; one of :data:`TRANSPORT_MODES`."""
    transport_f = explicit("transport", transport or None) or env_setting(env, "RINGCOMM_TRANSPORT")
    mode = "auto" if transport_f is None else str(transport_f.value)
    if mode not in TRANSPORT_MODES:
        assert transport_f is not None
        name = "RINGCOMM_TRANSPORT"
        if transport_f.source == "explicit":
            name = "transport= (as RINGCOMM_TRANSPORT)"
        raise RendezvousError(f"{name} must be one of {TRANSPORT_MODES}, got {mode!r}")
    return mode


def _resolve_security(env: Mapping[str, str], token: str | None) -> tuple[str, str | None]:
    """``(RINGCOMM_SECURITY, the token)``: ``token=``, else ``RINGCOMM_TOKEN``; none at
    all under ``RINGCOMM_SECURITY=none`` (a token given with it is an error)."""
    try:
        security = security_mode(env)
    except ValueError as exc:
        raise RendezvousError(str(exc)) from None
    if security == "none":
        if token:
            raise RendezvousError(
                "token= was given but RINGCOMM_SECURITY=none (no token): choose one"
            )
        return security, None
    return security, (env_token(env) if token is None else token)


def _unexpected_caps(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """``RINGCOMM_MAX_UNEXPECTED_MESSAGES`` and ``_BYTES`` (> 0, K/M/G); None: unset."""
    caps: list[int | None] = []
    for name in ("RINGCOMM_MAX_UNEXPECTED_MESSAGES", "RINGCOMM_MAX_UNEXPECTED_BYTES"):
        text = _text(env, name)
        if not text:
            caps.append(None)
            continue
        value = _text_size(name, text)
        if value <= 0:
            raise RendezvousError(f"{name} must be > 0, got {text!r}")
        caps.append(value)
    return caps[0], caps[1]


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """Boolean variable ``name`` (1/0, true/false, yes/no, on/off); ``default`` when unset."""
    found = env_setting(env, name)
    return default if found is None else parse_bool(found)


def _trace_entries(env: Mapping[str, str]) -> int:
    """``RINGCOMM_TRACE_ENTRIES``: operations the flight recorder keeps (4096 when unset)."""
    text = _text(env, "RINGCOMM_TRACE_ENTRIES")
    return _text_size("RINGCOMM_TRACE_ENTRIES", text) if text else 4096


def _restart_count(env: Mapping[str, str]) -> int:
    """``RINGCOMM_RESTART``: how many times the launcher restarted this rank (0 when unset)."""
    text = _text(env, "RINGCOMM_RESTART")
    if text and not text.isdigit():
        raise RendezvousError(f"RINGCOMM_RESTART must be a count >= 0, got {text!r}")
    return int(text or 0)


def _torch_agent_store(
    env: Mapping[str, str], addr_f: Found | None, port_f: Found | None
) -> TorchAgentStore | None:
    """torchrun's agent store, when the workers use it (``TORCHELASTIC_USE_AGENT_STORE``)
    and MASTER_PORT names it; None otherwise."""
    if port_f is None or port_f.source != "torchrun":
        return None
    agent = _text(env, "TORCHELASTIC_USE_AGENT_STORE").lower()
    if agent not in ("true", "1"):
        return None
    port = as_int(port_f)
    if not 0 < port <= 65535:
        raise RendezvousError(f"{port_f.describe()} is not in 1..65535 {origin(port_f)}")
    host = str(addr_f.value) if addr_f is not None else DEFAULT_MASTER_ADDR
    run_id = (env.get("TORCHELASTIC_RUN_ID") or "none").strip()
    attempt = (env.get("TORCHELASTIC_RESTART_COUNT") or "0").strip()
    return TorchAgentStore(host, port, f"ringcomm/{run_id}/attempt_{attempt}")


def _check_launcher_world(
    env: Mapping[str, str], world_f: Found | None, world: int, port_f: Found | None
) -> None:
    """A world size passed by hand that disagrees with the launcher's, while the ranks
    meet at the launcher's store address: every rank would wait for ranks that were never
    started (or ignore some that were). Raises naming both values. A store address passed
    by hand, or a world of one, is the caller's own business."""
    if world_f is None or world_f.source != "explicit" or world == 1:
        return
    if port_f is not None and port_f.source == "explicit":
        return
    launched_f = lookup(env, "world_size")
    if launched_f is None:
        return
    launched = as_int(launched_f)
    if launched != world:
        raise RendezvousError(
            f"world_size={world} (explicit argument) disagrees with the launcher: "
            f"{launched_f.describe()} {origin(launched_f)} started {launched} rank(s); pass "
            "the same world size (or none), or a store address of your own (master_port=)"
        )


def _log_level(env: Mapping[str, str]) -> str | None:
    """``RINGCOMM_LOG``: one of :data:`LOG_LEVELS` (any case, returned lower case), None
    when unset or ``off``."""
    text = _text(env, "RINGCOMM_LOG")
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
    text = _text(env, "RINGCOMM_TUNE_FILE")
    if not text:
        return DEFAULT_TUNE_FILE, False
    if text.lower() in TUNE_FILE_OFF:
        return None, False
    return text, True


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
