"""Collectives of a group whose ranks share one host, through its shared workspace: the engine.

No ring, no socket: each rank copies its input into its own buffer of the workspace
(:mod:`ringcomm.transport.workspace`), the ranks sync, and each reads what it needs straight
from the others' buffers. :class:`WorkspaceCollectives` runs one call at a time: its queue
and worker, the fingerprints (:mod:`~ringcomm.collectives.shm_fingerprint`), the syncs and
how a failure spreads, the buffers and symmetric windows. The host algorithms (``shm``) are
in :mod:`~ringcomm.collectives.shm_reduce`, :mod:`~ringcomm.collectives.shm_gather` and
:mod:`~ringcomm.collectives.shm_alltoall`; other algorithms (``ipc``) plug in as
:attr:`WorkspaceCollectives.extensions`. Guarantees: every rank checks the fingerprints
before any user byte is read, so a mismatch raises on every rank; a call that fails on one
rank fails on every rank (never completed from stale buffers); a dead or departed peer, or
the deadline, raises naming whom it waited for and where. docs/architecture.md ("The shared
workspace's collectives") has the protocol.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from ringcomm.collectives import shm_alltoall, shm_gather, shm_reduce
from ringcomm.collectives.base import Call
from ringcomm.collectives.shm_base import HostCall, Job, barrier
from ringcomm.collectives.shm_fingerprint import (
    AREA_WORDS,
    DIGEST,
    SEQ,
    SYM,
    area,
    describe_words,
    fingerprint_row,
    first_mismatch,
)
from ringcomm.collectives.shm_reduce import SMALL_ALL_REDUCE_BYTES
from ringcomm.core.progress import Op
from ringcomm.core.work import Work
from ringcomm.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    GroupClosedError,
    PeerFailedError,
    RingcommError,
)
from ringcomm.transport import workspace as ws_mod
from ringcomm.transport.workspace import LINE_WORDS, Window, Workspace, WorkspaceTimeout

if TYPE_CHECKING:
    from ringcomm.core.group_core import GroupCore

log = logging.getLogger("ringcomm")

__all__ = [
    "GOODBYE_WAIT_S",
    "HOST_CALLS",
    "REASON_WAIT_S",
    "SMALL_ALL_REDUCE_BYTES",
    "Job",
    "WorkspaceCollectives",
    "WorkspaceOp",
]

#: How long a rank that found a peer's process gone waits for that peer's goodbye (which
#: says why it went) before it reports the death itself.
GOODBYE_WAIT_S = 0.1
#: How long a rank that saw a peer's failure mark waits for the reason to arrive (the
#: peer's abort, or the news of the rank that went; each follows the mark at once).
REASON_WAIT_S = 1.0
_ROOT_SENDS = ("broadcast", "scatter")  # only the root's input travels

#: The host algorithm (``shm``) of each collective.
HOST_CALLS: dict[str, HostCall] = {
    "all_reduce": shm_reduce.all_reduce,
    "reduce_scatter": shm_reduce.reduce_scatter,
    "reduce": shm_reduce.reduce,
    "all_gather": shm_gather.all_gather,
    "gather": shm_gather.gather,
    "broadcast": shm_gather.broadcast,
    "scatter": shm_alltoall.scatter,
    "all_to_all": shm_alltoall.all_to_all,
    "barrier": barrier,
}


class WorkspaceOp(Op):
    """A queued (asynchronous) call as an :class:`~ringcomm.core.progress.Op`, so that a
    ``Work`` waits on it; never submitted to the engine."""

    def __init__(self, runner: WorkspaceCollectives, job: Job) -> None:
        super().__init__(runner.core.progress)
        self.runner: WorkspaceCollectives | None = runner
        self.job: Job | None = job
        self._desc = job.desc  # (kept: the job goes once it is done)
        self.started = True  # the engine never starts it
        self._finished = threading.Event()

    def release(self) -> None:
        super().release()
        self.job = self.runner = None  # nothing of the caller's but the result stays

    def finish(self, error: BaseException | None = None) -> None:
        super().finish(error)
        self._finished.set()

    def wait_done(self, deadline: float) -> None:
        """Wait (on the worker) until done or ``deadline`` (``time.monotonic()``)."""
        self._finished.wait(max(0.0, deadline - time.monotonic()))

    def progress_note(self) -> str:
        return "" if self.job is None else self.job.note

    def execute(self) -> None:
        """Run the call here; ``result`` or ``error`` set, ``done`` True."""
        assert self.runner is not None and self.job is not None
        try:
            result = self.runner.execute(self.job)
        except BaseException as exc:  # noqa: BLE001 (the op carries it to its caller)
            self.finish(exc)
            return
        self.result = result
        self.finish()


class WorkspaceCollectives:
    """A group's collectives on its workspace (one per :class:`GroupCore` that has one)."""

    def __init__(self, core: GroupCore, workspace: Workspace) -> None:
        self.core = core
        self.ws = workspace
        self.round = 0  # rounds so far: buffer round % 2 is this round's
        self._fp_base = area(0)  # where the current call's fingerprint sits in each line
        #: Symmetric allocations (:meth:`alloc`), in the order made.
        self.windows: list[Window] = []
        self._lock = threading.Lock()  # one call at a time on the workspace
        self._queue: deque[WorkspaceOp] = deque()
        self._cv = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False
        # Per call shape: its fingerprint row; per (buffer, dtype, count): the views.
        self._rows: dict[tuple[Any, ...], tuple[np.ndarray, int]] = {}
        self._published: list[tuple[Any, ...] | None] = [None, None]  # per area
        self._views: dict[tuple[int, np.dtype[Any], int], list[np.ndarray]] = {}
        self._digest = 0
        #: Bytes this rank contributed to its collectives here (its inputs: the workspace's
        #: counterpart of bytes sent).
        self.moved_bytes = 0
        #: all_reduce calls that read this rank's x in place from its window.
        self.in_place_calls = 0
        #: Algorithms other than ``shm`` that run on this workspace's syncs (by name: a
        #: call whose ``algo`` is a key runs ``extensions[algo].execute(job, call)`` under
        #: the same lock, queue, fingerprints and failure handling), e.g. ``ipc``
        #: (ringcomm.collectives.ipc); each is closed with the workspace.
        self.extensions: dict[str, Any] = {}

    # -- entry ---------------------------------------------------------------------------
    def run(
        self,
        call: Call,
        seq: int,
        timeout_s: float,
        async_op: bool,
        start_s: float | None = None,
        device: Any = None,
    ) -> Any:
        """Run ``call`` here, now (or queue it behind earlier asynchronous ones); its
        deadline counts from ``start_s`` (``time.monotonic()``; default: now). ``device``:
        what a device algorithm took at the call (:attr:`Job.device`)."""
        if start_s is None:
            start_s = time.monotonic()
        core = self.core
        job = Job(core, call, seq, start_s + timeout_s, timeout_s, device, core.engine_tail)
        core.engine_tail = None  # (this job waits for it; later ones run after this one)
        if not async_op:
            with self._cv:
                busy = bool(self._queue) or self._worker_busy
            if not busy:  # the common case: here, now
                with self._lock:
                    return self.execute(job)
        op = WorkspaceOp(self, job)
        with self._cv:
            self._queue.append(op)
            self._ensure_worker()
            self._cv.notify()
        if async_op:
            return Work(self.core.progress, op, timeout_s)
        op.wait_done(job.deadline + 1.0)
        if not op.done:
            raise CommTimeoutError(
                f"rank {self.core.rank}: {job.desc} timed out after {timeout_s:g} s "
                "behind earlier asynchronous collectives"
            )
        if op.error is not None:
            raise op.error
        return op.result

    _worker_busy = False

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._work, name=f"ringcomm-workspace-{self.core.group_id}", daemon=True
            )
            self._worker.start()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                op = self._queue.popleft()
                self._worker_busy = True
            try:
                with self._lock:
                    op.execute()
                del op  # a finished op must not outlive its call here (its result is the caller's)
                self.core.progress.transport.wake()  # a waiter may sit in the engine's poll
            finally:
                with self._cv:
                    self._worker_busy = False
                    self._cv.notify_all()

    # -- symmetric buffers ---------------------------------------------------------------
    def alloc(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """A zeroed array of ``shape`` and ``dtype`` in a new window every rank of the
        group maps (each rank calls it, in the same order: rank 0 makes the segment)."""
        core = self.core
        store = core.state.store
        assert store is not None
        n, index = core.world_size, len(self.windows)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        key = f"workspace/{core.group_id}/window/{index}"
        fd: int | None = None
        if core.rank == 0:
            fd, part = ws_mod.create_window(n, nbytes)
            store.set(key, f"{os.getpid()}:{fd}:{part}".encode())
        else:
            store.wait([key], timeout_s=core.timeout_s)
            pid, theirs, part = (int(v) for v in store.get(key).decode().split(":"))
            fd = ws_mod.open_segment(pid, theirs, n * part)
        # Rank 0 keeps its descriptor open until every rank has opened the segment.
        if core.rank == 0:
            store.wait([f"{key}/{r}" for r in range(1, n)], timeout_s=core.timeout_s)
        else:
            store.set(f"{key}/{core.rank}", b"1")
        window = Window(fd, n, part, index)
        self.windows.append(window)
        return window.parts[core.rank][:nbytes].view(dtype).reshape(shape)

    def symmetric(self, x: np.ndarray) -> tuple[int, int]:
        """(window index + 1, offset) of ``x`` in one of the windows, or (0, 0)."""
        if not self.windows:
            return 0, 0
        address = int(x.ctypes.data)
        for w in self.windows:
            offset = w.locate(self.ws.rank, address, x.nbytes)
            if offset is not None:
                return w.index + 1, offset
        return 0, 0

    def drain(self, timeout_s: float) -> None:
        """Wait until every call queued here finished (a collective of this group that
        goes another way runs after them: a group's collectives run in the order called)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._worker_busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(
                        f"rank {self.core.rank}: collectives queued on the shared workspace "
                        f"did not finish within {timeout_s:g} s"
                    )
                self._cv.wait(left)

    def _after_earlier(self, op: Job) -> None:
        """Wait for this group's earlier collectives that went through the engine: the
        last one admitted to its serial queue, and the one called just before ``op``
        (:attr:`Job.after`), which the engine may not have admitted yet."""
        serial = self.core.serial
        last = serial.pending[-1] if serial.pending else serial.active
        after = None if op.after is None else op.after()
        if after is None and (last is None or last.done):
            return  # the common case: nothing before it on the engine
        waited = False
        for earlier in (after, last):
            if earlier is not None and not earlier.done:
                waited = True
                try:
                    self.core.progress.wait(earlier, op.timeout_s, op.deadline)
                except RingcommError:
                    pass
        if waited:
            self.core.check_usable(op.call.name)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for ext in self.extensions.values():
            ext.close()
        self.ws.close()

    # -- what the algorithms use (shm here, and the extensions: ringcomm.collectives.ipc) --
    def buffer(self, rank: int, b: int) -> np.ndarray:
        """Rank ``rank``'s host buffer ``b`` (uint8), e.g. for small control data."""
        return self.ws.buffers[rank][b]

    def run_host(self, job: Job, call: Call) -> Any:
        """Run ``call`` (host arrays) with the ``shm`` algorithm, inside a running job."""
        return HOST_CALLS[call.name](self, job, call)

    # -- the calls -----------------------------------------------------------------------
    def execute(self, op: Job) -> Any:
        """Run a call (under ``_lock``); a failure other than a mismatch leaves the group
        failed (a dead peer fails the whole engine, as over the socket)."""
        call = op.call
        progress = self.core.progress
        if progress.log_ops:
            log.debug("rank %d: start %s", progress.rank, op.desc)
        try:
            self._after_earlier(op)
            ext = self.extensions.get(call.algo)
            result = ext.execute(op, call) if ext is not None else self.run_host(op, call)
            x = call.x
            sends = call.root is None or call.name not in _ROOT_SENDS or call.root == self.ws.rank
            if x is not None and sends:
                self.moved_bytes += int(x.nbytes)
        except RingcommError as exc:
            engine = isinstance(exc, PeerFailedError) and progress.failure is not None
            if not engine and self.core.failed is None:
                self.core.failed = exc
            if not isinstance(exc, GroupClosedError):
                # Peers must not complete it: tell them (the reason), then mark it.
                core = self.core
                progress.collective_failed(core.group_id, op.seq, exc, core.ranks)
                if not self.ws.closed:
                    self.ws.mark_failed(op.seq)
            if progress.log_ops:
                log.debug("rank %d: failed %s: %s", progress.rank, op.desc, exc)
            raise
        if progress.log_ops:
            log.debug("rank %d: end %s", progress.rank, op.desc)
        return result

    def sync(self, op: Job, where: str) -> None:
        """Arrive at the next synchronisation and wait for every rank (``where`` names it
        in a timeout's message); raises as any call here does."""
        ws = self.ws
        k = ws.arrive()
        if ws.complete(k):
            ws.wait(k, op.deadline, _never)  # rings for sleepers
        else:
            op.note = where
            try:
                ws.wait(k, op.deadline, lambda: self._idle(op, k, where))
            except WorkspaceTimeout:
                late = ws.late(k)
                raise CommTimeoutError(
                    f"rank {self.core.rank}: {op.desc} timed out after {op.timeout_s:g} s: "
                    f"waiting for rank{'s' if len(late) > 1 else ''} "
                    f"{', '.join(map(str, late))} at {where}; " + self._last_calls(late)
                ) from None
        failed = ws.failed_peer(op.seq)
        if failed is not None:  # a peer failed this call (or an earlier one): so do we
            raise self._failed_at_peer(op, *failed, k, where)

    def _failed_at_peer(self, op: Job, r: int, seq: int, k: int, where: str) -> RingcommError:
        """The error of a call that group rank ``r`` failed (as collective ``seq``): the
        reason it comes with, once known here: its abort (which follows the mark at once),
        or, when a peer went (its departure or failure, which the engine reports on its
        own), that; else a plain one."""
        core = self.core
        progress = core.progress
        give_up = time.monotonic() + REASON_WAIT_S
        while True:
            progress.poll_now()
            if core.group_id in progress.group_aborts:
                return progress.abort_error(core.group_id, op.desc)
            try:
                self._idle(op, k, where, marks=False)  # a peer gone: its own story
            except RingcommError as exc:
                return exc
            if time.monotonic() >= give_up:
                break
            time.sleep(0.002)
        return PeerFailedError(
            f"rank {core.rank}: {op.desc}: rank {r} failed collective #{seq} of this group, "
            "so every rank fails it (its reason did not arrive)",
            peer=core.ranks[r],
        )

    def _last_calls(self, ranks: list[int]) -> str:
        """What each of ``ranks`` last started here (its newer fingerprint)."""
        lines = self.ws.lines
        parts = []
        for r in ranks:
            areas = [lines[r, area(a) : area(a) + AREA_WORDS] for a in (0, 1)]
            newest = max(areas, key=lambda fp: int(fp[SEQ]))
            if int(newest[SEQ]) == 0:
                parts.append(f"rank {r} has not started a collective of this group")
            else:
                parts.append(f"rank {r}'s last call here: {describe_words(newest)}")
        return "; ".join(parts)

    def _idle(self, op: Job, k: int, where: str, marks: bool = True) -> None:
        """Between sleeps: is any peer we wait for gone, or did one fail this call
        (``marks``)?"""
        core, ws = self.core, self.ws
        progress = core.progress
        if core.closed or core.state.closed or ws.closed:
            raise GroupClosedError(
                f"rank {core.rank}: {op.desc}: the group was closed while this rank waited "
                f"at {where}"
            )
        progress.poll_now()
        if progress.failure is not None:
            raise progress.failed_error(f"{op.desc} [{where}]")
        failed = ws.failed_peer(op.seq) if marks else None
        if failed is not None:  # it will never arrive here: fail now, not at the deadline
            raise self._failed_at_peer(op, *failed, k, where)
        for r in ws.late(k):
            g = core.ranks[r]
            if progress.departed(g):
                # As the engine does for a departed peer something still waits on: the
                # engine fails (later calls raise too; the exit path waits for the culprit).
                progress.peer_failed(
                    PeerFailedError(
                        f"rank {core.global_rank}: peer rank {g} left the group "
                        f"({progress.departure_note(g)}) while this rank waited for it at "
                        f"{where} of {op.call.name} #{op.seq}",
                        peer=g,
                    )
                )
                raise progress.failed_error(f"{op.desc} [{where}]")
        dead = [r for r in ws.dead_peers() if r in ws.late(k)]
        if dead:
            give_up = time.monotonic() + GOODBYE_WAIT_S
            while progress.failure is None and time.monotonic() < give_up:
                progress.poll_now()  # its goodbye says why it went
                time.sleep(0.005)
            if progress.failure is not None:
                raise progress.failed_error(f"{op.desc} [{where}]")
            r = dead[0]
            g = core.ranks[r]
            progress.peer_failed(
                PeerFailedError(
                    f"rank {core.global_rank}: peer rank {g} failed: its connection dropped without "
                    "a goodbye (its process ended: killed or crashed)",
                    peer=g,
                )
            )
            raise progress.failed_error(f"{op.desc} [{where}]")

    def publish(self, op: Job, call: Call) -> None:
        """Put the call's fingerprint in this rank's line (the area of its first round),
        before its first sync: its sequence number, a digest of the rest, and the rest."""
        parity = self.round & 1
        base = self._fp_base = area(parity)
        key = (
            call.name,
            call.algo,
            call.dtype,
            call.shape,
            call.root,
            call.op,
            self.core.chunk_bytes,
        )
        cached = self._rows.get(key)
        if cached is None:
            if len(self._rows) >= 256:
                self._rows.clear()
            cached = self._rows[key] = fingerprint_row(call, self.core.chunk_bytes, self.core.rank)
        row, digest = cached
        words = self.ws.words
        mine = self.ws.rank * LINE_WORDS + base
        if self._published[parity] != key:  # the same shape as last time: only seq changes
            self.ws.line[base : base + AREA_WORDS] = row
            self._published[parity] = key
        words[mine + SYM] = 0
        words[mine + SEQ] = op.seq
        self._digest = digest

    def fingerprints(self) -> np.ndarray:
        """Every rank's fingerprint of this call (rows), once the first sync is done."""
        base = self._fp_base
        return self.ws.lines[:, base : base + AREA_WORDS]

    def own_fingerprint(self) -> np.ndarray:
        """This rank's fingerprint of this call (a writable view of its line)."""
        base = self._fp_base
        line: np.ndarray = self.ws.line
        return line[base : base + AREA_WORDS]

    def check(self, op: Job) -> None:
        """After the call's first sync: every rank is in the same call, or all raise."""
        words, seq, digest = self.ws.words, op.seq, self._digest
        base = self._fp_base
        for r in range(self.ws.world_size):
            at = r * LINE_WORDS + base
            if words[at + SEQ] != seq or words[at + DIGEST] != digest:
                break
        else:
            return
        fps = self.fingerprints()
        me = self.ws.rank
        other = first_mismatch(fps, me)
        if other is not None:
            raise CollectiveMismatchError(
                f"rank {me}: {op.desc}: rank {other} called {describe_words(fps[other])} "
                f"instead of {describe_words(fps[me])}"
            )

    def round_cap(self, least: int) -> int:
        """Most bytes of one round (at least ``least``: one element per row)."""
        cap = min(self.ws.slot_bytes, ws_mod.ROUND_BYTES, self.core.chunk_bytes)
        return max(cap, least)

    def rounds(self, nbytes: int, itemsize: int, rows: int = 1) -> tuple[int, int]:
        """(elements per round per row, number of rounds) for ``nbytes`` per row: a round
        fills at most a buffer, and at most the group's ``chunk_bytes`` (tests force many
        rounds on small arrays with it)."""
        cap = self.round_cap(itemsize * rows)
        per_round = max(1, cap // (rows * itemsize))
        count = nbytes // itemsize if itemsize else 0
        return per_round, max(1, -(-count // per_round))

    def next_buffer(self) -> int:
        """The buffer (0 or 1) of the next round (shared by every algorithm here)."""
        b = self.round & 1
        self.round += 1
        return b

    def view(self, r: int, b: int, dtype: np.dtype[Any], count: int) -> np.ndarray:
        """Rank ``r``'s buffer ``b`` as ``count`` elements of ``dtype``."""
        return self.ws.buffers[r][b][: count * dtype.itemsize].view(dtype)

    def all_views(self, b: int, dtype: np.dtype[Any], count: int) -> list[np.ndarray]:
        """Every rank's buffer ``b`` as ``count`` elements of ``dtype`` (cached)."""
        key = (b, dtype, count)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 512:
                self._views.clear()
            views = [self.view(r, b, dtype, count) for r in range(self.ws.world_size)]
            self._views[key] = views
        return views


def _never() -> None:
    return None
