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
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import lifecycle
from ._version import __version__
from .buffers import check_array, check_peer, check_tag
from .collectives import api as _collectives
from .config import DEFAULT_CHUNK_BYTES, InitConfig, binds_to_core, resolve_init_config
from .errors import CommTimeoutError, GroupClosedError, RendezvousError, RingcommError
from .p2p import RecvOp, SendOp
from .p2p_device import recv_op_class, send_op_class
from .progress import (
    DEPART_CLOSE,
    DEPART_ERROR,
    MAX_UNEXPECTED_BYTES,
    MAX_UNEXPECTED_MESSAGES,
    Engine,
    Op,
    SerialQueue,
)
from .rendezvous import Store, StoreServer
from .transport.endpoints import (
    EndpointInfo,
    choose_endpoint,
    host_identity,
    local_address_towards,
)
from .transport.zmq_transport import ZmqTransport
from .work import Work

__all__ = ["DEFAULT_CHUNK_BYTES", "ProcessGroup", "init_process_group"]

_WORLD_GROUP_ID = 0


#: Longest close() waits, as the store's host, for every rank to check out.
CHECKOUT_MAX_S = 60.0
#: How often a rank waiting for check-outs looks for goodbyes and failures meanwhile.
_CHECKOUT_SLICE_S = 0.02
#: Longest a rank failing because of a same-host peer waits for that peer's exit.
CULPRIT_WAIT_S = 0.5
#: How much longer a rank waits once a culprit on another host is gone.
CULPRIT_REMOTE_LEAD_S = 0.1


class _Shared:
    """What all groups of one process share: the engine, the store, the config; and how
    the process leaves them all (``close``/``abort`` of the world group, or the exit
    hooks of :mod:`ringcomm.lifecycle`, for which this is the registered leaver)."""

    def __init__(
        self,
        config: InitConfig,
        engine: Engine,
        store: Store | None,
        server: StoreServer | None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.store = store
        self.server = server
        self.closed = False
        self.lock = threading.Lock()
        #: Every rank's published endpoint info (pid, host), by global rank.
        self.peers: dict[int, EndpointInfo] = {}
        self.host_id = host_identity()

    # -- lifecycle.Leaver --------------------------------------------------------------
    def leave(self, kind: str, why: str, budget_s: float) -> None:
        """The process ends without ``close()`` (lifecycle.py): leave within ``budget_s``."""
        self.shutdown(kind, why, checkout_s=budget_s / 3, linger_s=budget_s / 3)

    def farewell(self, why: str) -> None:
        """From a signal handler: tell the peers, remove our files; nothing else."""
        if self.closed:
            return
        self.closed = True
        self.engine.farewell(why, skip=self._gone)
        self.engine.transport.remove_files()

    def _gone(self, peer: int) -> bool:
        """Whether global rank ``peer`` is known to have exited (a same-host process)."""
        info = self.peers.get(peer)
        if info is None or info.host_id != self.host_id:
            return False
        try:
            os.kill(info.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    # -- leaving -------------------------------------------------------------------------
    def shutdown(
        self, kind: str, why: str = "", *, checkout_s: float, linger_s: float
    ) -> None:
        """Leave every group of this process; idempotent.

        ``kind``: ``DEPART_CLOSE`` (``close()``), ``DEPART_EXIT`` (the process ends
        without it) or ``DEPART_ERROR`` (``abort()``, an uncaught exception: peers are
        told ``why`` first and nobody waits for anybody). The store's host waits up to
        ``checkout_s`` for the other ranks to check out, giving up as soon as one of
        them is gone; pending sends get ``linger_s``.
        """
        with self.lock:
            if self.closed:
                return
            self.closed = True
        lifecycle.unregister(self)
        engine, store, server = self.engine, self.store, self.server
        rank = self.config.rank
        try:
            if kind == DEPART_ERROR:
                engine.farewell(why, skip=self._gone)
                self._let_culprit_go_first()
            engine.abort(
                lambda op: GroupClosedError(f"rank {rank}: {op.desc}: the group was closed first")
            )
            if kind != DEPART_ERROR:
                engine.read_control()  # who left or failed meanwhile
                if engine.failure is None:
                    engine.say_goodbye(linger_s, kind)  # peers waiting on us fail now
                if store is not None and engine.failure is None and checkout_s > 0:
                    self._check_out(store, server, checkout_s)
        finally:
            failed = kind == DEPART_ERROR or engine.failure is not None
            engine.close(0.0 if failed else linger_s, kind)
            if store is not None:
                store.close()
            if server is not None:
                server.close()

    def _let_culprit_go_first(self) -> None:
        """This rank fails because a peer did: wait (briefly) until that peer's process
        is gone (its pid on this host, its connection elsewhere), so a launcher sees the
        culprit's exit first and reports its exit code, not this victim's."""
        failure = self.engine.failure
        peer = getattr(failure, "peer", None)
        info = self.peers.get(peer) if isinstance(peer, int) else None
        if info is None or info.pid == os.getpid() and info.host_id == self.host_id:
            return
        if info.host_id == self.host_id:
            wait_for_exit(info.pid, CULPRIT_WAIT_S)
        elif self.engine.wait_disconnected(peer, CULPRIT_WAIT_S):
            # Its exit status still travels to the launcher (ssh): give it a head start.
            time.sleep(CULPRIT_REMOTE_LEAD_S)

    def _check_out(self, store: Store, server: StoreServer | None, limit_s: float) -> None:
        """Count this rank out of the store. Its host keeps serving until every rank has
        checked out (a rank may still be reading its last rendezvous reply), at most
        ``limit_s``, and no longer once a rank is gone (it will never check out)."""
        engine = self.engine
        world = self.config.world_size
        if not self.config.store_external and engine.departed(0) and server is None:
            return  # rank 0 served the store and has left
        try:
            n = store.add("__closed__", 1, timeout_s=max(limit_s, 0.1))
            if n >= world:
                store.set("__all_closed__", b"1")
                return
            if server is None:
                return
            give_up_at = time.monotonic() + limit_s
            while True:
                remaining = give_up_at - time.monotonic()
                if remaining <= 0:
                    return
                try:
                    store.wait(["__all_closed__"], timeout_s=min(remaining, _CHECKOUT_SLICE_S))
                    return
                except CommTimeoutError:
                    pass
                engine.read_control()
                if engine.failure is not None or all(
                    engine.departed(r) for r in range(world) if r != self.config.rank
                ):
                    return  # a rank failed (it never checks out), or everyone left
        except RingcommError:
            pass  # best effort: the store or its host may be gone


class ProcessGroup:
    """A set of ranks that communicate. Use as a context manager; ``close()`` is idempotent.

    Ranks given to and returned by methods are ranks *of this group* (0..world_size-1).
    ``timeout_s`` (the default per-call deadline) and ``chunk_bytes`` (the piece size of
    pipelined transfers) default to the process's config; both stay attributes a caller
    may change.
    """

    def __init__(
        self,
        shared: _Shared,
        ranks: Sequence[int],
        group_id: int,
        *,
        timeout_s: float | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        self._shared = shared
        self._engine = shared.engine
        self._ranks = tuple(ranks)  # group rank -> global rank
        self._group_id = group_id
        me = shared.config.rank
        self._rank = self._ranks.index(me)
        self._world_size = len(self._ranks)
        self._global_rank = me
        self.timeout_s: float = shared.config.timeout_s if timeout_s is None else timeout_s
        self.chunk_bytes: int = (
            shared.config.effective_chunk_bytes if chunk_bytes is None else chunk_bytes
        )
        self._serial = SerialQueue()
        # Per-call-shape state of this group's collectives (collectives.base.ShapeCache).
        self._plans: dict[Any, Any] = {}
        self._coll_seq = 0
        self._subgroup_count = 0
        self._failed: BaseException | None = None
        self._closed = False

    # -- identity ----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def group_id(self) -> int:
        return self._group_id

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of this group's members, in group-rank order."""
        return self._ranks

    @property
    def config(self) -> InitConfig:
        return self._shared.config

    def __repr__(self) -> str:
        return (
            f"<ProcessGroup rank {self._rank}/{self._world_size} group {self._group_id}"
            f"{' closed' if self._closed else ''}>"
        )

    # -- internals used by collectives -------------------------------------------------
    def _check_usable(self, what: str) -> None:
        if self._closed or self._shared.closed:
            raise GroupClosedError(f"rank {self._rank}: {what}: the process group is closed")
        engine = self._engine
        if engine.failure is not None:  # a peer failed: this and every later call raise
            raise engine.failed_error(what)
        if self._failed is not None:
            raise GroupClosedError(
                f"rank {self._rank}: {what}: the process group failed earlier and stays "
                f"failed: {self._failed}"
            ) from self._failed

    def _timeout(self, timeout_s: float | None) -> float:
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        if not t > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        return t

    def _run(
        self, op: Op, timeout_s: float | None, async_op: bool, deadline: float | None = None
    ) -> Any:
        """Submit ``op`` (unless a fast lane started it already); wait for it (blocking,
        until ``deadline`` if given, a ``time.monotonic()`` instant) or return its Work."""
        t = self._timeout(timeout_s)
        if not op.started:
            self._engine.submit(op)
        if async_op:
            return Work(self._engine, op, t)
        try:
            return self._engine.wait(op, t, deadline)
        except RingcommError as exc:
            if not isinstance(op, (SendOp, RecvOp)):
                self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = exc

    def next_collective_seq(self) -> int:
        """Sequence number tagging the next collective (all ranks call them in one order)."""
        self._coll_seq += 1
        return self._coll_seq

    def global_rank(self, group_rank: int) -> int:
        return self._ranks[group_rank]

    # -- point-to-point ----------------------------------------------------------------
    def _send_op(self, x: Any, dst: Any, tag: Any, async_op: bool) -> SendOp:
        what = f"rank {self._rank}: send"
        x = check_array(x, what, device=True)
        dst = check_peer(dst, self._world_size, what, "dst")
        tag = check_tag(tag, what)
        self._check_usable("send")
        return send_op_class(x)(
            self._engine,
            x,
            src_global=self._global_rank,
            dst_global=self._ranks[dst],
            dst=dst,
            group_id=self._group_id,
            tag=tag,
            chunk_bytes=self.chunk_bytes,
            rank=self._rank,
            async_op=async_op,
        )

    def _recv_op(self, x: Any, src: Any, tag: Any, async_op: bool) -> RecvOp:
        what = f"rank {self._rank}: recv"
        x = check_array(x, what, writeable=True, device=True)
        src = check_peer(src, self._world_size, what, "src")
        tag = check_tag(tag, what)
        self._check_usable("recv")
        return recv_op_class(x)(
            self._engine,
            x,
            src_global=self._ranks[src],
            src=src,
            group_id=self._group_id,
            tag=tag,
            rank=self._rank,
            async_op=async_op,
        )

    def send(self, x: np.ndarray, dst: int, tag: int = 0, *, timeout_s: float | None = None) -> None:
        """Send ``x`` to ``dst``; returns once ``x`` may be modified again."""
        self._run(self._send_op(x, dst, tag, False), timeout_s, False)

    def recv(
        self, x: np.ndarray, src: int, tag: int = 0, *, timeout_s: float | None = None
    ) -> np.ndarray:
        """Receive the next message from ``src`` with ``tag`` into ``x`` (in place)."""
        return self._run(self._recv_op(x, src, tag, False), timeout_s, False)  # type: ignore[no-any-return]

    def isend(self, x: np.ndarray, dst: int, tag: int = 0) -> Work:
        """Start a send; do not modify ``x`` until the returned Work is done."""
        return self._run(self._send_op(x, dst, tag, True), None, True)  # type: ignore[no-any-return]

    def irecv(self, x: np.ndarray, src: int, tag: int = 0) -> Work:
        """Start a receive into ``x``; ``Work.wait()`` returns ``x``."""
        return self._run(self._recv_op(x, src, tag, True), None, True)  # type: ignore[no-any-return]

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
        return _collectives.all_reduce(self, x, op, async_op, timeout_s=timeout_s, algo=algo)

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
        return _collectives.reduce_scatter(self, x, out, op, async_op, timeout_s=timeout_s)

    def all_gather(
        self, x: Any, out: Any = None, async_op: bool = False, *, timeout_s: float | None = None
    ) -> Any:
        """Every rank's ``x`` as ``(world_size, *x.shape)`` in rank order."""
        return _collectives.all_gather(self, x, out, async_op, timeout_s=timeout_s)

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
        return _collectives.broadcast(self, x, src, async_op, timeout_s=timeout_s, algo=algo)

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
        return _collectives.reduce(self, x, dst, op, async_op, timeout_s=timeout_s)

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
        return _collectives.gather(self, x, dst, out, async_op, timeout_s=timeout_s)

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
        return _collectives.scatter(self, x, src, out, async_op, timeout_s=timeout_s)

    def all_to_all(
        self, x: Any, out: Any = None, async_op: bool = False, *, timeout_s: float | None = None
    ) -> Any:
        """``out[j]`` is rank ``j``'s ``x[rank]``."""
        return _collectives.all_to_all(self, x, out, async_op, timeout_s=timeout_s)

    def barrier(self, async_op: bool = False, *, timeout_s: float | None = None) -> Any:
        """Return once every rank of the group has entered the barrier."""
        return _collectives.barrier(self, async_op, timeout_s=timeout_s)

    # -- end of collectives --------------------------------------------------------------

    # -- sub-groups --------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> ProcessGroup | None:
        """A sub-group of this group's ``ranks`` with its own tag space.

        Every rank of this group must call ``new_group`` with the same ranks, in the same
        order relative to its other ``new_group`` calls (as in torch.distributed);
        members get the sub-group, others get None.
        """
        self._check_usable("new_group")
        members = [check_peer(r, self._world_size, f"rank {self._rank}: new_group", "rank") for r in ranks]
        if len(set(members)) != len(members) or not members:
            raise ValueError(f"rank {self._rank}: new_group: ranks must be distinct and non-empty, got {list(ranks)}")
        self._subgroup_count += 1
        digest = hashlib.blake2b(
            repr((self._group_id, self._subgroup_count, tuple(members))).encode(), digest_size=8
        ).digest()
        gid = int.from_bytes(digest, "little") >> 1 or 1  # 63-bit, never the world's 0
        if self._rank not in members:
            return None
        return ProcessGroup(
            self._shared,
            [self._ranks[r] for r in members],
            gid,
            timeout_s=self.timeout_s,
            chunk_bytes=self.chunk_bytes,
        )

    # -- introspection -----------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters of this process's transport (shared by all its groups)."""
        e = self._engine
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
        }

    def failed_peers(self) -> list[int]:
        """Global ranks this process saw fail (empty while the group is healthy)."""
        return sorted(self._engine.failed_peers)

    # -- closing -----------------------------------------------------------------------
    def close(self) -> None:
        """Release the group. Closing the world group closes the process's transport:
        peers learn that this rank left (a goodbye), and calls of theirs that still wait
        on it raise ``PeerFailedError`` ("rank N left the group")."""
        if self._closed:
            return
        self._closed = True
        if self._group_id != _WORLD_GROUP_ID:  # its unfinished operations fail
            rank = self._rank
            self._engine.abort(
                lambda op: GroupClosedError(f"rank {rank}: {op.desc}: the group was closed first"),
                group=self._group_id,
            )
            return
        self._shared.shutdown(
            DEPART_CLOSE,
            checkout_s=min(self.timeout_s, CHECKOUT_MAX_S),
            linger_s=min(3.0, self.timeout_s),
        )

    def abort(self, reason: BaseException | str | None = None) -> None:
        """Leave every group of this process at once because this rank is failing.

        Peers are told why first: their pending and next calls raise
        ``PeerFailedError`` saying ``rank N exited: <reason>`` (an exception is shown as
        ``Type: message``). Nothing waits for anybody (no store check-out, no linger).
        Idempotent; ``close()`` after it does nothing. ``with pg:`` calls it when an
        exception leaves the block, and an uncaught exception calls it at exit.
        """
        self._closed = True
        if isinstance(reason, BaseException):
            why = lifecycle.describe_exit(reason)
        else:
            why = str(reason) if reason else "aborted"
        self._shared.shutdown(DEPART_ERROR, why, checkout_s=0.0, linger_s=0.0)

    def __enter__(self) -> ProcessGroup:  # noqa: PYI034 (subclasses are not expected)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is not None and not (isinstance(exc, SystemExit) and not exc.code):
            self.abort(exc)
        else:
            self.close()


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for process ``pid`` (of this host) to end; True if it did."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return False  # gone already, or no pidfds here: do not wait
    try:
        import select

        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


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
            except RingcommError:
                raise
            except Exception as exc:
                raise RendezvousError(
                    f"{label}: cannot serve the rendezvous store on "
                    f"{cfg.master_addr}:{port}: {exc}"
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
        )
        infos = {cfg.rank: me}
        if cfg.world_size > 1 or cfg.store_external:
            store = Store(cfg.master_addr, port, token=cfg.token, timeout_s=cfg.timeout_s, label=label)
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
        engine = Engine(
            net,
            cfg.rank,
            max_unexpected_messages=(
                MAX_UNEXPECTED_MESSAGES
                if cfg.max_unexpected_messages is None
                else cfg.max_unexpected_messages
            ),
            max_unexpected_bytes=(
                MAX_UNEXPECTED_BYTES if cfg.max_unexpected_bytes is None else cfg.max_unexpected_bytes
            ),
            log_ops=cfg.log_debug,
        )
        shared = _Shared(cfg, engine, store, server)
        shared.peers = infos
        lifecycle.register(shared)  # however the process ends, it leaves (lifecycle.py)
        return ProcessGroup(shared, range(cfg.world_size), _WORLD_GROUP_ID)
    except BaseException:
        if net is not None:
            net.close(0.0)
        if store is not None:
            store.close()
        if server is not None:
            server.close()
        raise
