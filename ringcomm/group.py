"""ProcessGroup: ranks, tags, deadlines, point-to-point, sub-groups; init_process_group.

Forming a group (``init_process_group``):
  1. Resolve rank, world size and master address from arguments and the environment
     (:mod:`ringcomm.config`).
  2. Rank 0 hosts the rendezvous store at master_addr:master_port (unless a launcher
     already does); every rank connects to it and joins the group's key namespace
     (``pg<k>``), where a disagreement is refused at once (:mod:`ringcomm.rendezvous.meeting`).
  3. Every rank binds its receive socket (ipc:// and tcp://), publishes its endpoints under
     ``rank/<r>``, waits for everyone's, and picks ipc:// for peers on its host.
  4. Send sockets connect lazily, on the first message to each peer.

Tag spaces: a message is matched on (source, group id, kind, tag), so point-to-point tags,
collectives (tagged by their sequence number) and sub-groups never collide.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ringcomm._version import __version__
from ringcomm.collectives import api as _collectives
from ringcomm.collectives.hierarchy import Hierarchy
from ringcomm.config import DEFAULT_CHUNK_BYTES, InitConfig, binds_to_core, resolve_init_config
from ringcomm.core import lifecycle
from ringcomm.core import summary as group_summary
from ringcomm.core.buffers import check_array, check_peer, check_tag
from ringcomm.core.group_core import (
    CHECKOUT_MAX_S,
    WORLD_GROUP_ID,
    GroupCore,
    ProcessState,
    install_trace_signal,
    setup_workspace,
    workspace_possible,
)
from ringcomm.core.p2p import ANY_SOURCE, AnySource, RecvOp, SendOp
from ringcomm.core.progress import (
    DEPART_CLOSE,
    DEPART_ERROR,
    MAX_UNEXPECTED_BYTES,
    MAX_UNEXPECTED_MESSAGES,
    Progress,
)
from ringcomm.core.regroup import (
    SHRINK_SLICE_S,
    agree_survivors,
    connect_store,
    dead_view,
    explain_store_loss,
    failover_ports,
    watch_members,
)
from ringcomm.core.work import Work
from ringcomm.device.p2p import recv_op_class, send_op_class
from ringcomm.device.xp import select_device
from ringcomm.errors import (
    CommTimeoutError,
    GroupClosedError,
    PeerFailedError,
    RendezvousError,
    RingcommError,
)
from ringcomm.rendezvous import Store, StoreServer, meeting
from ringcomm.rendezvous import security as _security
from ringcomm.rendezvous.hosting import ServerLease
from ringcomm.schedule.topology import Topology
from ringcomm.transport.endpoints import (
    EndpointInfo,
    choose_endpoint,
    host_identity,
    local_address_towards,
)
from ringcomm.transport.wire import WIRE_VERSION
from ringcomm.transport.workspace import AVAILABLE as WORKSPACE_AVAILABLE
from ringcomm.transport.zmq_transport import ZmqTransport
from ringcomm.tuning.costmodel import CostModel, load_tune_file

__all__ = ["DEFAULT_CHUNK_BYTES", "ProcessGroup", "init_process_group"]



class ProcessGroup:
    """A set of ranks that communicate. Use as a context manager; ``close()`` is idempotent.

    Ranks given to and returned by methods are ranks *of this group* (0..world_size-1).
    The facade over a :class:`~ringcomm.core.group_core.GroupCore` (``core``), which is what
    the collectives and point-to-point operations use.
    """

    def __init__(self, core: GroupCore) -> None:
        self.core = core
        core.make_hierarchy = lambda: Hierarchy(self, self.topology)

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

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model this group chooses algorithms and piece sizes with (rank 0's
        RINGCOMM_TUNE_FILE, read when the world group formed); None: the measured
        switch points."""
        return self.core.state.costmodel

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
        limit = self.core.state.config.max_piece_bytes
        if isinstance(value, int) and value > limit:  # other bad values: at the next call
            raise ValueError(
                f"rank {self.core.rank}: chunk_bytes={value} is above this group's largest "
                f"piece ({limit} bytes; RINGCOMM_CHUNK_BYTES raises it)"
            )
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
        any_source = src is None or src is ANY_SOURCE
        if not any_source:
            src = check_peer(src, core.world_size, what, "src")
        tag = check_tag(tag, what)
        core.check_usable("recv")
        return recv_op_class(x)(
            core.progress,
            x,
            src_global=None if any_source else core.ranks[src],
            src=None if any_source else src,
            group_id=core.group_id,
            tag=tag,
            rank=core.rank,
            async_op=async_op,
            ranks=core.ranks if any_source else (),
        )

    def send(
        self, x: np.ndarray, dst: int, tag: int = 0, *, timeout_s: float | None = None
    ) -> None:
        """Send ``x`` to ``dst``; returns once ``x`` may be modified again."""
        self._p2p(self._send_op(x, dst, tag, False), "send", dst, tag, timeout_s, False)

    def recv(
        self,
        x: np.ndarray,
        src: int | AnySource | None = ANY_SOURCE,
        tag: int = 0,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """Receive the next message from ``src`` with ``tag`` into ``x`` (in place);
        return ``x``.

        ``src`` :data:`ringcomm.ANY_SOURCE` (the default) or None: the next message with
        ``tag`` from any rank of the group (the earliest arrived; messages from one sender
        still match in the order sent); returns the sender's rank instead of ``x``. Raises
        ``PeerFailedError`` once every other rank of the group left or one failed.
        """
        return self._p2p(self._recv_op(x, src, tag, False), "recv", src, tag, timeout_s, False)

    def isend(self, x: np.ndarray, dst: int, tag: int = 0) -> Work:
        """Start a send; do not modify ``x`` until the returned Work is done."""
        return self._p2p(self._send_op(x, dst, tag, True), "send", dst, tag, None, True)  # type: ignore[no-any-return]

    def irecv(self, x: np.ndarray, src: int | AnySource | None = ANY_SOURCE, tag: int = 0) -> Work:
        """Start a receive into ``x``; ``Work.wait()`` returns what :meth:`recv` returns
        (``x``; the sender's rank for :data:`ringcomm.ANY_SOURCE`) and ``Work.source`` is
        the sender's rank once done."""
        return self._p2p(self._recv_op(x, src, tag, True), "recv", src, tag, None, True)  # type: ignore[no-any-return]

    def _p2p(self, op: SendOp | RecvOp, name: str, peer: Any, tag: Any,
             timeout_s: float | None, async_op: bool) -> Any:  # fmt: skip
        """Run a point-to-point op, recorded by the flight recorder (its ``seq`` is the tag;
        ``peers``: the other rank, global, or every rank for an any-source receive)."""
        core = self.core
        recorder = core.state.recorder
        if not recorder.enabled:
            return core.run(op, timeout_s, async_op)
        x = op.x
        anyone = peer is None or peer is ANY_SOURCE
        peers = core.ranks if anyone else (core.ranks[int(peer)],)
        entry: Any = recorder.start(core.group_id, int(tag), name, x.dtype, tuple(x.shape),
                                    int(x.nbytes), "p2p", peers)  # fmt: skip
        try:
            result = core.run(op, timeout_s, async_op)
        except BaseException as exc:
            recorder.end(entry, exc)
            if isinstance(exc, (CommTimeoutError, PeerFailedError)):
                core.state.dump_trace(f"{type(exc).__name__} in {name} (tag {tag})")
            raise
        if async_op:
            result.add_done_callback(lambda w: recorder.end(entry, w.exception()))
        else:
            recorder.done(entry)
        return result

    # -- collectives -------------------------------------------------------------------
    # Thin delegates to ringcomm.collectives.api (argument checks, algorithm choice and the
    # algorithms live there). docs/contracts.md; every call also takes timeout_s=.
    def all_reduce(
        self,
        x: Any,
        op: Any = "sum",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any:
        """Reduce ``x`` over the group in place; return ``x`` (a Work if ``async_op``).

        A group that spans hosts, with several ranks on one of them, reduces hierarchically
        (:mod:`ringcomm.collectives.hierarchy`: within each host, then across hosts, one inter-host
        group per local rank) unless ``algo`` (or ``RINGCOMM_ALGO``) names a flat
        algorithm; ``algo="hier"`` asks for it (an error on a group it does not fit)."""
        return _collectives.all_reduce(self.core, x, op, async_op, timeout_s=timeout_s, algo=algo)

    @property
    def device_windows(self) -> bool:
        """Whether device arrays (CuPy) take device windows (``algo="ipc"``, CUDA IPC) on a
        group whose ranks share one host (``RINGCOMM_IPC``, default on); False: host
        staging, as across hosts. Settable; sub-groups made afterwards inherit it."""
        return self.core.device_windows

    @device_windows.setter
    def device_windows(self, on: bool) -> None:
        self.core.device_windows = bool(on)

    @property
    def topology(self) -> Topology:
        """Which of this group's ranks share a host (:class:`ringcomm.schedule.topology.
        Topology`: ranks per host, local ranks, leaders, a host-contiguous ring order)."""
        return self.core.topology

    def reduce_scatter(
        self,
        x: Any,
        out: Any = None,
        op: Any = "sum",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any:
        """This rank's row of the reduction of ``x`` (``x.shape[0] == world_size``).

        Hierarchical on a group spanning hosts, as :meth:`all_reduce` (``algo``: ``"hier"``
        or ``"ring"``)."""
        return _collectives.reduce_scatter(
            self.core, x, out, op, async_op, timeout_s=timeout_s, algo=algo
        )

    def all_gather(
        self,
        x: Any,
        out: Any = None,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any:
        """Every rank's ``x`` as ``(world_size, *x.shape)`` in rank order.

        Hierarchical on a group spanning hosts, as :meth:`all_reduce` (``algo``: ``"hier"``
        or ``"ring"``)."""
        return _collectives.all_gather(self.core, x, out, async_op, timeout_s=timeout_s, algo=algo)

    def broadcast(
        self,
        x: Any,
        src: int = 0,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any:
        """``src``'s ``x`` into every rank's ``x`` (in place).

        Hierarchical on a group spanning hosts, as :meth:`all_reduce` (``algo``: ``"hier"``,
        ``"tree"`` or ``"chain"``)."""
        return _collectives.broadcast(self.core, x, src, async_op, timeout_s=timeout_s, algo=algo)

    def reduce(
        self,
        x: Any,
        dst: int = 0,
        op: Any = "sum",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any:
        """Reduction of ``x`` over the group, in place on ``dst``."""
        return _collectives.reduce(self.core, x, dst, op, async_op, timeout_s=timeout_s, algo=algo)

    def gather(
        self,
        x: Any,
        dst: int = 0,
        out: Any = None,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any:
        """``(world_size, *x.shape)`` on ``dst``, None elsewhere."""
        return _collectives.gather(self.core, x, dst, out, async_op, timeout_s=timeout_s, algo=algo)

    def scatter(
        self,
        x: Any,
        src: int = 0,
        out: Any = None,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any:
        """Row ``x[rank]`` of ``src``'s ``x`` on every rank (``x`` may be None off ``src``;
        device arrays with ``algo="ipc"``: a device array on every rank)."""
        return _collectives.scatter(self.core, x, src, out, async_op, timeout_s=timeout_s, algo=algo)

    def all_to_all(
        self, x: Any, out: Any = None, async_op: bool = False, *,
        timeout_s: float | None = None, algo: str | None = None,
    ) -> Any:  # fmt: skip
        """``out[j]`` is rank ``j``'s ``x[rank]``."""
        return _collectives.all_to_all(self.core, x, out, async_op, timeout_s=timeout_s, algo=algo)

    # Uneven collectives: rows of different counts per rank (README "Uneven collectives").
    def all_gather_v(
        self,
        x: Any,
        sizes: Any = None,
        out: Any = None,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """Every rank's rows (``x.shape[0]`` may differ) concatenated in rank order:
        ``(sum(sizes), *x.shape[1:])``. ``sizes`` None: the counts are exchanged first."""
        return _collectives.all_gather_v(self.core, x, sizes, out, async_op, timeout_s=timeout_s)

    def reduce_scatter_v(
        self,
        x: Any,
        splits: Any,
        out: Any = None,
        op: Any = "sum",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """This rank's ``splits[rank]`` rows of the reduction of ``x`` (``sum(splits)`` rows)."""
        return _collectives.reduce_scatter_v(
            self.core, x, splits, out, op, async_op, timeout_s=timeout_s
        )

    def all_to_all_v(
        self,
        x: Any,
        input_splits: Any,
        output_splits: Any,
        out: Any = None,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """Rows ``input_splits[j]`` of ``x`` go to rank ``j``; ``out`` holds
        ``output_splits[j]`` rows from each rank ``j``, in rank order."""
        return _collectives.all_to_all_v(
            self.core, x, input_splits, output_splits, out, async_op, timeout_s=timeout_s
        )

    def barrier(
        self, async_op: bool = False, *, timeout_s: float | None = None, algo: str | None = None
    ) -> Any:
        """Return once every rank of the group has entered the barrier.

        Hierarchical on a group spanning hosts, as :meth:`all_reduce` (``algo``: ``"hier"``
        or ``"dissemination"``)."""
        return _collectives.barrier(self.core, async_op, timeout_s=timeout_s, algo=algo)

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

    def comm_summary(self) -> list[dict[str, Any]]:
        """This process's collectives so far, per op and size bucket (DeepSpeed's comms
        logger): ``op``, ``bucket_bytes`` (the next power of two of the call's bytes),
        ``count``, ``bytes``, ``total_s``, ``median_s``, ``busbw_GBps`` (nccl-tests'
        factors). Every group of the process counts; empty with RINGCOMM_TRACE_ENTRIES=0.
        ``ringcomm.core.flight.summary_table(rows)`` prints it."""
        return self.core.state.recorder.summary()

    def trace(self, reason: str = "pg.trace()") -> str | None:
        """Write this process's flight record to ``RINGCOMM_TRACE_DIR`` now; the path
        written, or None without a trace directory."""
        path = self.core.state.dump_trace(reason)
        return None if path is None else str(path)

    def failed_peers(self) -> list[int]:
        """Global ranks this process saw fail (empty while the group is healthy)."""
        return sorted(self.core.progress.failed_peers)

    # -- after a failure ---------------------------------------------------------------
    def shrink(self, *, timeout_s: float | None = None) -> ProcessGroup:
        """A new, healthy world group of the survivors, with consecutive ranks in the old
        order (NCCL's ``ncclCommShrink``); this group is closed. Every survivor calls it
        after a peer failed (or left); they agree on who survived through the store
        (:mod:`ringcomm.core.regroup`): the same member list everywhere. If the store's host
        was among the dead (rank 0, no launcher serving the store), the lowest survivor
        serves a new store on its own address, at the first free port of the old port + 1..8. Sub-groups are not
        carried over: make them again with ``new_group`` on the result. Survivors that
        disagree, or a second failure during the shrink, raise ``PeerFailedError`` (or
        ``CommTimeoutError`` for a survivor that never calls it) within ``timeout_s``
        (default: the group's). Call it on the world group only.
        """
        core = self.core
        if not core.is_world:
            raise ValueError(f"rank {core.rank}: shrink: call it on the world group (this is "
                             "a sub-group; make sub-groups again on the result)")  # fmt: skip
        if core.closed or core.state.closed:
            raise GroupClosedError(f"rank {core.rank}: shrink: the process group is closed")
        t = core.timeout(timeout_s)
        deadline = time.monotonic() + t
        old = core.state
        cfg = old.config
        epoch = old.epoch + 1
        dead = dead_view(core)
        me = core.global_rank
        store_host = None if cfg.store_external else 0
        server: StoreServer | ServerLease | None = None
        moved = False
        if store_host is None or store_host not in dead:
            addr, ports = cfg.master_addr, [old.store_port]
            server, moved = old.server, old.server is not None
        else:  # the store died with its host: the lowest survivor serves a new one
            leader = store_host = min(g for g in core.ranks if g not in dead)
            addr, ports = _address_of(old.peers[leader]), failover_ports(old.store_port)
            if leader == me:
                server = _serve_failover(addr, ports, cfg.token, core.rank)
                ports = [server.port]
        store: Store | None = None
        try:
            try:
                store, port = connect_store(core, addr, ports, cfg.token, deadline, store_host,
                                            dead)  # fmt: skip
                members = agree_survivors(core, _in(store, old.namespace), epoch, deadline,
                                          t, dead)  # fmt: skip
                slots = [old.slots[g] for g in members]
                pg = self._next_epoch(store, addr, port, server, moved, epoch, slots, deadline,
                                      watch=watch_members(core, members, dead))  # fmt: skip
            except RendezvousError as exc:  # the store went: who else went with it?
                raise explain_store_loss(core, exc, store_host, dead) from exc
        except BaseException:
            if store is not None:
                store.close()
            if server is not None and not moved:
                server.close()
            raise
        return pg

    def grow(
        self, *, wait: bool = False, timeout_s: float | None = None,
        on_admit: Callable[[], None] | None = None,
    ) -> ProcessGroup:  # fmt: skip
        """Admit restarted ranks (``ringcomm run --max-restarts``) that wait to rejoin: a
        collective of this world group, called at a step boundary. Returns this group if
        nobody waits, else a new world group in which every rank slot present (the
        original ranks, in order) has its rank again; this group is then closed. A
        restarted process's ``init_process_group()`` returns once it is admitted
        (``pg.rejoined`` is True there: it gets its state from a survivor, e.g. a
        broadcast from rank 0). Needs a store the launcher serves. ``wait=True``: first
        wait (within ``timeout_s``) for the slots the launcher says it is starting again
        (``restarting/<slot>`` in the store) to ask, e.g. before the job ends.
        ``on_admit``: called on every rank once they know ranks are admitted, before any
        of them closes this group: stop work in the background on this group and its
        sub-groups there (a receive still posted when a peer closes it fails, and says
        so, as a peer's departure). Like any collective, it raises ``PeerFailedError``
        if a rank went meanwhile (even one that finished the last call before it
        died): shrink then, as after a failed step."""
        core = self.core
        if not core.is_world:
            raise ValueError(f"rank {core.rank}: grow: call it on the world group")
        core.check_usable("grow")
        t = core.timeout(timeout_s)
        deadline = time.monotonic() + t
        state = core.state
        root = state.root_store
        if root is None:
            return self  # a singleton: nobody to admit
        slots_total = state.slots_total
        flags = np.zeros(slots_total, np.int64)  # per slot: 1 + the restart count waiting
        if core.rank == 0:
            if wait:
                job = state.job_store
                assert job is not None
                _wait_for_restarts(root, job, state.slots, slots_total, deadline, core.rank)
            for slot in range(slots_total):
                if slot in state.slots:
                    continue
                raw = root.try_get(f"join/{slot}")
                if raw is not None and not root.check([f"admit/{slot}/{int(raw)}"]):
                    flags[slot] = int(raw) + 1
        self.broadcast(flags, 0, timeout_s=t)
        joiners = {int(s): int(f) - 1 for s, f in enumerate(flags) if f}
        if not joiners:
            return self
        if on_admit is not None:  # (before the new group's barrier: so before any close)
            on_admit()
        epoch = state.epoch + 1
        slots = sorted([*state.slots, *joiners])
        cfg = state.config
        if core.rank == 0:
            for slot, restart in joiners.items():
                root.set(f"admit/{slot}/{restart}", json.dumps([epoch, slots]).encode())
        addr, port = cfg.master_addr, state.store_port
        store = Store(addr, port, token=cfg.token, timeout_s=max(0.1, deadline - time.monotonic()),
                      label=f"rank {core.global_rank}", auth=cfg.token is not None)  # fmt: skip
        try:
            return self._next_epoch(store, addr, port, state.server, state.server is not None,
                                    epoch, slots, deadline)  # fmt: skip
        except BaseException:
            store.close()
            raise

    @property
    def slot(self) -> int:
        """This rank's slot: its rank in the first world group (ranks change with shrink
        and grow; slots do not)."""
        return self.core.state.slots[self.core.rank]

    @property
    def slots(self) -> list[int]:
        """The slot of every rank of this world group, in rank order."""
        return list(self.core.state.slots)

    @property
    def rejoined(self) -> bool:
        """True in a restarted process that joined a running job (``grow``)."""
        return self.core.state.rejoined

    @property
    def epoch(self) -> int:
        """How many shrinks and grows led to this world group (0: the first)."""
        return self.core.state.epoch

    def _next_epoch(
        self, store: Store, addr: str, port: int, server: StoreServer | ServerLease | None,
        moved: bool, epoch: int, slots: list[int], deadline: float,
        watch: Callable[[], None] | None = None,
    ) -> ProcessGroup:  # fmt: skip
        """Form the world group of ``slots`` (rank slots, in order) at ``epoch`` through
        ``store`` (a connection of its own, owned by the new group), then close this one."""
        core = self.core
        old = core.state
        cfg = old.config
        me = old.slots[core.rank]
        new_cfg = dataclasses.replace(
            cfg, rank=slots.index(me), world_size=len(slots), master_addr=addr,
            master_port=port, timeout_s=core.timeout_s,
        )  # fmt: skip
        pg = _form(new_cfg, _in(store, old.namespace, f"epoch/{epoch}"), server, port, epoch,
                   watch=watch, namespace=old.namespace)  # fmt: skip
        new = pg.core.state
        new.owned_store = store  # the connection under the view (closed with the group)
        new.recorder = old.recorder  # the flight record goes on across epochs
        new.slots, new.slots_total = list(slots), old.slots_total
        pg.barrier(timeout_s=max(0.1, deadline - time.monotonic()))  # all agreed and formed
        if moved:
            old.server = None  # the new group serves the store now
        core.closed = True
        old.shutdown(DEPART_CLOSE, checkout_s=0.0, linger_s=0.0)  # nobody waits on it now
        core.close_workspace()
        return pg

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


def _enable_log(level: int = logging.DEBUG) -> None:
    """RINGCOMM_LOG=debug (op start/end lines) or info (the group's summary) on stderr
    (unless the app set up logging)."""
    logger = logging.getLogger("ringcomm")
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("ringcomm %(asctime)s %(message)s"))
        logger.addHandler(handler)


def _in(store: Store, namespace: str, sub: str = "") -> Store:
    """The view of ``store`` at ``namespace/sub`` (either may be empty)."""
    prefix = "/".join(p for p in (namespace, sub) if p)
    return store.prefixed(prefix) if prefix else store


def _rejoin(cfg: InitConfig, conn: Store, port: int, namespace: str) -> ProcessGroup:
    """A restarted rank (``RINGCOMM_RESTART`` > 0): ask to join the running job under
    ``join/<slot>`` and wait until the survivors' ``grow()`` admits it
    (``admit/<slot>/<restart>``: the epoch and its rank slots), then form that group.
    Its keys are those of group instance ``namespace`` (the first group a restarted
    process forms joins the survivors' first)."""
    slot, restart = cfg.rank, cfg.restart
    store = _in(conn, namespace)
    store.set(f"join/{slot}", str(restart).encode())
    key = f"admit/{slot}/{restart}"
    try:
        store.wait([key], timeout_s=cfg.timeout_s)
    except CommTimeoutError:
        raise CommTimeoutError(
            f"rank {slot} (restart {restart}): no survivor admitted it within "
            f"{cfg.timeout_s:g} s (the running ranks admit restarted ones when they call "
            "pg.grow(), e.g. at a step boundary)"
        ) from None
    epoch, slots = json.loads(store.get(key))
    new_cfg = dataclasses.replace(cfg, rank=slots.index(slot), world_size=len(slots))
    pg = _form(new_cfg, _in(conn, namespace, f"epoch/{epoch}"), None, port, int(epoch),
               namespace=namespace)  # fmt: skip
    state = pg.core.state
    state.owned_store = conn
    state.slots, state.slots_total, state.rejoined = list(slots), cfg.world_size, True
    pg.barrier()  # as the survivors' grow does
    return pg


def _wait_for_restarts(
    root: Store, job: Store, present: list[int], total: int, deadline: float, rank: int
) -> None:
    """Until every slot the launcher is starting again (``restarting/<slot>`` = n in the
    ``job`` store, where the launcher says it) has asked to join (``join/<slot>`` = n in
    the group's ``root``), or ``deadline``."""
    while True:
        pending = []
        for slot in range(total):
            if slot in present:
                continue
            n = job.try_get(f"restarting/{slot}")
            asked = root.try_get(f"join/{slot}")
            if n is not None and (asked is None or int(asked) < int(n)):
                pending.append(slot)
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise CommTimeoutError(f"rank {rank}: grow: slot(s) {pending} being restarted did "
                                   "not ask to join in time")  # fmt: skip
        try:
            root.wait([f"join/{pending[0]}"], timeout_s=SHRINK_SLICE_S * 5)
        except CommTimeoutError:
            pass


def _wait_all(
    store: Store, keys: list[str], timeout_s: float, watch: Callable[[], None] | None
) -> None:
    """``store.wait(keys)``; with ``watch``, in slices with ``watch()`` between them."""
    if watch is None:
        store.wait(keys, timeout_s=timeout_s)
        return
    give_up = time.monotonic() + timeout_s
    while True:
        left = give_up - time.monotonic()
        try:
            store.wait(keys, timeout_s=max(0.001, min(SHRINK_SLICE_S * 5, left)))
            return
        except CommTimeoutError:
            if left <= SHRINK_SLICE_S * 5:
                raise
        watch()


#: The store key under which rank 0 shares its cost model as the world group forms.
COST_MODEL_KEY = "costmodel"


def _share_cost_model(
    cfg: InitConfig, store: Store | None, watch: Callable[[], None] | None
) -> CostModel | None:
    """Rank 0's cost model (RINGCOMM_TUNE_FILE), the same on every rank (so they choose
    alike even where hosts hold different files): rank 0 reads the file and publishes it,
    or why it is bad, and then raises; the others read that and raise too."""
    if cfg.rank == 0:
        error = None
        try:
            model = load_tune_file(cfg.tune_file, required=cfg.tune_file_required)
        except ValueError as exc:
            model, error = None, str(exc)
        if store is not None:
            shared = {"model": None if model is None else model.to_dict(), "error": error}
            store.set(COST_MODEL_KEY, json.dumps(shared).encode())
        if error is not None:
            raise RendezvousError(f"rank 0: {error}")
        return model
    if store is None:
        return None
    _wait_all(store, [COST_MODEL_KEY], cfg.timeout_s, watch)
    shared = json.loads(store.get(COST_MODEL_KEY))
    if shared["error"] is not None:
        raise RendezvousError(f"rank {cfg.rank}: rank 0's cost model: {shared['error']}")
    return None if shared["model"] is None else CostModel.from_dict(shared["model"])


def _serve_failover(addr: str, ports: list[int], token: str | None, rank: int) -> StoreServer:
    """The shrink's new store, on the first of ``ports`` that is free (one may be any
    socket's local port)."""
    errors = []
    for port in ports:
        try:
            return StoreServer(_bind_host(addr), port, token=token, auth=token is not None).start()
        except RendezvousError as exc:
            errors.append(f"{port}: {exc}")
    raise RendezvousError(f"rank {rank}: shrink: cannot serve the new store on {addr}, "
                          f"ports {ports[0]}..{ports[-1]}: " + "; ".join(errors))  # fmt: skip


def _address_of(info: EndpointInfo) -> str:
    """The host address of a peer, from its tcp:// endpoint."""
    tcp = info.tcp or ""
    host = tcp.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host or "127.0.0.1"


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
    group_name: str | None = None,
) -> ProcessGroup:
    """Join (or form) the world group; see docs/contracts.md (Python API) for where
    values come from.

    Extensions beyond the contract: ``host_store`` (False: a launcher serves the store,
    as ``RINGCOMM_STORE_EXTERNAL=1``), ``chunk_bytes`` (piece size of pipelined
    transfers, an int > 0; default ``RINGCOMM_CHUNK_BYTES``, else 4 MiB), ``transport``
    (``auto``, ``ipc`` or ``tcp``; default ``RINGCOMM_TRANSPORT``, else auto), ``env``
    (where settings are read instead of ``os.environ``), ``group_name`` (the group's key
    namespace in the store; default ``pg<k>`` for the k-th group this process forms at
    that store: see :mod:`ringcomm.rendezvous.meeting`). Every setting is parsed by
    :func:`ringcomm.config.resolve_init_config`; a bad value raises naming it.

    A process may form any number of groups, one after another or side by side; every
    rank forms them in the same order. A rank whose world size, rank or version disagrees
    with the group's makes every rank raise :class:`RendezvousError` naming both values;
    a rendezvous that waits more than a few seconds says once which ranks are missing.
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
    if group_name is not None and (not isinstance(group_name, str) or not group_name.strip("/")):
        raise ValueError(f"group_name must be a non-empty str, got {group_name!r}")
    ns = group_name.strip("/") if group_name is not None else meeting.next_namespace(cfg)
    label = f"rank {cfg.rank}"
    server: ServerLease | None = None
    store: Store | None = None
    try:
        cfg, server = _meet(cfg, ns, label)
        if server is not None:  # rank 0: its store's token (given, or minted there)
            cfg = _security.effective_config(cfg, server.token)
        rejoins = cfg.restart > 0 and cfg.store_external
        if cfg.world_size > 1 and not rejoins:
            join = meeting.join_request(cfg, ns, _VERSION, opens=server is not None)
            store = meeting.connect_and_join(cfg, join, label)
        elif cfg.world_size > 1 or cfg.store_external:
            store = _security.connect_store(cfg, cfg.master_addr, cfg.master_port, label, ns)
        cfg = _security.effective_config(cfg, None if store is None else store.token)
        if rejoins and store is not None:
            return _rejoin(cfg, store, cfg.master_port, ns)
        view = None if store is None else store.prefixed(ns)
        pg = _form(cfg, view, server, cfg.master_port, namespace=ns)
        pg.core.state.owned_store = store
        if cfg.log_info and cfg.rank == 0:  # RINGCOMM_LOG=info: what the group runs on
            _enable_log(logging.INFO)
            logging.getLogger("ringcomm").info("%s", group_summary.describe(pg.core))
        return pg
    except BaseException as exc:
        if store is not None:
            store.close()
        if server is not None:
            meeting.close_hosted(server, exc)
        raise


#: What a rank's join says of its version: the package's and the wire format's.
_VERSION = f"ringcomm {__version__} (wire format {WIRE_VERSION})"


def _meet(cfg: InitConfig, ns: str, label: str) -> tuple[InitConfig, ServerLease | None]:
    """Where group ``ns`` meets: ``cfg`` with the store's address and port, and rank 0's
    lease on the server it hosts (None: a launcher or another process hosts it)."""
    port = cfg.master_port
    if cfg.rank != 0 or cfg.store_external or (cfg.world_size == 1 and port == 0):
        if cfg.torch_store is not None and cfg.world_size > 1 and not cfg.store_external:
            addr, port = meeting.read_address(cfg, ns, label)
            return dataclasses.replace(cfg, master_addr=addr, master_port=port), None
        return cfg, None
    join = meeting.join_request(cfg, ns, _VERSION)
    try:
        server = meeting.serve_store(cfg, _bind_host(cfg.master_addr), port, join, label)
    except RendezvousError as exc:
        if cfg.master_port_origin is None:
            raise RendezvousError(f"{label}: {exc}") from exc
        how = (
            "mpirun -x MASTER_PORT=29500"
            if cfg.source == "mpirun"
            else "export MASTER_PORT=29500 before srun"
        )
        raise RendezvousError(
            f"{label}: {exc}. Port {port} was {cfg.master_port_origin} and is taken: "
            f"set MASTER_PORT (or RINGCOMM_MASTER_PORT) to a free port, e.g. {how}"
        ) from exc
    except (RingcommError, ValueError):
        raise
    except Exception as exc:
        raise RendezvousError(
            f"{label}: cannot serve the rendezvous store on {cfg.master_addr}:{port}: {exc}"
        ) from exc
    if server is None:  # another rank 0 serves it: meet there (and be refused)
        return cfg, None
    port = server.port
    addr = cfg.master_addr
    if cfg.torch_store is not None:
        addr = local_address_towards(cfg.torch_store.host, cfg.torch_store.port) or addr
        theirs = meeting.publish_address(cfg, ns, addr, port, label)
        if theirs is not None:  # another rank 0 published first: meet there
            server.close()
            addr, port = theirs
            return dataclasses.replace(cfg, master_addr=addr, master_port=port), None
    return dataclasses.replace(cfg, master_addr=addr, master_port=port), server


def _form(
    cfg: InitConfig, store: Store | None, server: StoreServer | ServerLease | None, port: int,
    epoch: int = 0, watch: Callable[[], None] | None = None, namespace: str = "",
) -> ProcessGroup:  # fmt: skip
    """Form the world group of ``cfg`` meeting through ``store`` (None: a singleton),
    whose server listens on ``port`` (``server``: here). Steps 3-4 of the module
    docstring; the caller closes ``store`` and ``server`` if this raises. ``watch``:
    called between slices of the wait for the others (it raises to give up).
    ``namespace``: the group instance's keys in the store (what shrink and grow use)."""
    mode = cfg.transport
    label = f"rank {cfg.rank}"
    net: ZmqTransport | None = None
    try:
        tcp_host = local_address_towards(cfg.master_addr, port or 9)
        net = ZmqTransport(
            cfg.rank,
            tcp_host=tcp_host,
            use_ipc=mode != "tcp",
            token=cfg.token,
            security=cfg.security,
            lane=cfg.local_lane,
            shm=cfg.shm,
            max_message_bytes=_security.frame_limit(cfg),
        )
        me = EndpointInfo(
            rank=cfg.rank,
            host_id=cfg.host_id or host_identity(),
            ipc=net.ipc_endpoint,
            tcp=net.tcp_endpoint,
            pid=os.getpid(),
            version=__version__,
            lane=net.lane_endpoint,
            shm=net.shm_enabled,
            workspace=cfg.workspace and WORKSPACE_AVAILABLE,
            salt=net.auth_salt,
        )
        infos = {cfg.rank: me}
        if store is not None:
            store.set(f"rank/{cfg.rank}", json.dumps(me.to_dict()).encode())
            keys = [f"rank/{r}" for r in range(cfg.world_size)]
            try:
                if watch is None:
                    meeting.wait_for_ranks(store, keys, cfg, label)
                else:
                    _wait_all(store, keys, cfg.timeout_s, watch)
            except CommTimeoutError as exc:  # say so if the store turned ranks away
                if server is None or not server.refusals():
                    raise
                raise CommTimeoutError(f"{exc}{server.refusals()}") from exc
        model = _share_cost_model(cfg, store, watch)
        if store is not None:
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
                net.set_peer_endpoint(r, endpoint, info.salt)
                if info.lane is not None and endpoint.startswith("ipc://"):
                    net.set_peer_lane(r, info.lane)
        _security.warn_across_hosts(cfg, infos.values())
        net.connect_all()  # every peer, now: liveness is watched on these connections
        try:
            net.setup_shm([r for r, info in infos.items() if info.shm], cfg.timeout_s)
        except RingcommError as exc:
            raise RendezvousError(str(exc)) from exc  # (it names this rank)
        if binds_to_core(cfg.bind, cfg.local_world_size, len(os.sched_getaffinity(0))):
            _bind_to_core(cfg.local_rank)
        select_device(cfg.local_rank)  # with CuPy: GPU LOCAL_RANK % GPUs, unless chosen
        if cfg.log_debug:
            _enable_log(logging.DEBUG)
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
        state.costmodel = model
        state.epoch = epoch
        state.store_port = port
        state.namespace = namespace
        lifecycle.register(state)  # however the process ends, it leaves (lifecycle.py)
        install_trace_signal(state)  # RINGCOMM_TRACE_DIR: SIGUSR1 writes the flight record
        core = GroupCore(state, range(cfg.world_size), WORLD_GROUP_ID)
        core.workspace = setup_workspace(core)
        return ProcessGroup(core)
    except BaseException:
        if net is not None:
            net.close(0.0)
        raise
