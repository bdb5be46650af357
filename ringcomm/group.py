"""ProcessGroup, the facade users call, and init_process_group, which forms the world group.

A :class:`ProcessGroup` holds a :class:`~ringcomm.core.group_core.GroupCore` (``core``):
identity, tunables, point-to-point, collectives (delegated to :mod:`ringcomm.collectives`,
hierarchically on a group spanning hosts), sub-groups, shrink and grow
(:mod:`ringcomm.core.regroup`), closing. Forming a group: :mod:`ringcomm.core.forming`.

Tag spaces: a message is matched on (source, group id, kind, tag), so point-to-point tags,
collectives (tagged by their sequence number) and sub-groups never collide.
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ringcomm.collectives import api as _collectives
from ringcomm.collectives.hierarchy import Hierarchy
from ringcomm.config import DEFAULT_CHUNK_BYTES, InitConfig, resolve_init_config
from ringcomm.core import forming, lifecycle, regroup
from ringcomm.core import summary as group_summary
from ringcomm.core.buffers import check_array, check_peer, check_tag
from ringcomm.core.group_core import CHECKOUT_MAX_S, GroupCore, workspace_possible
from ringcomm.core.p2p import ANY_SOURCE, AnySource, RecvOp, SendOp
from ringcomm.core.progress import DEPART_CLOSE, DEPART_ERROR
from ringcomm.core.work import Work
from ringcomm.device.p2p import recv_op_class, send_op_class
from ringcomm.errors import (
    CommTimeoutError,
    GroupClosedError,
    PeerFailedError,
)
from ringcomm.rendezvous import Store, meeting
from ringcomm.rendezvous.hosting import ServerLease
from ringcomm.schedule.topology import Topology
from ringcomm.tuning.costmodel import CostModel

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
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not (math.isfinite(value) and value > 0)
        ):
            raise ValueError(
                f"rank {self.core.rank}: timeout_s={value!r} must be a finite number of "
                "seconds > 0 (the default deadline of this group's calls)"
            )
        self.core.timeout_s = float(value)

    @property
    def chunk_bytes(self) -> int:
        """Piece size of this group's pipelined transfers."""
        return self.core.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(
                f"rank {self.core.rank}: chunk_bytes={value!r} must be an int > 0 (the piece "
                "size of this group's pipelined transfers)"
            )
        value = int(value)
        limit = self.core.state.config.max_piece_bytes
        if value > limit:
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

    def _p2p(
        self,
        op: SendOp | RecvOp,
        name: str,
        peer: Any,
        tag: Any,
        timeout_s: float | None,
        async_op: bool,
    ) -> Any:
        """Run a point-to-point op, recorded by the flight recorder (its ``seq`` is the tag;
        ``peers``: the other rank, global, or every rank for an any-source receive)."""
        core = self.core
        recorder = core.state.recorder
        if not recorder.enabled:
            return core.run(op, timeout_s, async_op)
        x = op.x
        anyone = peer is None or peer is ANY_SOURCE
        peers = core.ranks if anyone else (core.ranks[int(peer)],)
        entry: Any = recorder.start(
            core.group_id, int(tag), name, x.dtype, tuple(x.shape), int(x.nbytes), "p2p", peers
        )
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
        return _collectives.scatter(
            self.core, x, src, out, async_op, timeout_s=timeout_s, algo=algo
        )

    def all_to_all(
        self,
        x: Any,
        out: Any = None,
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        algo: str | None = None,
    ) -> Any:
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
        return regroup.shrink(self.core, timeout_s, ProcessGroup)

    def grow(
        self,
        *,
        wait: bool = False,
        timeout_s: float | None = None,
        on_admit: Callable[[], None] | None = None,
    ) -> ProcessGroup:
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
        return regroup.grow(self, wait, timeout_s, on_admit, ProcessGroup)

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
    (the settings to read instead of the process's environment), ``group_name`` (the
    group's key namespace in the store; default ``pg<k>`` for the k-th group this process
    forms at that store: see :mod:`ringcomm.rendezvous.meeting`). Every setting is parsed by
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
        cfg, server = forming.meet(cfg, ns, label)
        cfg, store = forming.connect(cfg, ns, server, label)
        if cfg.restart > 0 and cfg.store_external and store is not None:
            return regroup.rejoin(cfg, store, cfg.master_port, ns, ProcessGroup)
        view = None if store is None else store.prefixed(ns)
        pg = ProcessGroup(forming.form_world(cfg, view, server, cfg.master_port, namespace=ns))
        pg.core.state.owned_store = store
        if cfg.log_info and cfg.rank == 0:  # RINGCOMM_LOG=info: what the group runs on
            forming.enable_log(logging.INFO)
            logging.getLogger("ringcomm").info("%s", group_summary.describe(pg.core))
        return pg
    except BaseException as exc:
        if store is not None:
            store.close()
        if server is not None:
            meeting.close_hosted(server, exc)
        raise
