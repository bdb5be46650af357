"""ProcessGroup: ranks, tags, deadlines, point-to-point, sub-groups; init_process_group.

Forming a group (``init_process_group``):
  1. Resolve rank, world size and master address from arguments and the environment
     (:mod:`ringcomm.config`).
  2. Rank 0 hosts the rendezvous store at master_addr:master_port (unless a launcher
     already does); every rank connects to it.
  3. Every rank binds its receive socket (ipc:// and tcp://), publishes its endpoints under
     ``rank/<r>``, waits for everyone's, and picks ipc:// for peers on its host.
  4. Send sockets connect lazily, on the first message to each peer.

Tag spaces: a message is matched on (source, group id, kind, tag), so point-to-point tags,
collectives (tagged by their sequence number) and sub-groups never collide.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import lifecycle
from ._version import __version__
from .buffers import check_array, check_peer, check_tag
from .collectives import api as _collectives
from .config import DEFAULT_CHUNK_BYTES, InitConfig, binds_to_core, resolve_init_config
from .device.p2p import recv_op_class, send_op_class
from .errors import GroupClosedError, RendezvousError, RingcommError
from .group_core import (
    CHECKOUT_MAX_S,
    WORLD_GROUP_ID,
    GroupCore,
    ProcessState,
    setup_workspace,
    workspace_possible,
)
from .p2p import RecvOp, SendOp
from .progress import (
    DEPART_CLOSE,
    DEPART_ERROR,
    MAX_UNEXPECTED_BYTES,
    MAX_UNEXPECTED_MESSAGES,
    Progress,
)
from .rendezvous import Store, StoreServer
from .transport.endpoints import (
    EndpointInfo,
    choose_endpoint,
    host_identity,
    local_address_towards,
)
from .transport.workspace import AVAILABLE as WORKSPACE_AVAILABLE
from .transport.zmq_transport import ZmqTransport
from .work import Work

__all__ = ["DEFAULT_CHUNK_BYTES", "ProcessGroup", "init_process_group"]


class ProcessGroup:
    """A set of ranks that communicate. Use as a context manager; ``close()`` is idempotent.

    Ranks given to and returned by methods are ranks *of this group* (0..world_size-1).
    The facade over a :class:`~ringcomm.group_core.GroupCore` (``core``), which is what
    the collectives and point-to-point operations use.
    """

    def __init__(self, core: GroupCore) -> None:
        self.core = core

    # -- identity ----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.core.rank

    @property
    def world_size(self) -> int:
        return self.core.world_size

    @property
    def group_id(self) -> int:
        return self.core.group_id

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of this group's members, in group-rank order."""
        return self.core.ranks

    @property
    def config(self) -> InitConfig:
        return self.core.config

    # Tunables of this group's calls (tests force tiny pieces with chunk_bytes).
    @property
    def timeout_s(self) -> float:
        """Default deadline of this group's calls (``timeout_s=None``)."""
        return self.core.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.core.timeout_s = value

    @property
    def chunk_bytes(self) -> int:
        """Piece size of this group's pipelined transfers."""
        return self.core.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self.core.chunk_bytes = value

    def __repr__(self) -> str:
        core = self.core
        return (
            f"<ProcessGroup rank {core.rank}/{core.world_size} group {core.group_id}"
            f"{' closed' if core.closed else ''}>"
        )

    def next_collective_seq(self) -> int:
        """Sequence number tagging the next collective (all ranks call them in one order)."""
        return self.core.next_collective_seq()

    def global_rank(self, group_rank: int) -> int:
        return self.core.ranks[group_rank]

    # -- point-to-point ----------------------------------------------------------------
    def _send_op(self, x: Any, dst: Any, tag: Any, async_op: bool) -> SendOp:
        core = self.core
        what = f"rank {core.rank}: send"
        x = check_array(x, what, device=True)
        dst = check_peer(dst, core.world_size, what, "dst")
        tag = check_tag(tag, what)
        core.check_usable("send")
        return send_op_class(x)(
            core.progress,
            x,
            src_global=core.global_rank,
            dst_global=core.ranks[dst],
            dst=dst,
            group_id=core.group_id,
            tag=tag,
            chunk_bytes=core.chunk_bytes,
            rank=core.rank,
            async_op=async_op,
        )

    def _recv_op(self, x: Any, src: Any, tag: Any, async_op: bool) -> RecvOp:
        core = self.core
        what = f"rank {core.rank}: recv"
        x = check_array(x, what, writeable=True, device=True)
        src = check_peer(src, core.world_size, what, "src")
        tag = check_tag(tag, what)
        core.check_usable("recv")
        return recv_op_class(x)(
            core.progress,
            x,
            src_global=core.ranks[src],
            src=src,
            group_id=core.group_id,
            tag=tag,
            rank=core.rank,
            async_op=async_op,
        )

    def send(
        self, x: np.ndarray, dst: int, tag: int = 0, *, timeout_s: float | None = None
    ) -> None:
        """Send ``x`` to ``dst``; returns once ``x`` may be modified again."""
        self.core.run(self._send_op(x, dst, tag, False), timeout_s, False)

    def recv(
        self, x: np.ndarray, src: int, tag: int = 0, *, timeout_s: float | None = None
    ) -> np.ndarray:
        """Receive the next message from ``src`` with ``tag`` into ``x`` (in place)."""
        return self.core.run(self._recv_op(x, src, tag, False), timeout_s, False)  # type: ignore[no-any-return]

    def isend(self, x: np.ndarray, dst: int, tag: int = 0) -> Work:
        """Start a send; do not modify ``x`` until the returned Work is done."""
        return self.core.run(self._send_op(x, dst, tag, True), None, True)  # type: ignore[no-any-return]

    def irecv(self, x: np.ndarray, src: int, tag: int = 0) -> Work:
        """Start a receive into ``x``; ``Work.wait()`` returns ``x``."""
        return self.core.run(self._recv_op(x, src, tag, True), None, True)  # type: ignore[no-any-return]

    # -- collectives -------------------------------------------------------------------
    # Thin delegates to ringcomm.collectives.api (argument checks, algorithm choice and the
    # algorithms live there). DESIGN.md §1; every call also takes timeout_s=.
    def all_reduce(
        self,
        x: Any,
        op: Any = "sum",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any:
        """Reduce ``x`` over the group in place; return ``x`` (a Work if ``async_op``)."""
        return _collectives.all_reduce(self.core, x, op, async_op, timeout_s=timeout_s, algo=algo)

    def reduce_scatter(
        self,
        x: Any,
        out: Any = None,
        op: Any = "sum",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """This rank's row of the reduction of ``x`` (``x.shape[0] == world_size``)."""
        return _collectives.reduce_scatter(self.core, x, out, op, async_op, timeout_s=timeout_s)

    def all_gather(
        self, x: Any, out: Any = None, async_op: bool = False, *, timeout_s: float | None = None
    ) -> Any:
        """Every rank's ``x`` as ``(world_size, *x.shape)`` in rank order."""
        return _collectives.all_gather(self.core, x, out, async_op, timeout_s=timeout_s)

    def broadcast(
        self,
        x: Any,
        src: int = 0,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any:
        """``src``'s ``x`` into every rank's ``x`` (in place)."""
        return _collectives.broadcast(self.core, x, src, async_op, timeout_s=timeout_s, algo=algo)

    def reduce(
        self,
        x: Any,
        dst: int = 0,
        op: Any = "sum",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """Reduction of ``x`` over the group, in place on ``dst``."""
        return _collectives.reduce(self.core, x, dst, op, async_op, timeout_s=timeout_s)

    def gather(
        self,
        x: Any,
        dst: int = 0,
        out: Any = None,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """``(world_size, *x.shape)`` on ``dst``, None elsewhere."""
        return _collectives.gather(self.core, x, dst, out, async_op, timeout_s=timeout_s)

    def scatter(
        self,
        x: Any,
        src: int = 0,
        out: Any = None,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """Row ``x[rank]`` of ``src``'s ``x`` on every rank (``x`` may be None off ``src``)."""
        return _collectives.scatter(self.core, x, src, out, async_op, timeout_s=timeout_s)

    def all_to_all(
        self, x: Any, out: Any = None, async_op: bool = False, *, timeout_s: float | None = None
    ) -> Any:
        """``out[j]`` is rank ``j``'s ``x[rank]``."""
        return _collectives.all_to_all(self.core, x, out, async_op, timeout_s=timeout_s)

    def barrier(self, async_op: bool = False, *, timeout_s: float | None = None) -> Any:
        """Return once every rank of the group has entered the barrier."""
        return _collectives.barrier(self.core, async_op, timeout_s=timeout_s)

    def alloc(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A zeroed array that collectives use in place (a *symmetric buffer*, as NCCL's
        ``ncclMemAlloc`` + window registration or torch's symmetric memory): on a group
        whose ranks share one host it lives in memory every rank maps, so an all_reduce
        of it (or of a slice of it) copies nothing in or out. Every rank calls it, in the
        same order, with the same shape and dtype (it is collective). Across hosts, a
        plain ``np.zeros``. Valid until the group is closed."""
        return _collectives.alloc(self.core, shape, dtype)

    # -- end of collectives --------------------------------------------------------------

    # -- sub-groups --------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> ProcessGroup | None:
        """A sub-group of this group's ``ranks`` with its own tag space.

        Every rank of this group must call ``new_group`` with the same ranks, in the same
        order relative to its other ``new_group`` calls (as in torch.distributed);
        members get the sub-group, others get None.
        """
        core = self.core
        core.check_usable("new_group")
        what = f"rank {core.rank}: new_group"
        members = [check_peer(r, core.world_size, what, "rank") for r in ranks]
        if len(set(members)) != len(members) or not members:
            raise ValueError(f"{what}: ranks must be distinct and non-empty, got {list(ranks)}")
        index = core.next_subgroup_index()
        digest = hashlib.blake2b(
            repr((core.group_id, index, tuple(members))).encode(), digest_size=8
        ).digest()
        gid = int.from_bytes(digest, "little") >> 1 or 1  # 63-bit, never the world's 0
        if core.rank not in members:
            return None
        sub = core.sub([core.ranks[r] for r in members], gid)
        sub.workspace_pending = workspace_possible(sub)  # set up at its first collective
        return ProcessGroup(sub)

    # -- introspection -----------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters of this process's transport (shared by all its groups)."""
        e = self.core.progress
        t = e.transport
        e.check_health()  # reads pending connection events (auth failures, drops)
        return {
            "sent_bytes": t.sent_bytes,
            "sent_messages": t.sent_messages,
            "dropped_frames": e.dropped_frames,
            "unexpected_messages": e.unexpected_count,
            "auth_failures": t.auth_failures,
            "failed_peers": len(e.failed_peers),
            "lane_messages": t.lane_messages,
            "shm_pieces": t.shm_pieces,
            "lane_fallbacks": t.lane_fallbacks,
            # This group's inputs to its collectives on its shared workspace (no socket).
            "workspace_bytes": (
                0 if self.core.workspace_calls is None else self.core.workspace_calls.moved_bytes
            ),
        }

    def failed_peers(self) -> list[int]:
        """Global ranks this process saw fail (empty while the group is healthy)."""
        return sorted(self.core.progress.failed_peers)

    # -- closing -----------------------------------------------------------------------
    def close(self) -> None:
        """Release the group. Closing the world group closes the process's transport:
        peers learn that this rank left (a goodbye), and calls of theirs that still wait
        on it raise ``PeerFailedError`` ("rank N left the group")."""
        core = self.core
        if core.closed:
            return
        core.closed = True
        if not core.is_world:  # its unfinished operations fail
            rank = core.rank
            core.progress.abort(
                lambda op: GroupClosedError(f"rank {rank}: {op.desc}: the group was closed first"),
                group=core.group_id,
            )
            core.close_workspace()
            return
        core.state.shutdown(
            DEPART_CLOSE,
            checkout_s=min(core.timeout_s, CHECKOUT_MAX_S),
            linger_s=min(3.0, core.timeout_s),
        )
        core.close_workspace()

    def abort(self, reason: BaseException | str | None = None) -> None:
        """Leave every group of this process at once because this rank is failing.

        Peers are told why first: their pending and next calls raise
        ``PeerFailedError`` saying ``rank N exited: <reason>`` (an exception is shown as
        ``Type: message``). Nothing waits for anybody (no store check-out, no linger).
        Idempotent; ``close()`` after it does nothing. ``with pg:`` calls it when an
        exception leaves the block, and an uncaught exception calls it at exit.
        """
        self.core.closed = True
        if isinstance(reason, BaseException):
            why = lifecycle.describe_exit(reason)
        else:
            why = str(reason) if reason else "aborted"
        self.core.state.shutdown(DEPART_ERROR, why, checkout_s=0.0, linger_s=0.0)

    def __enter__(self) -> ProcessGroup:  # noqa: PYI034 (subclasses are not expected)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is not None and not (isinstance(exc, SystemExit) and not exc.code):
            self.abort(exc)
        else:
            self.close()


def _bind_to_core(local_rank: int) -> None:
    """Run the calling thread (the one driving this rank's collectives) on one core:
    ``local_rank`` modulo the cores it may use. Threads started before (libzmq's I/O
    thread) keep their placement; threads started later by this one inherit it.

    When: :func:`ringcomm.config.binds_to_core` (the one rule; ``ringcomm bench`` uses it
    too). Why (``RINGCOMM_BIND``, by default when a host has more ranks than cores):
    with 4 ranks on 2 cores the OS left 3 ranks on one core in about half the jobs (it
    does not move tasks that ran within the last half millisecond, and ranks waiting for
    small messages always have), and the 8-byte all_reduce took ~115 instead of ~65 us;
    bound round-robin it stayed at 62-68 us (benchmarks/results/local_lane.md). Such
    ranks get less than a core each anyway (torchrun, for the same reason, starts them
    with OMP_NUM_THREADS=1). Not with as many ranks as cores: bound, large messages lost
    ~10% there (W=2 on 2 cores), and unbound their small ones were steady.
    """
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[local_rank % len(cores)]})


def _enable_debug_log() -> None:
    """RINGCOMM_LOG=debug: op start/end lines on stderr (unless the app set up logging)."""
    logger = logging.getLogger("ringcomm")
    logger.setLevel(logging.DEBUG)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("ringcomm %(asctime)s %(message)s"))
        logger.addHandler(handler)


def _bind_host(addr: str) -> str:
    """Interface to bind the store on: the master address itself if it is local."""
    import socket

    try:
        ip = socket.gethostbyname(addr)
    except OSError as exc:
        raise RendezvousError(f"cannot resolve master address {addr!r}: {exc}") from exc
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return ip
    except OSError:
        return "0.0.0.0"  # e.g. a NAT address: listen on every interface


def init_process_group(
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
) -> ProcessGroup:
    """Join (or form) the world group; see DESIGN.md §1 for where values come from.

    Extensions beyond the contract: ``host_store`` (False: a launcher serves the store,
    as ``RINGCOMM_STORE_EXTERNAL=1``), ``chunk_bytes`` (piece size of pipelined
    transfers, an int > 0; default ``RINGCOMM_CHUNK_BYTES``, else 4 MiB), ``transport``
    (``auto``, ``ipc`` or ``tcp``; default ``RINGCOMM_TRANSPORT``, else auto), ``env``
    (where settings are read instead of ``os.environ``). Every setting is parsed by
    :func:`ringcomm.config.resolve_init_config`; a bad value raises naming it.
    """
    cfg = resolve_init_config(
        rank,
        world_size,
        master_addr=master_addr,
        master_port=master_port,
        timeout_s=timeout_s,
        token=token,
        host_store=host_store,
        chunk_bytes=chunk_bytes,
        transport=transport,
        env=env,
    )
    mode = cfg.transport
    label = f"rank {cfg.rank}"

    server: StoreServer | None = None
    store: Store | None = None
    net: ZmqTransport | None = None
    try:
        port = cfg.master_port
        if cfg.rank == 0 and not cfg.store_external and (cfg.world_size > 1 or port != 0):
            try:
                server = StoreServer(_bind_host(cfg.master_addr), port, token=cfg.token).start()
            except RingcommError as exc:
                if cfg.master_port_origin is None:
                    raise
                how = (
                    "mpirun -x MASTER_PORT=29500"
                    if cfg.source == "mpirun"
                    else "export MASTER_PORT=29500 before srun"
                )
                raise RendezvousError(
                    f"{label}: {exc}. Port {port} was {cfg.master_port_origin} and is taken: "
                    f"set MASTER_PORT (or RINGCOMM_MASTER_PORT) to a free port, e.g. {how}"
                ) from exc
            except Exception as exc:
                raise RendezvousError(
                    f"{label}: cannot serve the rendezvous store on {cfg.master_addr}:{port}: {exc}"
                ) from exc
            port = server.port
        tcp_host = local_address_towards(cfg.master_addr, port or 9)
        net = ZmqTransport(
            cfg.rank,
            tcp_host=tcp_host,
            use_ipc=mode != "tcp",
            token=cfg.token,
            security=cfg.security,
            lane=cfg.local_lane,
            shm=cfg.shm,
        )
        me = EndpointInfo(
            rank=cfg.rank,
            host_id=host_identity(),
            ipc=net.ipc_endpoint,
            tcp=net.tcp_endpoint,
            pid=os.getpid(),
            version=__version__,
            lane=net.lane_endpoint,
            shm=net.shm_enabled,
            workspace=cfg.workspace and WORKSPACE_AVAILABLE,
        )
        infos = {cfg.rank: me}
        if cfg.world_size > 1 or cfg.store_external:
            store = Store(
                cfg.master_addr, port, token=cfg.token, timeout_s=cfg.timeout_s, label=label
            )
            store.set(f"rank/{cfg.rank}", json.dumps(me.to_dict()).encode())
            keys = [f"rank/{r}" for r in range(cfg.world_size)]
            store.wait(keys, timeout_s=cfg.timeout_s)
            for r in range(cfg.world_size):
                infos[r] = EndpointInfo.from_dict(json.loads(store.get(keys[r])))
        for r, info in infos.items():
            if info.version != __version__:
                raise RendezvousError(
                    f"{label}: rank {r} runs ringcomm {info.version}, this rank {__version__}"
                )
            if r != cfg.rank:
                try:
                    endpoint = choose_endpoint(me, info, mode)
                except ValueError as exc:
                    raise RendezvousError(str(exc)) from exc
                net.set_peer_endpoint(r, endpoint)
                if info.lane is not None and endpoint.startswith("ipc://"):
                    net.set_peer_lane(r, info.lane)
        net.connect_all()  # every peer, now: liveness is watched on these connections
        try:
            net.setup_shm([r for r, info in infos.items() if info.shm], cfg.timeout_s)
        except RingcommError as exc:
            raise RendezvousError(f"{label}: {exc}") from exc
        if binds_to_core(cfg.bind, cfg.local_world_size, len(os.sched_getaffinity(0))):
            _bind_to_core(cfg.local_rank)
        if cfg.log_debug:
            _enable_debug_log()
        progress = Progress(
            net,
            cfg.rank,
            max_unexpected_messages=(
                MAX_UNEXPECTED_MESSAGES
                if cfg.max_unexpected_messages is None
                else cfg.max_unexpected_messages
            ),
            max_unexpected_bytes=(
                MAX_UNEXPECTED_BYTES
                if cfg.max_unexpected_bytes is None
                else cfg.max_unexpected_bytes
            ),
            log_ops=cfg.log_debug,
        )
        state = ProcessState(cfg, progress, store, server, cfg.effective_chunk_bytes)
        state.peers = infos
        lifecycle.register(state)  # however the process ends, it leaves (lifecycle.py)
        core = GroupCore(state, range(cfg.world_size), WORLD_GROUP_ID)
        core.workspace = setup_workspace(core)
        return ProcessGroup(core)
    except BaseException:
        if net is not None:
            net.close(0.0)
        if store is not None:
            store.close()
        if server is not None:
            server.close()
        raise
