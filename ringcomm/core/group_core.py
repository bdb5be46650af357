"""The group core: what collectives and point-to-point calls need of a group.

Two public classes, below the collectives (docs/architecture.md) and above the progress engine:

* :class:`ProcessState`: what every group of one process shares (the config, the progress
  engine, the rendezvous store and, on rank 0, its server) and how the process leaves them
  all: ``close()``/``abort()`` of the world group, or the exit hooks of
  :mod:`ringcomm.core.lifecycle`, for which it is the registered leaver.
* :class:`GroupCore`: one group as its calls see it: rank translation, the serial queue of
  its collectives, their per-shape plans and sequence numbers, deadlines, whether it may
  still be used, and running an operation (blocking, or a ``Work``).

``ringcomm.group.ProcessGroup`` is the facade users call; it holds a ``GroupCore`` and
hands it to ``ringcomm.collectives.api``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ringcomm.config import InitConfig, ipc_enabled
from ringcomm.core import lifecycle
from ringcomm.core.deadline import Deadline
from ringcomm.core.flight import FlightRecorder
from ringcomm.core.progress import DEPART_ERROR, Op, Progress, SerialQueue
from ringcomm.core.work import Work
from ringcomm.errors import CommTimeoutError, GroupClosedError, PeerFailedError, RingcommError
from ringcomm.rendezvous import Store, StoreServer
from ringcomm.rendezvous.hosting import ServerLease
from ringcomm.schedule.topology import Topology, topology
from ringcomm.transport import workspace as ws_mod
from ringcomm.transport.endpoints import EndpointInfo, host_identity
from ringcomm.tuning.costmodel import CostModel

__all__ = [
    "CHECKOUT_MAX_S",
    "CULPRIT_WAIT_S",
    "GroupCore",
    "ProcessState",
    "install_trace_signal",
    "setup_workspace",
    "wait_for_exit",
    "wait_in_slices",
    "workspace_possible",
]

WORLD_GROUP_ID = 0


#: Longest close() waits, as the store's host, for every rank to check out.
CHECKOUT_MAX_S = 60.0
#: How often a rank waiting for check-outs looks for goodbyes and failures meanwhile.
_CHECKOUT_SLICE_S = 0.02
#: Longest a rank failing because of a same-host peer waits for that peer's exit.
CULPRIT_WAIT_S = 0.5
#: How much longer a rank waits once its culprit is gone (its status may go through ssh).
CULPRIT_LEAD_S = 0.2


class ProcessState:
    """What all groups of one process share: the engine, the store, the config; and how
    the process leaves them all (``close``/``abort`` of the world group, or the exit
    hooks of :mod:`ringcomm.core.lifecycle`, for which this is the registered leaver)."""

    def __init__(
        self,
        config: InitConfig,
        progress: Progress,
        store: Store | None,
        server: StoreServer | ServerLease | None,
        chunk_bytes: int,
    ) -> None:
        self.config = config
        self.progress = progress
        self.store = store
        self.server = server
        self.chunk_bytes = chunk_bytes
        self.closed = False
        self.lock = threading.Lock()
        #: Every rank's published endpoint info (pid, host), by global rank.
        self.peers: dict[int, EndpointInfo] = {}
        self.host_id = config.host_id or host_identity()
        #: How many shrinks made this world group (0: the one init_process_group formed),
        #: and the port its store listens on (ringcomm.core.regroup).
        self.epoch = 0
        self.store_port = config.master_port
        #: The store connection under ``store`` when that is a prefixed view of it (every
        #: group's: its namespace, and a shrunk group's epoch in it): closed with the group.
        self.owned_store: Store | None = None
        #: This group instance's key namespace in the store (``pg0``...:
        #: ringcomm.rendezvous.meeting); shrink and grow keep their keys in it too.
        self.namespace = ""
        #: The rank slot of each rank of this world group (its rank in the first one),
        #: how many slots the job has, and whether this process rejoined (``grow``).
        self.slots: list[int] = list(range(config.world_size))
        self.slots_total = config.world_size
        self.rejoined = False
        #: The cost model the group's calls choose algorithms with (RINGCOMM_TUNE_FILE:
        #: rank 0's, shared when the world group formed); None: the measured switch points.
        self.costmodel: CostModel | None = None
        #: This process's last operations (ringcomm.core.flight; RINGCOMM_TRACE_*).
        self.recorder = FlightRecorder(
            config.trace_entries, config.rank, config.trace_dir, config.trace_at_close
        )
        #: Why the flight record was first written (a failed call, usually); the record
        #: written when the process ends without close() keeps it in its reason.
        self.first_dump_reason: str | None = None

    @property
    def job_store(self) -> Store | None:
        """The store connection itself, every key as named (a launcher's among them)."""
        return self.owned_store if self.owned_store is not None else self.store

    @property
    def root_store(self) -> Store | None:
        """This group instance's namespace of the store, outside the keys of its epoch (a
        shrunk or grown group's ``store`` is a prefixed view of it)."""
        conn = self.job_store
        if conn is None or not self.namespace or self.owned_store is None:
            return conn
        return conn.prefixed(self.namespace)

    def dump_trace(self, reason: str) -> Path | None:
        """Write the flight record (if ``RINGCOMM_TRACE_DIR`` is set), with where the
        progress engine's operations are; the file written, or None."""
        if self.recorder.trace_dir is None:
            return None
        if self.first_dump_reason is None:
            self.first_dump_reason = reason
        context: dict[str, Any] = {"world_size": self.config.world_size}
        try:
            context["engine"] = self.progress.where()
        except Exception:  # noqa: BLE001 (a dump never fails the caller)
            context["engine"] = "unknown"
        return self.recorder.dump(reason, context)

    # -- lifecycle.Leaver --------------------------------------------------------------
    def leave(self, kind: str, why: str, budget_s: float) -> None:
        """The process ends without ``close()`` (lifecycle.py): leave within ``budget_s``."""
        if not self.closed and kind != DEPART_ERROR:  # (shutdown dumps an error's itself)
            earlier = self.first_dump_reason
            self.dump_trace(
                "the process ended without close()"
                + (f" (first written for: {earlier})" if earlier else "")
            )
        self.shutdown(kind, why, checkout_s=budget_s / 3, linger_s=budget_s / 3)

    def farewell(self, why: str) -> None:
        """From a signal handler: tell the peers, remove our files; nothing else."""
        if self.closed:
            return
        self.closed = True
        self.progress.farewell(why, skip=self._gone)
        self.progress.transport.remove_files()

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
    def shutdown(self, kind: str, why: str = "", *, checkout_s: float, linger_s: float) -> None:
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
        if kind == DEPART_ERROR:
            self.dump_trace(f"abort: {why}")
        elif self.recorder.at_close:
            self.dump_trace("close()")
        progress, store, server = self.progress, self.store, self.server
        rank = self.config.rank
        try:
            if kind == DEPART_ERROR:
                progress.farewell(why, skip=self._gone)
                self._let_culprit_go_first()
            progress.abort(
                lambda op: GroupClosedError(f"rank {rank}: {op.desc}: the group was closed first")
            )
            if kind != DEPART_ERROR:
                progress.read_control()  # who left or failed meanwhile
                if progress.failure is None:
                    progress.say_goodbye(linger_s, kind)  # peers waiting on us fail now
                if store is not None and progress.failure is None and checkout_s > 0:
                    self._check_out(store, server, checkout_s)
        finally:
            failed = kind == DEPART_ERROR or progress.failure is not None
            progress.close(0.0 if failed else linger_s, kind)
            if store is not None:
                store.close()
            if self.owned_store is not None:
                self.owned_store.close()
            if server is not None:
                server.close()

    def _let_culprit_go_first(self) -> None:
        """This rank fails because a peer did: wait (briefly) until that peer's process
        is gone (its pid on this host, its connection elsewhere), so a launcher sees the
        culprit's exit first and reports its exit code, not this victim's."""
        failure = self.progress.failure
        peer = getattr(failure, "peer", None)
        if not isinstance(peer, int):
            return
        info = self.peers.get(peer)
        if info is None or (info.pid == os.getpid() and info.host_id == self.host_id):
            return
        if info.host_id == self.host_id:
            gone = wait_for_exit(info.pid, CULPRIT_WAIT_S)
        else:
            gone = self.progress.wait_disconnected(peer, CULPRIT_WAIT_S)
        if gone:
            # Its exit status may still travel to the launcher (a watchdog polling every
            # 50 ms, an ssh session ending): give it a head start.
            time.sleep(CULPRIT_LEAD_S)

    def _check_out(
        self, store: Store, server: StoreServer | ServerLease | None, limit_s: float
    ) -> None:
        """Count this rank out of the store. Its host keeps serving until every rank has
        checked out (a rank may still be reading its last rendezvous reply), at most
        ``limit_s``, and no longer once a rank is gone (it will never check out)."""
        progress = self.progress
        world = self.config.world_size
        if not self.config.store_external and progress.departed(0) and server is None:
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
                progress.read_control()
                if progress.failure is not None or all(
                    progress.departed(r) for r in range(world) if r != self.config.rank
                ):
                    return  # a rank failed (it never checks out), or everyone left
        except RingcommError:
            pass  # best effort: the store or its host may be gone


def install_trace_signal(state: ProcessState) -> None:
    """With ``RINGCOMM_TRACE_DIR`` set: SIGUSR1 writes ``state``'s flight record (when
    SIGUSR1's handler is the default, or one installed here, and this is the main
    thread). The handler holds the state weakly (a closed group's record stays readable)."""
    sig = getattr(signal, "SIGUSR1", None)
    if sig is None or state.recorder.trace_dir is None:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(sig)
    if current is not signal.SIG_DFL and not getattr(current, "ringcomm_trace", False):
        return  # the application's own handler stays
    ref = weakref.ref(state)

    def on_usr1(signum: int, frame: object) -> None:
        target = ref()
        if target is not None:
            target.dump_trace("SIGUSR1")

    on_usr1.ringcomm_trace = True  # type: ignore[attr-defined]
    signal.signal(sig, on_usr1)


class GroupCore:
    """One group of this process, as its calls see it (module docstring).

    Ranks are ranks *of this group* (0..world_size-1) unless named global.
    """

    def __init__(self, state: ProcessState, ranks: Sequence[int], group_id: int) -> None:
        self.state = state
        self.progress: Progress = state.progress
        self.ranks: tuple[int, ...] = tuple(ranks)  # group rank -> global rank
        self.group_id = group_id
        me = state.config.rank
        self.rank = self.ranks.index(me)
        self.world_size = len(self.ranks)
        self.global_rank = me
        self.timeout_s: float = state.config.timeout_s
        self.chunk_bytes: int = state.chunk_bytes
        self.serial = SerialQueue()
        #: The group's last asynchronous collective handed to the engine (a weak
        #: reference: a finished op must not outlive its call), until a call on the
        #: workspace takes it to wait for it first: the engine may not have admitted it to
        #: ``serial`` yet when another thread drives.
        self.engine_tail: weakref.ref[Op] | None = None
        #: Per-call-shape state of this group's collectives (collectives.base.ShapeCache).
        self.plans: dict[Any, Any] = {}
        self.closed = False
        #: The error of a collective that failed here: the group stays failed.
        self.failed: BaseException | None = None
        #: The sequence number of this group's latest collective (0: none yet); a plain
        #: attribute, read on every call by the flight recorder (a property costs more).
        self.collective_seq = 0
        self._subgroup_count = 0
        #: The shared workspace of a group on one host (:func:`setup_workspace`), and the
        #: collectives' state on it (ringcomm.collectives.workspace, made on first use).
        self.workspace: ws_mod.Workspace | None = None
        self.workspace_calls: Any = None
        #: The choices of the cost model for this group's world shape
        #: (ringcomm.collectives.chooser.ModelChooser, made at its first call), if any.
        self.chooser: Any = None
        #: The algorithm of this group's latest collective (``ringcomm bench``'s "algo").
        self.last_algo = ""
        #: Whether device arrays take device windows (``ipc``) on a group of one host
        #: (``RINGCOMM_IPC``; the bench's ``host-staged`` rows turn it off for their calls).
        self.device_windows = ipc_enabled()
        #: A sub-group that may have a workspace sets it up at its first collective
        #: (every member is in that call; ``new_group`` itself stays local).
        self.workspace_pending = False
        self._topology: Topology | None = None
        self._ring_order: tuple[int, ...] | None = None
        #: Makes the hierarchical collectives of a group spanning hosts (set by the facade:
        #: ringcomm.collectives.hierarchy over its sub-groups); :meth:`hierarchy` keeps one.
        self.make_hierarchy: Callable[[], Any] | None = None
        self._hierarchy: Any = None

    @property
    def topology(self) -> Topology:
        """Which of this group's ranks share a host (from every rank's published host
        identity, so the same on every rank), made at first use."""
        topo = self._topology
        if topo is None:
            peers, me = self.state.peers, self.state.host_id
            topo = topology([peers[g].host_id if g in peers else me for g in self.ranks])
            order = topo.ring_order
            self._ring_order = None if order == tuple(range(self.world_size)) else order
            self._topology = topo
        return topo

    @property
    def ring_order(self) -> tuple[int, ...] | None:
        """The order the ring collectives visit this group's ranks: host by host
        (:attr:`Topology.ring_order`), so a ring crosses each host boundary once whatever
        the launcher's rank order; None where that is rank order itself."""
        if self._topology is None:
            self.topology  # noqa: B018 (made on first use)
        return self._ring_order

    def close_workspace(self) -> None:
        """Unmap the workspace (the group is closed: no call uses it any more)."""
        calls, ws = self.workspace_calls, self.workspace
        self.workspace_calls = self.workspace = None
        if calls is not None:
            calls.close()
        elif ws is not None:
            ws.close()

    @property
    def config(self) -> InitConfig:
        return self.state.config

    def describe(self) -> str:
        """``rank 1 of group 12345`` (or ``of the world group``), for messages."""
        where = "the world group" if self.is_world else f"group {self.group_id}"
        return f"rank {self.rank} of {where}"

    @property
    def is_world(self) -> bool:
        return self.group_id == WORLD_GROUP_ID

    def check_usable(self, what: str) -> None:
        """Raise if a call named ``what`` may not run: the group is closed, or failed."""
        if self.closed or self.state.closed:
            raise GroupClosedError(f"rank {self.rank}: {what}: the process group is closed")
        progress = self.progress
        if progress.failure is not None:  # a peer failed: this and every later call raise
            raise progress.failed_error(what)
        aborts = progress.group_aborts
        if (
            aborts
            and self.group_id in aborts
            and aborts[self.group_id][0] <= self.collective_seq + 1
        ):
            # A peer failed a collective this rank has reached: it fails here too.
            raise progress.abort_error(self.group_id, what)
        if self.failed is not None:
            raise GroupClosedError(
                f"rank {self.rank}: {what}: the process group failed earlier and stays "
                f"failed: {self.failed}"
            ) from self.failed

    def timeout(self, timeout_s: float | None) -> float:
        """The time limit of a call: ``timeout_s``, or the group's default."""
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        if not t > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        return t

    def deadline(self, timeout_s: float | None, start: float | None = None) -> Deadline:
        """The deadline of a call (``timeout_s``, or the group's default) from ``start``
        (a ``time.monotonic()`` instant; None: now): made once, where the call enters."""
        return Deadline(self.timeout_s if timeout_s is None else float(timeout_s), start)

    def run(self, op: Op, timeout_s: float | None, async_op: bool) -> Any:
        """:meth:`run_until` the deadline ``timeout_s`` (or the group's default) from now."""
        return self.run_until(op, self.deadline(timeout_s), async_op)

    def run_until(self, op: Op, deadline: Deadline, async_op: bool) -> Any:
        """Submit ``op`` (unless a fast lane started it already); wait for it (blocking,
        until ``deadline``) or return its Work (which waits ``deadline.timeout_s`` from its
        ``wait()``). A failed op whose class says so (``Op.fails_group``: collectives)
        fails the group."""
        if not op.started:
            self.progress.submit(op)
        if async_op:
            return Work(self.progress, op, deadline.timeout_s)
        try:
            return self.progress.wait(op, deadline.timeout_s, deadline.at)
        except RingcommError as exc:
            if op.fails_group and self.failed is None:
                self.failed = exc
            raise

    def hierarchy(self) -> Any:
        """The hierarchical collectives of this group (``make_hierarchy``'s), made at
        their first call (every rank of the group makes their sub-groups then)."""
        if self._hierarchy is None:
            if self.make_hierarchy is None:
                raise RingcommError(f"{self.describe()}: no hierarchy (a group without its facade)")
            self._hierarchy = self.make_hierarchy()
        return self._hierarchy

    def next_collective_seq(self) -> int:
        """Sequence number tagging the next collective (all ranks call them in one order)."""
        self.collective_seq += 1
        return self.collective_seq

    def next_subgroup_index(self) -> int:
        """How many sub-groups this group has made, this one included (their ids)."""
        self._subgroup_count += 1
        return self._subgroup_count

    def sub(self, global_ranks: Sequence[int], group_id: int) -> GroupCore:
        """The core of a sub-group of this process (same state, deadline and piece size)."""
        sub = GroupCore(self.state, global_ranks, group_id)
        sub.timeout_s = self.timeout_s
        sub.chunk_bytes = self.chunk_bytes
        sub.device_windows = self.device_windows
        return sub


def workspace_possible(core: GroupCore) -> bool:
    """Whether ``core``'s group can have a workspace: all its ranks on this host, each
    taking part (``RINGCOMM_WORKSPACE``), a store to agree through. Pure: every member
    computes the same answer from the endpoints published at rendezvous."""
    state = core.state
    if core.world_size < 2 or state.store is None or not ws_mod.AVAILABLE:
        return False
    if not state.config.workspace:
        return False
    infos = [state.peers.get(g) for g in core.ranks]
    return all(i is not None and i.host_id == state.host_id and i.workspace for i in infos)


def setup_workspace(core: GroupCore, timeout_s: float | None = None) -> ws_mod.Workspace | None:
    """The shared workspace of ``core``'s group (:func:`workspace_possible`), else None.
    Every member calls it at the same point (group formation, or a sub-group's first
    collective); they agree through the store, so all get one or none.

    Rank 0 of the group makes the segment (a memfd) and publishes its pid and descriptor;
    the others open it through ``/proc/<pid>/fd``; each says whether that worked.
    """
    if not workspace_possible(core) or core.state.store is None:
        return None
    what = f"{core.describe()}: setting up its workspace"
    t = core.timeout_s if timeout_s is None else timeout_s
    try:
        return _setup_workspace(core, core.state.store, what, t)
    except RingcommError as exc:
        # The store lost (its host went down) or a member late: if a peer failed or left,
        # say so as every other call does (its goodbye may still be on its way).
        give_up = time.monotonic() + _GOODBYE_WAIT_S
        while True:
            last = time.monotonic() >= give_up
            trouble = _peer_trouble(core, what, store_host_only=not last)
            if trouble is not None:
                raise trouble from exc
            if last:
                raise
            time.sleep(0.005)


#: How long a failed workspace setup looks for a peer's goodbye that explains it.
_GOODBYE_WAIT_S = 0.5
#: Slices of a workspace setup's store waits (between them it looks at its peers).
_SETUP_SLICE_S = 0.05


def _peer_trouble(
    core: GroupCore, what: str, store_host_only: bool = False
) -> RingcommError | None:
    """The error a call of ``core`` raises now because a peer failed or left (None: none
    did). ``store_host_only``: only the store's host leaving counts (it took the store)."""
    progress = core.progress
    progress.poll_now()
    if progress.failure is not None:
        return progress.failed_error(what)
    gone = [g for g in core.ranks if g != core.global_rank and progress.departed(g)]
    host = None if core.config.store_external else WORLD_GROUP_ID
    if store_host_only:
        gone = [g for g in gone if g == host]
    if not gone and not store_host_only:  # ended without a goodbye (same host: its pid)
        dead = [
            g
            for g in core.ranks
            if g != core.global_rank
            and g in core.state.peers
            and wait_for_exit(core.state.peers[g].pid, 0.0)
        ]
        if dead:
            g = host if host in dead else dead[0]
            progress.peer_failed(
                PeerFailedError(
                    f"rank {core.global_rank}: peer rank {g} failed: its connection dropped "
                    "without a goodbye (its process ended: killed or crashed)",
                    peer=g,
                )
            )
            return progress.failed_error(what)
    if not gone:
        return None
    g = host if host in gone else gone[0]
    return PeerFailedError(
        f"{what}: peer rank {g} left the group ({progress.departure_note(g)})", peer=g
    )


def wait_in_slices(
    store: Store,
    keys: list[str],
    deadline: float,
    slice_s: float,
    watch: Callable[[bool], None],
) -> None:
    """``store.wait(keys)`` until ``deadline`` (``time.monotonic()``), in slices of at most
    ``slice_s``, with ``watch(last)`` after each slice that times out: it may raise; if it
    does not, the last slice (``last``: the deadline came) raises the store's timeout."""
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, timeout_s=max(0.001, min(slice_s, left)))
            return
        except CommTimeoutError:
            if left <= slice_s:
                watch(True)
                raise
        watch(False)


def _wait_keys(
    core: GroupCore,
    store: Store,
    keys: list[str],
    ranks: list[int],
    deadline: float,
    what: str,
    timeout_s: float,
) -> None:
    """``store.wait(keys)`` (set by ``ranks``) until ``deadline``, looking at the peers
    between slices."""

    def watch(last: bool) -> None:
        trouble = _peer_trouble(core, what)
        if trouble is not None:
            raise trouble from None
        if last:
            late = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
            raise CommTimeoutError(
                f"{what} (at its first collective) timed out after {timeout_s:g} s: "
                f"waiting for rank{'s' if len(late) > 1 else ''} "
                f"{', '.join(map(str, late))} at the setup of the workspace"
            ) from None

    wait_in_slices(store, keys, deadline, _SETUP_SLICE_S, watch)


def _setup_workspace(
    core: GroupCore, store: Store, what: str, timeout_s: float
) -> ws_mod.Workspace | None:
    state, n = core.state, core.world_size
    pids = [state.peers[g].pid for g in core.ranks]
    key = f"workspace/{core.group_id}"
    size = ws_mod.segment_bytes(n)
    deadline = time.monotonic() + timeout_s
    fd: int | None = None
    if core.rank == 0:
        try:
            fd = ws_mod.create_segment(n)
            store.set(key, f"{os.getpid()}:{fd}".encode())
        except OSError:
            store.set(key, b"none")
    else:
        _wait_keys(core, store, [key], [0], deadline, what, timeout_s)
        text = store.get(key).decode()
        if text != "none":
            pid, theirs = (int(v) for v in text.split(":"))
            try:
                fd = ws_mod.open_segment(pid, theirs, size)
            except OSError:
                fd = None
    store.set(f"{key}/{core.rank}", b"1" if fd is not None else b"0")
    keys = [f"{key}/{r}" for r in range(n)]
    _wait_keys(core, store, keys, list(range(n)), deadline, what, timeout_s)
    if any(store.get(k) != b"1" for k in keys):
        if fd is not None:
            os.close(fd)
        return None
    assert fd is not None
    return ws_mod.Workspace(fd, core.rank, n, pids)


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for process ``pid`` (of this host) to end; True if it did."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # gone already (and reaped by its parent)
    except (OSError, AttributeError):
        return False  # no pidfds here: do not wait
    try:
        import select

        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)
