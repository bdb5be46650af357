"""Collectives of a group whose ranks share one host, through its shared workspace.

No ring, no socket: each rank copies its input into its own buffer of the workspace
(:mod:`ringcomm.transport.workspace`), the ranks synchronise, and each reads what it needs
straight from the others' buffers. Per round (a piece of at most the workspace's buffer
size; large calls take several, alternating each rank's two buffers):

=============== ====================================================================
all_reduce      small: copy in, sync, every rank reduces every buffer in rank order
                into ``x``. Large: copy in, sync, rank j reduces slice j of every
                buffer into its own buffer, sync, every rank copies the W reduced
                slices out. Either way one rank computes each element: bit-identical.
reduce_scatter  copy in (W rows), sync, rank j reduces row j of every buffer.
all_gather      copy in, sync, copy every buffer out.
broadcast       the root copies in, sync, the others copy out.
reduce, gather  copy in, sync, the root reduces or copies out.
scatter         the root copies in (W rows), sync, rank j copies row j out.
all_to_all      copy in (W rows), sync, rank j copies row j of every buffer out.
barrier         sync.
=============== ====================================================================

Before any user byte is written, each rank compares the fingerprint every rank put in its
control line (sequence number, collective, dtype, shape, root, op) with its own: a
difference raises :class:`~ringcomm.errors.CollectiveMismatchError` on every rank. A call
that fails on a rank marks its control line and tells the peers (the progress engine's
abort); every synchronisation looks at the marks before the call goes on, so a late rank
fails that call too, with the first failure's type and reason, instead of completing it
from what the others left in their buffers. A wait that runs long looks, between sleeps, at the peers' processes (pidfds), at the
progress engine's goodbyes and failure reports, and at the deadline: a dead or departed
peer raises :class:`~ringcomm.errors.PeerFailedError` naming it, a deadline
:class:`~ringcomm.errors.CommTimeoutError` naming the ranks waited for and where ("waiting
for rank 2 at sync 2 of all_reduce #17"). Either leaves the group failed.

Calls run on the calling thread; ``async_op=True`` calls run in order on the group's
worker thread (a blocking call queues behind them), so a rank may post point-to-point
work after an asynchronous collective as over the socket.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ringcomm.collectives.base import Call, describe_fingerprint, fingerprint
from ringcomm.core.progress import Op
from ringcomm.core.work import Work
from ringcomm.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    GroupClosedError,
    PeerFailedError,
    RingcommError,
)
from ringcomm.ops import ReduceOp, finalize, reduce_in_order, reduce_ufunc
from ringcomm.transport import workspace as ws_mod
from ringcomm.transport.wire import SUPPORTED_DTYPES
from ringcomm.transport.workspace import FP, LINE_WORDS, Window, Workspace, WorkspaceTimeout

if TYPE_CHECKING:
    from ringcomm.core.group_core import GroupCore

log = logging.getLogger("ringcomm")

__all__ = ["SMALL_ALL_REDUCE_BYTES", "WorkspaceCollectives", "WorkspaceOp"]

#: all_reduce up to this many bytes: every rank reduces the whole buffer (one sync);
#: above, each rank reduces 1/W of it (two syncs, 1/W of the reads).
SMALL_ALL_REDUCE_BYTES = 64 * 1024
#: How long a rank that found a peer's process gone waits for that peer's goodbye (which
#: says why it went) before it reports the death itself.
GOODBYE_WAIT_S = 0.1
#: How long a rank that saw a peer's failure mark waits for the reason to arrive (the
#: peer's abort, or the news of the rank that went; each follows the mark at once).
REASON_WAIT_S = 1.0

_OPCODES = {
    "all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "broadcast": 4, "reduce": 5,
    "gather": 6, "scatter": 7, "all_to_all": 8, "barrier": 9, "all_gather_v": 10,
    "reduce_scatter_v": 11, "all_to_all_v": 12,
}  # fmt: skip
#: The algorithm of a call, in the collective's word (times 256): ranks whose arrays live
#: in different memories (host ``shm``, device windows ``ipc``) must not meet in one call.
_ALGO_CODES = {"ipc": 1}
_DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(SUPPORTED_DTYPES)}
_CODE_DTYPES = {i: dt for dt, i in _DTYPE_CODES.items()}
_ROOT_SENDS = ("broadcast", "scatter")  # only the root's input travels
_OP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}
# A fingerprint: words from an area's start, compared ones first. Two areas per line, by
# the parity of the call's first round (as the buffers): a rank's next call may publish
# while a slower peer still checks this one.
_SEQ, _COLL, _DTYPE, _SHAPE, _ROOT, _ROP, _CHUNK = range(7)
_COMPARED = 7
_SYM, _SYM_OFFSET = 7, 8  # all_reduce: the window (index + 1, 0: none) holding x, where
_DIGEST = 9  # of words 1.._COMPARED-1: a quick look compares seq and digest only
_NDIM = 10  # then the dims (named in mismatch errors; scatter's root says its shape)
_AREA_WORDS = (LINE_WORDS - FP) // 2
_MAX_DIMS = _AREA_WORDS - _NDIM - 1


def _shape_word(shape: tuple[int, ...]) -> int:
    # hash() of a tuple of ints is the same in every process (no string hashing).
    return (hash(shape) & 0x7FFF_FFFF_FFFF_FFFF) | 1


class Job:
    """One collective call on the workspace: what the algorithms carry from call to sync."""

    __slots__ = ("call", "core", "deadline", "device", "note", "seq", "timeout_s")

    def __init__(self, core: GroupCore, call: Call, seq: int, deadline: float,
                 timeout_s: float, device: Any = None) -> None:  # fmt: skip
        self.core = core
        self.call = call
        self.seq = seq
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.note = ""  # where it waits (a sync), for the progress map
        #: A device algorithm's state taken at the call (the caller's stream): see
        #: :attr:`WorkspaceCollectives.extensions`.
        self.device = device

    @property
    def desc(self) -> str:
        """As the engine's collectives say it, plus where it runs."""
        fp = describe_fingerprint(fingerprint(self.call, self.core.chunk_bytes))
        return f"{fp} (collective #{self.seq} of group {self.core.group_id}, on the shared workspace)"


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
        self._fp_base = FP  # where the current call's fingerprint sits in each line
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
    def run(self, call: Call, seq: int, timeout_s: float, async_op: bool,
            start_s: float | None = None, device: Any = None) -> Any:  # fmt: skip
        """Run ``call`` here, now (or queue it behind earlier asynchronous ones); its
        deadline counts from ``start_s`` (``time.monotonic()``; default: now). ``device``:
        what a device algorithm took at the call (:attr:`Job.device`)."""
        if start_s is None:
            start_s = time.monotonic()
        job = Job(self.core, call, seq, start_s + timeout_s, timeout_s, device)
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

    def _symmetric(self, x: np.ndarray) -> tuple[int, int]:
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
        """Wait for this group's earlier collectives that went through the engine."""
        serial = self.core.serial
        last = serial.pending[-1] if serial.pending else serial.active
        if last is None or last.done:
            return
        try:
            self.core.progress.wait(last, op.timeout_s, op.deadline)
        except RingcommError:
            pass
        self.core.check_usable(op.call.name)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for ext in self.extensions.values():
            ext.close()
        self.ws.close()

    # -- what the extensions use (the device algorithms of ringcomm.collectives.ipc) ------
    def publish(self, job: Job, call: Call) -> None:
        """Put ``call``'s fingerprint in this rank's control line (before its first sync)."""
        self._publish(job, call)

    def sync(self, job: Job, where: str) -> None:
        """Arrive at the next synchronisation and wait for every rank (``where`` names it
        in a timeout's message); raises as any call here does."""
        self._sync(job, where)

    def check(self, job: Job) -> None:
        """After the call's first sync: every rank is in the same call, or all raise."""
        self._check(job)

    def next_buffer(self) -> int:
        """The buffer (0 or 1) of the next round (shared by every algorithm here)."""
        return self._next_buffer()

    def buffer(self, rank: int, b: int) -> np.ndarray:
        """Rank ``rank``'s host buffer ``b`` (uint8), e.g. for small control data."""
        return self.ws.buffers[rank][b]

    def run_host(self, job: Job, call: Call) -> Any:
        """Run ``call`` (host arrays) with the ``shm`` algorithm, inside a running job."""
        return getattr(self, "_" + call.name)(job, call)

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
            if ext is not None:
                result = ext.execute(op, call)
            else:
                result = getattr(self, "_" + call.name)(op, call)
            x = call.x
            if x is not None and (call.root is None or call.name not in _ROOT_SENDS
                                  or call.root == self.ws.rank):  # fmt: skip
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

    def _sync(self, op: Job, where: str) -> None:
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
            "so every rank fails it (its reason did not arrive)", peer=core.ranks[r],
        )  # fmt: skip

    def _last_calls(self, ranks: list[int]) -> str:
        """What each of ``ranks`` last started here (its newer fingerprint)."""
        lines = self.ws.lines
        parts = []
        for r in ranks:
            areas = [lines[r, FP + a * _AREA_WORDS : FP + (a + 1) * _AREA_WORDS] for a in (0, 1)]
            newest = max(areas, key=lambda fp: int(fp[_SEQ]))
            if int(newest[_SEQ]) == 0:
                parts.append(f"rank {r} has not started a collective of this group")
            else:
                parts.append(f"rank {r}'s last call here: {self._described(newest)}")
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
                progress.peer_failed(PeerFailedError(
                    f"rank {core.global_rank}: peer rank {g} left the group "
                    f"({progress.departure_note(g)}) while this rank waited for it at "
                    f"{where} of {op.call.name} #{op.seq}", peer=g))  # fmt: skip
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
            progress.peer_failed(PeerFailedError(
                f"rank {core.global_rank}: peer rank {g} failed: its connection dropped without "
                "a goodbye (its process ended: killed or crashed)", peer=g))  # fmt: skip
            raise progress.failed_error(f"{op.desc} [{where}]")

    def _publish(self, op: Job, call: Call) -> None:
        """Put the call's fingerprint in this rank's line (the area of its first round):
        its sequence number, a digest of the rest, and the rest (for error messages)."""
        area = self.round & 1
        base = self._fp_base = FP + area * _AREA_WORDS
        key = (call.name, call.algo, call.dtype, call.shape, call.root, call.op,
               self.core.chunk_bytes)  # fmt: skip
        cached = self._rows.get(key)
        if cached is None:
            if len(self._rows) >= 256:
                self._rows.clear()
            cached = self._rows[key] = self._row(call)
        row, digest = cached
        words = self.ws.words
        mine = self.ws.rank * LINE_WORDS + base
        if self._published[area] != key:  # the same shape as last time: only seq changes
            self.ws.line[base : base + _AREA_WORDS] = row
            self._published[area] = key
        words[mine + _SYM] = 0
        words[mine + _SEQ] = op.seq
        self._digest = digest

    def _row(self, call: Call) -> tuple[np.ndarray, int]:
        row = np.zeros(_AREA_WORDS, np.uint64)
        row[_COLL] = _OPCODES[call.name] | _ALGO_CODES.get(call.algo, 0) << 8
        known = call.dtype is not None and call.shape is not None
        row[_DTYPE] = _DTYPE_CODES[call.dtype] if known else 0  # type: ignore[index]
        row[_SHAPE] = _shape_word(call.shape) if known else 0  # type: ignore[arg-type]
        row[_ROOT] = 0 if call.root is None else call.root + 1
        row[_ROP] = 0 if call.op is None else _OP_CODES[call.op]
        row[_CHUNK] = self.core.chunk_bytes  # it sets the rounds: ranks must agree
        shape = call.shape
        if known and shape:
            if len(shape) > _MAX_DIMS and call.name == "scatter" and call.root == self.core.rank:
                raise ValueError(
                    f"rank {self.core.rank}: scatter: at most {_MAX_DIMS} dimensions on the "
                    "shared workspace"
                )
            k = min(len(shape), _MAX_DIMS)
            row[_NDIM] = len(shape)
            row[_NDIM + 1 : _NDIM + 1 + k] = shape[:k]
        # The digest of the compared words (after seq): equal digests, equal calls.
        row[_DIGEST] = _shape_word(tuple(int(v) for v in row[_COLL:_COMPARED]))
        return row, int(row[_DIGEST])

    def _fingerprints(self) -> np.ndarray:
        """Every rank's fingerprint of this call (rows), once the first sync is done."""
        base = self._fp_base
        return self.ws.lines[:, base : base + _AREA_WORDS]

    def _check(self, op: Job) -> None:
        """After the first sync: every rank is in the same call, or all raise."""
        words, seq, digest = self.ws.words, op.seq, self._digest
        base = self._fp_base
        for r in range(self.ws.world_size):
            at = r * LINE_WORDS + base
            if words[at + _SEQ] != seq or words[at + _DIGEST] != digest:
                break
        else:
            return
        fps = self._fingerprints()
        me = self.ws.rank
        mine = fps[me, :_COMPARED]
        for r in range(self.ws.world_size):
            theirs = fps[r, :_COMPARED]
            for word, (a, b) in enumerate(zip(mine.tolist(), theirs.tolist(), strict=True)):
                if a == b or (word in (_DTYPE, _SHAPE) and 0 in (a, b)):
                    continue
                raise CollectiveMismatchError(
                    f"rank {me}: {op.desc}: rank {r} called {self._described(fps[r])} "
                    f"instead of {self._described(fps[me])}"
                )

    @staticmethod
    def _described(fp: np.ndarray) -> str:
        """``all_reduce(float32[10], op=sum, chunk_bytes=64) #3`` from a fingerprint."""
        names = {v: k for k, v in _OPCODES.items()}
        ops = {v: k for k, v in _OP_CODES.items()}
        algos = {v: k for k, v in _ALGO_CODES.items()}
        words = fp.tolist()
        parts = []
        dtype = _CODE_DTYPES.get(words[_DTYPE])
        if dtype is not None:
            ndim = words[_NDIM]
            dims = [str(d) for d in words[_NDIM + 1 : _NDIM + 1 + min(ndim, _MAX_DIMS)]]
            if ndim > _MAX_DIMS:
                dims.append("...")
            parts.append(f"{dtype}[{'x'.join(dims)}]")
        if words[_ROP]:
            parts.append(f"op={ops.get(words[_ROP], '?')}")
        if words[_ROOT]:
            parts.append(f"root={words[_ROOT] - 1}")
        if words[_COLL] >> 8:  # (shm, the workspace's own, goes unsaid)
            parts.append(f"algo={algos.get(words[_COLL] >> 8, '?')}")
        parts.append(f"chunk_bytes={words[_CHUNK]}")
        return f"{names.get(words[_COLL] & 0xFF, '?')}({', '.join(parts)}) #{words[_SEQ]}"

    def _round_cap(self, least: int) -> int:
        """Most bytes of one round (at least ``least``: one element per row)."""
        cap = min(self.ws.slot_bytes, ws_mod.ROUND_BYTES, self.core.chunk_bytes)
        return max(cap, least)

    def _rounds(self, nbytes: int, itemsize: int, rows: int = 1) -> tuple[int, int]:
        """(elements per round per row, number of rounds) for ``nbytes`` per row: a round
        fills at most a buffer, and at most the group's ``chunk_bytes`` (tests force many
        rounds on small arrays with it)."""
        cap = self._round_cap(itemsize * rows)
        per_round = max(1, cap // (rows * itemsize))
        count = nbytes // itemsize if itemsize else 0
        return per_round, max(1, -(-count // per_round))

    def _next_buffer(self) -> int:
        b = self.round & 1
        self.round += 1
        return b

    def _view(self, r: int, b: int, dtype: np.dtype[Any], count: int) -> np.ndarray:
        return self.ws.buffers[r][b][: count * dtype.itemsize].view(dtype)

    def _all_views(self, b: int, dtype: np.dtype[Any], count: int) -> list[np.ndarray]:
        """Every rank's buffer ``b`` as ``count`` elements of ``dtype`` (cached)."""
        key = (b, dtype, count)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 512:
                self._views.clear()
            views = [self._view(r, b, dtype, count) for r in range(self.ws.world_size)]
            self._views[key] = views
        return views

    # all_reduce -------------------------------------------------------------------------
    def _all_reduce(self, op: Job, call: Call) -> Any:
        x = call.x
        assert x is not None and call.op is not None
        n = self.ws.world_size
        self._publish(op, call)
        # Small calls copy in even from a window (one sync beats reading in place); every
        # rank decides alike, by the size, which every rank's fingerprint shares.
        small = x.nbytes <= SMALL_ALL_REDUCE_BYTES
        sym, offset = (0, 0) if small else self._symmetric(x)
        if sym:
            fp = self.ws.line[self._fp_base : self._fp_base + _AREA_WORDS]
            fp[_SYM], fp[_SYM_OFFSET] = sym, offset
        if n > 1 and not small and self.windows:  # a peer's x may be in a window
            return self._all_reduce_sources(op, call, x)
        if n > 1 and x.nbytes <= SMALL_ALL_REDUCE_BYTES and x.nbytes <= self._round_cap(x.itemsize):
            return self._all_reduce_small(op, call, x)
        dtype = x.dtype
        flat = x.reshape(-1)
        me = self.ws.rank
        ufunc = reduce_ufunc(call.op, dtype)
        silence = dtype.kind == "f"
        avg = call.op is ReduceOp.AVG
        per, rounds = self._rounds(x.nbytes, dtype.itemsize)
        small = x.nbytes <= SMALL_ALL_REDUCE_BYTES
        for i in range(rounds):
            lo = i * per
            hi = min(lo + per, flat.size)
            c = hi - lo
            b = self._next_buffer()
            views = self._all_views(b, dtype, c)
            np.copyto(views[me], flat[lo:hi])
            self._sync(op, f"sync 1 of round {i + 1}/{rounds}")
            if i == 0:
                self._check(op)
            if small:
                if n == 1:
                    continue
                reduce_in_order(ufunc, views, flat[lo:hi], silence=silence)
                if avg:
                    finalize(call.op, flat[lo:hi], n)
                continue
            bounds = [c * j // n for j in range(n + 1)]
            s, e = bounds[me], bounds[me + 1]
            if e > s and n > 1:
                srcs = [views[me][s:e]] + [views[r][s:e] for r in range(n) if r != me]
                reduce_in_order(ufunc, srcs, views[me][s:e], silence=silence)
            if avg and e > s:
                finalize(call.op, views[me][s:e], n)
            self._sync(op, f"sync 2 of round {i + 1}/{rounds}")
            for r in range(n):
                s, e = bounds[r], bounds[r + 1]
                if e > s:
                    np.copyto(flat[lo + s : lo + e], views[r][s:e])
        return x

    def _all_reduce_small(self, op: Job, call: Call, x: np.ndarray) -> Any:
        """One round: copy in, sync, every rank reduces every buffer in rank order."""
        assert call.op is not None
        b = self._next_buffer()
        views = self._all_views(b, x.dtype, x.size)
        flat = x.reshape(-1)
        np.copyto(views[self.ws.rank], flat)
        self._sync(op, "sync 1 of round 1/1")
        self._check(op)
        ufunc = reduce_ufunc(call.op, x.dtype)
        reduce_in_order(ufunc, views, flat, silence=x.dtype.kind == "f")
        if call.op is ReduceOp.AVG:
            finalize(call.op, flat, self.ws.world_size)
        return x

    def _all_reduce_sources(self, op: Job, call: Call, x: np.ndarray) -> Any:
        """all_reduce where some ranks' ``x`` lives in a window (:meth:`alloc`): those are
        read in place, not copied in; if all are, the whole buffer is one round and no
        byte is copied in or out of the workspace but the reduced slices. Each rank
        reduces its slice into its own buffer (its window part, or its workspace buffer);
        every rank copies the others' reduced slices; a last sync keeps every window
        part unchanged until no rank reads it any more."""
        assert call.op is not None
        n, me = self.ws.world_size, self.ws.rank
        dtype = x.dtype
        flat = x.reshape(-1)
        size = flat.size
        ufunc = reduce_ufunc(call.op, dtype)
        silence = dtype.kind == "f"
        per, rounds = self._rounds(x.nbytes, dtype.itemsize)
        mine_sym = self.ws.line[self._fp_base + _SYM] != 0
        places: list[np.ndarray | None] = [None] * n  # rank r's x in its window part
        any_sym = False
        i = 0
        while i < rounds:
            lo = i * per
            hi = min(lo + per, size)
            b = self._next_buffer()
            if not mine_sym:
                np.copyto(self._view(me, b, dtype, hi - lo), flat[lo:hi])
            self._sync(op, f"sync 1 of round {i + 1}/{rounds}")
            if i == 0:
                self._check(op)
                fps = self._fingerprints()
                for r in range(n):
                    w, off = int(fps[r, _SYM]), int(fps[r, _SYM_OFFSET])
                    if w:
                        part = self.windows[w - 1].parts[r]
                        places[r] = part[off : off + x.nbytes].view(dtype)
                any_sym = any(p is not None for p in places)
                self.in_place_calls += places[me] is not None
                if all(p is not None for p in places):
                    per, rounds, hi = max(size, 1), 1, size  # nothing was copied in
            c = hi - lo
            srcs_all = [
                p[lo:hi] if p is not None else self._view(r, b, dtype, c)
                for r, p in enumerate(places)
            ]
            bounds = [c * j // n for j in range(n + 1)]
            s, e = bounds[me], bounds[me + 1]
            if e > s:
                srcs = [srcs_all[me][s:e]] + [srcs_all[r][s:e] for r in range(n) if r != me]
                reduce_in_order(ufunc, srcs, srcs_all[me][s:e], silence=silence)
                if call.op is ReduceOp.AVG:
                    finalize(call.op, srcs_all[me][s:e], n)
            self._sync(op, f"sync 2 of round {i + 1}/{rounds}")
            for r in range(n):
                s, e = bounds[r], bounds[r + 1]
                if e > s and not (r == me and places[me] is not None):
                    np.copyto(flat[lo + s : lo + e], srcs_all[r][s:e])
            i += 1
        if any_sym:
            self._next_buffer()
            self._sync(op, "the last sync (window parts read)")
        return x

    # reduce_scatter ---------------------------------------------------------------------
    def _row_rounds(
        self, op: Job, call: Call, rows: np.ndarray
    ) -> Iterator[tuple[int, int, list[np.ndarray]]]:
        """Rounds of a call on ``(W, m)`` rows: copy this rank's columns ``lo:hi`` of every
        row into its buffer, sync (the first time: check); yield ``(lo, hi, blocks)``,
        ``blocks[r]`` rank r's ``(W, hi - lo)`` copy."""
        n, me = self.ws.world_size, self.ws.rank
        dtype, m = rows.dtype, rows.shape[1]
        self._publish(op, call)
        per, rounds = self._rounds(m * dtype.itemsize, dtype.itemsize, n)
        for i in range(rounds):
            lo = i * per
            hi = min(lo + per, m)
            c = hi - lo
            b = self._next_buffer()
            blocks = [self._view(r, b, dtype, n * c).reshape(n, c) for r in range(n)]
            np.copyto(blocks[me], rows[:, lo:hi])
            self._sync(op, f"sync 1 of round {i + 1}/{rounds}")
            if i == 0:
                self._check(op)
            yield lo, hi, blocks

    def _reduce_scatter(self, op: Job, call: Call) -> Any:
        x, out = call.x, call.out
        assert x is not None and out is not None and call.op is not None
        n, me = self.ws.world_size, self.ws.rank
        res = out.reshape(-1)
        ufunc = reduce_ufunc(call.op, x.dtype)
        for lo, hi, blocks in self._row_rounds(op, call, x.reshape(n, -1)):
            if hi == lo:
                continue
            if n == 1:
                np.copyto(res[lo:hi], blocks[0][0])
            else:
                srcs = [blk[me] for blk in blocks]
                reduce_in_order(ufunc, srcs, res[lo:hi], silence=x.dtype.kind == "f")
            if call.op is ReduceOp.AVG:
                finalize(call.op, res[lo:hi], n)
        return out

    # all_gather, gather, broadcast, reduce -------------------------------------------
    def _flat_rounds(
        self, op: Job, call: Call, flat: np.ndarray, writes: bool = True
    ) -> Iterator[tuple[int, int, list[np.ndarray]]]:
        """Rounds of a call on a flat buffer: copy ``flat[lo:hi]`` into this rank's buffer
        (if it ``writes``), sync (the first time: check); yield ``(lo, hi, views)``,
        ``views[r]`` rank r's copy."""
        dtype = flat.dtype
        self._publish(op, call)
        per, rounds = self._rounds(flat.nbytes, dtype.itemsize)
        for i in range(rounds):
            lo = i * per
            hi = min(lo + per, flat.size)
            views = self._all_views(self._next_buffer(), dtype, hi - lo)
            if writes:
                np.copyto(views[self.ws.rank], flat[lo:hi])
            self._sync(op, f"sync 1 of round {i + 1}/{rounds}")
            if i == 0:
                self._check(op)
            yield lo, hi, views

    def _all_gather(self, op: Job, call: Call) -> Any:
        x, out = call.x, call.out
        assert x is not None and out is not None
        dst = out.reshape(self.ws.world_size, -1)
        for lo, hi, views in self._flat_rounds(op, call, x.reshape(-1)):
            for r, view in enumerate(views):
                np.copyto(dst[r, lo:hi], view)
        return out

    def _gather(self, op: Job, call: Call) -> Any:
        x, out = call.x, call.out
        assert x is not None
        mine = call.root == self.ws.rank
        dst = out.reshape(self.ws.world_size, -1) if mine and out is not None else None
        for lo, hi, views in self._flat_rounds(op, call, x.reshape(-1)):
            if dst is not None:
                for r, view in enumerate(views):
                    np.copyto(dst[r, lo:hi], view)
        return out if mine else None

    def _broadcast(self, op: Job, call: Call) -> Any:
        x = call.x
        assert x is not None and call.root is not None
        root = call.root
        flat = x.reshape(-1)
        mine = self.ws.rank == root
        for lo, hi, views in self._flat_rounds(op, call, flat, writes=mine):
            if not mine:
                np.copyto(flat[lo:hi], views[root])
        return x

    def _reduce(self, op: Job, call: Call) -> Any:
        x = call.x
        assert x is not None and call.root is not None and call.op is not None
        n = self.ws.world_size
        flat = x.reshape(-1)
        ufunc = reduce_ufunc(call.op, x.dtype)
        mine = self.ws.rank == call.root
        for lo, hi, views in self._flat_rounds(op, call, flat):
            if mine and n > 1:
                reduce_in_order(ufunc, views, flat[lo:hi], silence=x.dtype.kind == "f")
                if call.op is ReduceOp.AVG:
                    finalize(call.op, flat[lo:hi], n)
        return x

    # scatter, all_to_all ---------------------------------------------------------------
    def _scatter(self, op: Job, call: Call) -> Any:
        n, me, root = self.ws.world_size, self.ws.rank, call.root
        assert root is not None
        self._publish(op, call)
        x, out = call.x, call.out
        dtype: np.dtype[Any] = np.dtype(np.uint8)
        rows: np.ndarray | None = None
        m, per, rounds = 0, 1, 1
        if me == root:
            assert x is not None
            dtype, rows = x.dtype, x.reshape(n, -1)
            m = rows.shape[1]
            per, rounds = self._rounds(m * dtype.itemsize, dtype.itemsize, n)
        res: np.ndarray | None = None
        i = 0
        while i < rounds:
            b = self._next_buffer()
            lo = i * per
            if rows is not None:
                hi = min(lo + per, m)
                blocks = self._view(root, b, dtype, n * (hi - lo)).reshape(n, hi - lo)
                np.copyto(blocks, rows[:, lo:hi])
            self._sync(op, f"sync 1 of round {i + 1}/{rounds}")
            if i == 0:
                self._check(op)
                if me != root:  # dtype and shape as the root says
                    words = self._fingerprints()[root].tolist()
                    dtype = _CODE_DTYPES[words[_DTYPE]]
                    shape = tuple(words[_NDIM + 1 : _NDIM + 1 + words[_NDIM]])
                    if out is None:
                        out = np.empty(shape[1:], dtype)
                    elif out.dtype != dtype or tuple(out.shape) != shape[1:]:
                        raise CollectiveMismatchError(
                            f"rank {me}: {op.desc}: out is {out.dtype}{list(out.shape)} but "
                            f"the root scatters rows of {dtype}{list(shape[1:])}"
                        )
                    m = int(np.prod(shape[1:], dtype=np.int64))
                    per, rounds = self._rounds(m * dtype.itemsize, dtype.itemsize, n)
                assert out is not None
                res = out.reshape(-1)
            hi = min(lo + per, m)
            if hi > lo:
                assert res is not None
                blocks = self._view(root, b, dtype, n * (hi - lo)).reshape(n, hi - lo)
                np.copyto(res[lo:hi], blocks[me])
            i += 1
        return out

    def _all_to_all(self, op: Job, call: Call) -> Any:
        x, out = call.x, call.out
        assert x is not None and out is not None
        n, me = self.ws.world_size, self.ws.rank
        dst = out.reshape(n, -1)
        for lo, hi, blocks in self._row_rounds(op, call, x.reshape(n, -1)):
            for r in range(n):
                np.copyto(dst[r, lo:hi], blocks[r][me])
        return out

    def _barrier(self, op: Job, call: Call) -> Any:
        self._publish(op, call)
        self._next_buffer()
        self._sync(op, "the barrier")
        self._check(op)
        return None


def _never() -> None:
    return None
