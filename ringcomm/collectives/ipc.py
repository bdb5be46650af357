"""Collectives of device arrays on one host, through device windows (``algo="ipc"``).

Each rank exports one window of device memory (two buffers; :mod:`ringcomm.device.ipc`:
CUDA IPC, or the host stand-in) and two interprocess events; the group's first ``ipc`` call
exchanges the handles through the shared workspace, and every rank opens its peers' once.
The collectives run round by round as the host ones (:mod:`ringcomm.collectives.workspace`)
do, on the workspace's syncs and fingerprints, with device-to-device copies and CuPy
reductions enqueued on the caller's stream. Guarantees: every element is reduced once, the
same way, so all ranks get identical bits; a rank reads a peer's window only after that
peer's copy into it ran, and writes its own only after every peer's reads of it ran (each
sync records an event and waits for the peers'); a call returns once its stream ran
everything it enqueued. Small calls (up to :data:`SMALL_BYTES`) go through the host
(``shm``). docs/architecture.md ("Device windows") has the protocol.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ringcomm.collectives.base import Call
from ringcomm.device.ipc import IpcDevice, LocalWindow, ipc_device_for
from ringcomm.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    PeerFailedError,
    RingcommError,
)
from ringcomm.ops import ReduceOp

if TYPE_CHECKING:
    from ringcomm.collectives.shm_base import Job
    from ringcomm.collectives.workspace import WorkspaceCollectives

log = logging.getLogger("ringcomm")

__all__ = [
    "IPC_ALGO",
    "ONE_SHOT_MAX_BYTES",
    "SMALL_BYTES",
    "IpcCollectives",
    "one_shot",
]

#: The algorithm's name (``algo=``, ``RINGCOMM_ALGO``, the bench's ``"algo"`` key).
IPC_ALGO = "ipc"
#: all_reduce takes the one-shot form up to this many bytes at three ranks or more (and
#: always at two: one sync a round, and no more memory traffic than two-shot there).
ONE_SHOT_MAX_BYTES = 1 << 20
#: Calls up to this many bytes (the per-rank buffer: all_reduce's x, all_gather's x,
#: reduce_scatter's x, broadcast's x) go through the host (module docstring).
SMALL_BYTES = 16 * 1024
#: The collectives that take the small-message host path.
_SMALL = frozenset({"all_reduce", "reduce_scatter", "all_gather", "broadcast"})
#: The fix named when several ranks share a GPU without MPS.
MPS_FIX = (
    "start the MPS control daemon (nvidia-cuda-mps-control -d) before the job, so kernels "
    "of different processes run together instead of taking turns"
)

#: Whether this process warned about ranks sharing a GPU without MPS (once).
_WARNED: set[str] = set()


def one_shot(world_size: int, nbytes: int) -> bool:
    """Whether an all_reduce of ``nbytes`` on ``world_size`` ranks goes one-shot."""
    return world_size <= 2 or nbytes <= ONE_SHOT_MAX_BYTES


class IpcCollectives:
    """A group's ``ipc`` collectives, an extension of its shared workspace (made at the
    group's first device call; :attr:`WorkspaceCollectives.extensions`)."""

    def __init__(
        self, calls: WorkspaceCollectives, buffer_bytes: int, small_bytes: int = SMALL_BYTES,
        mps: bool = False,
    ) -> None:  # fmt: skip
        self.calls = calls
        self.core = calls.core
        self.ws = calls.ws
        self.rank = self.ws.rank
        self.world_size = self.ws.world_size
        #: Bytes of each of the two buffers of this rank's window (what it offers; the
        #: group uses the smallest of all ranks', :attr:`buffer_bytes` after setup).
        self.offer_bytes = max(256, buffer_bytes // 256 * 256)
        self.buffer_bytes = 0
        self.small_bytes = small_bytes
        self.device: IpcDevice | None = None
        self.window: LocalWindow | None = None
        self.wins: list[Any] = []  # rank -> its window (uint8 device array), ours included
        self.handles: list[bytes | None] = []  # rank -> the handle we opened (None: ours)
        self.events: list[Any] = []  # our two events
        self.peer_events: list[list[Any] | None] = []  # rank -> its two events, opened here
        #: Ranks per physical device of this group (identity -> group ranks), and whether
        #: the MPS daemon serves this host (``ringcomm.config.mps_active``).
        self.sharing: dict[str, list[int]] = {}
        self.mps = mps
        self.failed = False
        self.closed = False
        self._stream: Any = None  # the stream of the running call
        self._last_stream: Any = None  # and of the latest one
        self._small_stream: Any = None  # the stream of the last small call
        #: Per peer: its event this rank's stream waited for last, and the wait's mark.
        self._waits: dict[int, tuple[Any, Any]] = {}
        #: Calls so far: by the windows, and through the host (small).
        self.window_calls = 0
        self.small_calls = 0

    # -- entry -----------------------------------------------------------------------------
    def execute(self, job: Job, call: Call) -> Any:
        """Run ``call`` (device arrays) here: under the workspace's lock, from its
        ``execute`` (which turns a failure into the group's)."""
        arr = call.x if call.x is not None else call.out
        if arr is None:  # barrier, or a scatter onto nothing: the host's
            return self.calls.run_host(job, call)
        device = ipc_device_for(arr)
        device.calls += 1
        stream = job.device if job.device is not None else device.caller_stream()
        self._stream = self._last_stream = stream
        self._waits = {}

        def watch() -> None:
            self._watch(job)

        try:
            if self.device is None:
                self._setup(job, _shared(call, self.world_size), device, stream, watch)
            elif device is not self.device:
                raise ValueError(
                    f"rank {self.core.rank}: {call.name}: the arrays are on {device.identity} "
                    f"but this group's device windows are on {self.device.identity}"
                )
            if self._small(call):
                self.small_calls += 1
                return self._through_host(job, call, device, stream, watch)
            self.window_calls += 1
            result = getattr(self, "_" + call.name)(job, call, device, stream, watch)
            device.complete(stream, watch)
            return result
        except BaseException:
            device.abandon(stream)
            self._after_failure()
            raise
        finally:
            self._stream = None

    def _small(self, call: Call) -> bool:
        if call.name not in _SMALL:
            return False
        x = call.x
        return x is not None and int(x.nbytes) <= self.small_bytes

    # -- setup and teardown ----------------------------------------------------------------
    def _setup(self, job: Job, call: Call, device: IpcDevice, stream: Any, watch: Any) -> None:
        """The group's first device call: export, exchange through the workspace (after
        the call's fingerprints are checked), open the peers' windows and events."""
        calls, n, me = self.calls, self.world_size, self.rank
        self.device = device
        window = self.window = device.alloc_window(2 * self.offer_bytes)
        self.events = [device.new_event() for _ in (0, 1)]
        mine = {
            "identity": device.identity,
            "kind": device.kind,
            "handle": window.handle.hex(),
            "offset": window.offset,
            "size": window.size,
            "buffer": self.offer_bytes,
            "events": [h.hex() for _, h in self.events],
        }
        calls.publish(job, call)
        infos = self._exchange(job, json.dumps(mine).encode(), "the window exchange", check=True)
        descs = [json.loads(raw) for raw in infos]
        kinds = [str(d["kind"]) for d in descs]
        if len(set(kinds)) != 1:
            held = ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
            raise CollectiveMismatchError(
                f"rank {self.core.rank}: {call.name}: ranks of this group hold device arrays of "
                f"different kinds ({held})"
            )
        problem = ""
        self.wins = [None] * n
        self.handles = [None] * n
        self.peer_events = [None] * n
        self.wins[me] = window.buf
        try:
            for r, d in enumerate(descs):
                if r == me:
                    continue
                handle = bytes.fromhex(d["handle"])
                self.wins[r] = device.map_window(handle, d["offset"], 2 * d["buffer"], d["size"])
                self.handles[r] = handle
                self.peer_events[r] = [device.open_event(bytes.fromhex(h)) for h in d["events"]]
        except Exception as exc:  # noqa: BLE001 (told to every rank below, then raised)
            problem = f"{type(exc).__name__}: {exc}"
        oks = self._exchange(job, problem.encode(), "the window check")
        bad = [(r, raw.decode()) for r, raw in enumerate(oks) if raw]
        if bad:
            raise RingcommError(
                f"rank {self.core.rank}: {call.name}: device windows could not be opened: "
                + "; ".join(f"rank {r}: {why}" for r, why in bad)
            )
        self.buffer_bytes = min(int(d["buffer"]) for d in descs)
        for r, d in enumerate(descs):
            self.sharing.setdefault(d["identity"], []).append(r)
        self._warn_if_sharing(device)

    def _exchange(self, job: Job, mine: bytes, where: str, check: bool = False) -> list[bytes]:
        """Every rank's ``mine`` (a few hundred bytes), through the host workspace: one round."""
        calls = self.calls
        b = calls.next_buffer()
        buf = calls.buffer(self.rank, b)
        if len(mine) + 8 > buf.nbytes:
            raise ValueError(f"{where}: {len(mine)} bytes do not fit a workspace buffer")
        buf[:8] = np.frombuffer(np.uint64(len(mine)).tobytes(), np.uint8)
        buf[8 : 8 + len(mine)] = np.frombuffer(mine, np.uint8)
        calls.sync(job, where)
        if check:
            calls.check(job)
        out = []
        for r in range(self.world_size):
            theirs = calls.buffer(r, b)
            length = int(theirs[:8].view(np.uint64)[0])
            out.append(bytes(theirs[8 : 8 + length]))
        return out

    def _warn_if_sharing(self, device: IpcDevice) -> None:
        """Several ranks of this host on one GPU without MPS: one warning per process."""
        shared = [ranks for ranks in self.sharing.values() if len(ranks) > 1]
        if device.kind != "cupy" or not shared or self.mps or _WARNED:
            return
        _WARNED.add(device.identity)
        warnings.warn(
            f"ringcomm: ranks {', '.join(map(str, shared[0]))} of this group share one GPU "
            f"({device.identity}) without the MPS daemon: each phase of a collective waits for "
            f"the GPU to switch between their processes; {MPS_FIX}",
            RuntimeWarning,
            stacklevel=2,
        )

    def close(self) -> None:
        """Release the peers' windows and events and our own (the group is closed).
        After a failed call, only if this rank's stream is quiet (else a kernel may still
        read them: the process's end frees them)."""
        if self.closed:
            return
        self.closed = True
        device = self.device
        if device is None:
            return
        if not self.failed or device.quiet(self._last_stream):
            for r, handle in enumerate(self.handles):
                if handle is not None:
                    device.unmap_window(handle)
                events = self.peer_events[r] if r < len(self.peer_events) else None
                for ev in events or ():
                    device.close_event(ev, mine=False)
            for ev, _ in self.events:
                device.close_event(ev, mine=True)
            if self.window is not None:
                device.free_window(self.window)
        self.wins = []
        self.window = None

    def _after_failure(self) -> None:
        """A call failed: a peer that failed is dropped from the cache of opened handles
        (so no later group reuses its mapping), once this rank's stream is quiet."""
        self.failed = True
        device = self.device
        if device is None or not device.quiet(self._last_stream):
            return  # the stream may still read a mapping: it goes with the process
        dead = set(self.ws.dead_peers())
        failure = self.core.progress.failure
        peer = getattr(failure, "peer", None)
        if isinstance(peer, int) and peer in self.core.ranks:
            dead.add(self.core.ranks.index(peer))
        for r in dead:
            handle = self.handles[r] if r < len(self.handles) else None
            if handle is not None:
                device.unmap_window(handle, failed=True)
                self.handles[r] = None

    # -- syncs -------------------------------------------------------------------------------
    def _watch(self, job: Job) -> None:
        """Between looks at the device: the deadline, and peers that failed or left while
        this rank's stream still waits for one of their events (a peer whose last event
        here is done may finish its call and leave: that is no failure)."""
        core, ws, device = self.core, self.ws, self.device
        progress = core.progress
        progress.poll_now()  # goodbyes and failure reports
        if progress.failure is not None:
            raise progress.failed_error(f"{job.desc} [{job.note or 'on the device'}]")
        assert device is not None
        pending = [r for r, (ev, mark) in self._waits.items() if not device.event_done(ev, mark)]
        for r in pending:
            g = core.ranks[r]
            if progress.departed(g):
                progress.peer_failed(PeerFailedError(
                    f"rank {core.global_rank}: peer rank {g} left the group "
                    f"({progress.departure_note(g)}) while this rank's device work waited for "
                    "it", peer=g))  # fmt: skip
                raise progress.failed_error(f"{job.desc} [{job.note or 'on the device'}]")
        dead = [r for r in ws.dead_peers() if r in pending]
        if dead:
            g = core.ranks[dead[0]]
            progress.peer_failed(PeerFailedError(
                f"rank {core.global_rank}: peer rank {g} failed: its process ended (killed or "
                "crashed) while this rank's device work waited for it", peer=g))  # fmt: skip
            raise progress.failed_error(f"{job.desc} [{job.note or 'on the device'}]")
        if time.monotonic() > job.deadline:
            raise CommTimeoutError(
                f"rank {core.rank}: {job.desc} timed out after {job.timeout_s:g} s waiting for "
                f"the device after {job.note or 'the call'} (its stream, or a peer's event)"
            )

    def _sync(self, job: Job, where: str, first: bool, device: IpcDevice, stream: Any,
              watch: Any) -> None:  # fmt: skip
        """Record our event, sync on the host, make the stream wait for every peer's."""
        parity = (self.ws.count + 1) & 1
        device.record(stream, self.events[parity][0])
        self.calls.sync(job, where)
        if first:
            self.calls.check(job)
        for r, events in enumerate(self.peer_events):
            if events is not None and r != self.rank:
                ev = events[parity]
                self._waits[r] = (ev, device.wait(stream, ev, watch))

    def _rounds(self, count: int, itemsize: int, rows: int = 1) -> tuple[int, int]:
        """(elements per row per round, rounds) for ``count`` elements a row."""
        per = max(1, self.buffer_bytes // max(1, rows * itemsize))
        return per, max(1, -(-count // per))

    def _view(self, r: int, b: int, dtype: np.dtype[Any], count: int) -> Any:
        """Rank ``r``'s buffer ``b`` as ``count`` elements of ``dtype``."""
        start = b * self.buffer_bytes
        return self.wins[r][start : start + count * dtype.itemsize].view(dtype)

    # -- the calls ---------------------------------------------------------------------------
    def _all_reduce(self, job: Job, call: Call, dev: IpcDevice, stream: Any, watch: Any) -> Any:
        x = call.x
        assert x is not None and call.op is not None
        n, me = self.world_size, self.rank
        self.calls.publish(job, call)
        dtype, flat = x.dtype, x.reshape(-1)
        avg = call.op is ReduceOp.AVG
        per, rounds = self._rounds(flat.size, dtype.itemsize)
        shot = one_shot(n, int(x.nbytes))
        for i in range(rounds):
            lo = i * per
            hi = min(lo + per, flat.size)
            c = hi - lo
            b = self.calls.next_buffer()
            views = [self._view(r, b, dtype, c) for r in range(n)]
            dev.copy(stream, views[me], flat[lo:hi])
            self._sync(job, f"sync 1 of round {i + 1}/{rounds}", i == 0, dev, stream, watch)
            if shot:  # every rank reduces everything, in rank order
                dev.reduce(stream, call.op, views, flat[lo:hi])
                if avg:
                    dev.finalize(stream, call.op, flat[lo:hi], n)
                continue
            bounds = [c * j // n for j in range(n + 1)]
            s, e = bounds[me], bounds[me + 1]
            if e > s:  # our slice of every window, into ours
                srcs = [views[me][s:e]] + [views[r][s:e] for r in range(n) if r != me]
                dev.reduce(stream, call.op, srcs, views[me][s:e])
                if avg:
                    dev.finalize(stream, call.op, views[me][s:e], n)
            self._sync(job, f"sync 2 of round {i + 1}/{rounds}", False, dev, stream, watch)
            for r in range(n):
                s, e = bounds[r], bounds[r + 1]
                if e > s:
                    dev.copy(stream, flat[lo + s : lo + e], views[r][s:e])
        return x

    def _row_rounds(self, job: Job, call: Call, rows: Any, dev: IpcDevice, stream: Any,
                    watch: Any, writes: bool = True) -> Any:  # fmt: skip
        """Rounds on ``(W, m)`` rows: copy columns ``lo:hi`` of every row into this rank's
        buffer (if it ``writes``), sync; yield ``(lo, hi, blocks)``, ``blocks[r]`` rank r's
        ``(W, hi - lo)`` copy."""
        n, me = self.world_size, self.rank
        dtype, m = rows.dtype, rows.shape[1]
        self.calls.publish(job, call)
        per, rounds = self._rounds(m, dtype.itemsize, n)
        for i in range(rounds):
            lo = i * per
            hi = min(lo + per, m)
            c = hi - lo
            b = self.calls.next_buffer()
            blocks = [self._view(r, b, dtype, n * c).reshape(n, c) for r in range(n)]
            if writes and c:
                for j in range(n):
                    dev.copy(stream, blocks[me][j], rows[j, lo:hi])
            self._sync(job, f"sync 1 of round {i + 1}/{rounds}", i == 0, dev, stream, watch)
            yield lo, hi, blocks

    def _flat_rounds(self, job: Job, call: Call, flat: Any, dev: IpcDevice, stream: Any,
                     watch: Any, writes: bool = True) -> Any:  # fmt: skip
        """Rounds on a flat buffer: copy ``flat[lo:hi]`` into this rank's buffer (if it
        ``writes``), sync; yield ``(lo, hi, views)``, ``views[r]`` rank r's copy."""
        dtype = flat.dtype
        self.calls.publish(job, call)
        per, rounds = self._rounds(flat.size, dtype.itemsize)
        for i in range(rounds):
            lo = i * per
            hi = min(lo + per, flat.size)
            b = self.calls.next_buffer()
            views = [self._view(r, b, dtype, hi - lo) for r in range(self.world_size)]
            if writes:
                dev.copy(stream, views[self.rank], flat[lo:hi])
            self._sync(job, f"sync 1 of round {i + 1}/{rounds}", i == 0, dev, stream, watch)
            yield lo, hi, views

    def _slot_rounds(self, job: Job, flat: Any, starts: list[int], counts: list[int],
                     biggest: int, dev: IpcDevice, stream: Any, watch: Any) -> Any:  # fmt: skip
        """Rounds on segments of different sizes (the uneven forms, ``call`` published):
        segment ``j`` of ``flat`` (``counts[j]`` elements from ``starts[j]``; ``biggest``:
        the largest of any rank's) goes into slot ``j`` of this rank's buffer, ``per``
        elements a round, sync; yield ``(lo, per, blocks)``, ``blocks[r]`` rank r's
        ``n * per`` elements, slot ``j`` holding elements ``lo : lo + per`` of segment j."""
        n, me, dtype = self.world_size, self.rank, flat.dtype
        per, rounds = self._rounds(biggest, dtype.itemsize, n)
        for i in range(rounds):
            lo = i * per
            b = self.calls.next_buffer()
            blocks = [self._view(r, b, dtype, n * per) for r in range(n)]
            for j in range(n):
                s, e = lo, min(lo + per, counts[j])
                if e > s:
                    dev.copy(stream, blocks[me][j * per : j * per + e - s],
                             flat[starts[j] + s : starts[j] + e])  # fmt: skip
            self._sync(job, f"sync 1 of round {i + 1}/{rounds}", False, dev, stream, watch)
            yield lo, per, blocks

    def _reduce_scatter(self, job: Job, call: Call, dev: IpcDevice, stream: Any,
                        watch: Any) -> Any:  # fmt: skip
        x, out = call.x, call.out
        assert x is not None and out is not None and call.op is not None
        n, me = self.world_size, self.rank
        res = out.reshape(-1)
        for lo, hi, blocks in self._row_rounds(job, call, x.reshape(n, -1), dev, stream, watch):
            if hi > lo:
                dev.reduce(stream, call.op, [blk[me] for blk in blocks], res[lo:hi])
                if call.op is ReduceOp.AVG:
                    dev.finalize(stream, call.op, res[lo:hi], n)
        return out

    def _all_gather(self, job: Job, call: Call, dev: IpcDevice, stream: Any, watch: Any) -> Any:
        x, out = call.x, call.out
        assert x is not None and out is not None
        dst = out.reshape(self.world_size, -1)
        for lo, hi, views in self._flat_rounds(job, call, x.reshape(-1), dev, stream, watch):
            if hi > lo:
                for r, view in enumerate(views):
                    dev.copy(stream, dst[r, lo:hi], view)
        return out

    def _broadcast(self, job: Job, call: Call, dev: IpcDevice, stream: Any, watch: Any) -> Any:
        x = call.x
        assert x is not None and call.root is not None
        root, flat = call.root, x.reshape(-1)
        mine = self.rank == root
        for lo, hi, views in self._flat_rounds(job, call, flat, dev, stream, watch, writes=mine):
            if not mine and hi > lo:
                dev.copy(stream, flat[lo:hi], views[root])
        return x

    def _reduce(self, job: Job, call: Call, dev: IpcDevice, stream: Any, watch: Any) -> Any:
        x = call.x
        assert x is not None and call.root is not None and call.op is not None
        flat = x.reshape(-1)
        mine = self.rank == call.root
        for lo, hi, views in self._flat_rounds(job, call, flat, dev, stream, watch):
            if mine and hi > lo:
                dev.reduce(stream, call.op, views, flat[lo:hi])
                if call.op is ReduceOp.AVG:
                    dev.finalize(stream, call.op, flat[lo:hi], self.world_size)
        return x

    def _gather(self, job: Job, call: Call, dev: IpcDevice, stream: Any, watch: Any) -> Any:
        x, out = call.x, call.out
        assert x is not None
        mine = call.root == self.rank
        dst = out.reshape(self.world_size, -1) if mine and out is not None else None
        for lo, hi, views in self._flat_rounds(job, call, x.reshape(-1), dev, stream, watch):
            if dst is not None and hi > lo:
                for r, view in enumerate(views):
                    dev.copy(stream, dst[r, lo:hi], view)
        return out if mine else None

    def _scatter(self, job: Job, call: Call, dev: IpcDevice, stream: Any, watch: Any) -> Any:
        n, me, root = self.world_size, self.rank, call.root
        x, out = call.x, call.out
        assert root is not None and out is not None  # (api: every rank passes a device array)
        mine = me == root
        rows: Any = x.reshape(n, -1) if mine and x is not None else None
        res = out.reshape(-1)
        if rows is None:  # the same rounds as the root's: its rows are out's size
            rows_shape = (n, res.size)
            rows = _Shape(rows_shape, out.dtype)
        for lo, hi, blocks in self._row_rounds(job, call, rows, dev, stream, watch, writes=mine):
            if hi > lo:
                dev.copy(stream, res[lo:hi], blocks[root][me])
        return out

    def _all_to_all(self, job: Job, call: Call, dev: IpcDevice, stream: Any, watch: Any) -> Any:
        x, out = call.x, call.out
        assert x is not None and out is not None
        n, me = self.world_size, self.rank
        dst = out.reshape(n, -1)
        for lo, hi, blocks in self._row_rounds(job, call, x.reshape(n, -1), dev, stream, watch):
            if hi > lo:
                for r in range(n):
                    dev.copy(stream, dst[r, lo:hi], blocks[r][me])
        return out

    # -- uneven (v) forms ----------------------------------------------------------------------
    def _counts(self, job: Job, call: Call, mine: list[int], where: str) -> list[list[int]]:
        """Publish ``call`` (its rank-independent fingerprint), then share every rank's
        ``mine`` (row counts) through one host round, the fingerprints checked first."""
        self.calls.publish(job, call)
        raw = self._exchange(job, json.dumps(mine).encode(), where, check=True)
        return [json.loads(r) for r in raw]

    def _same_counts(
        self, job: Job, call: Call, name: str, where: str
    ) -> tuple[list[int], list[int]]:
        """all_gather_v's sizes or reduce_scatter_v's splits (``name``; ``call.shape``'s
        first ``n``), the same on every rank (:meth:`_counts`, ``where``), as element
        counts per rank; and where each rank's segment starts."""
        assert call.shape is not None
        n = self.world_size
        mine = list(call.shape[:n])
        row = int(np.prod(call.shape[n:], dtype=np.int64))
        theirs = self._counts(job, _shared(call, n), mine, where)
        for r, got in enumerate(theirs):
            if got != mine:
                raise CollectiveMismatchError(
                    f"rank {self.core.rank}: {job.desc}: rank {r} passed {name} {got}, this rank "
                    f"{mine}"
                )
        counts = [s * row for s in mine]
        return counts, [sum(counts[:r]) for r in range(n)]

    def _all_gather_v(self, job: Job, call: Call, dev: IpcDevice, stream: Any,
                      watch: Any) -> Any:  # fmt: skip
        x, out = call.x, call.out
        assert x is not None and out is not None
        me = self.rank
        counts, starts = self._same_counts(job, call, "sizes", "sharing the row counts")
        flat, dst = x.reshape(-1), out.reshape(-1)
        per, rounds = self._rounds(max(counts, default=0), x.dtype.itemsize)
        for i in range(rounds):
            lo = i * per
            b = self.calls.next_buffer()
            spans = [(lo, min(lo + per, c)) for c in counts]
            views = [self._view(r, b, x.dtype, max(0, e - s)) for r, (s, e) in enumerate(spans)]
            s, e = spans[me]
            if e > s:
                dev.copy(stream, views[me], flat[s:e])
            self._sync(job, f"sync 1 of round {i + 1}/{rounds}", False, dev, stream, watch)
            for r, (s, e) in enumerate(spans):
                if e > s:
                    dev.copy(stream, dst[starts[r] + s : starts[r] + e], views[r])
        return out

    def _reduce_scatter_v(self, job: Job, call: Call, dev: IpcDevice, stream: Any,
                          watch: Any) -> Any:  # fmt: skip
        x, out = call.x, call.out
        assert x is not None and out is not None and call.op is not None
        n, me = self.world_size, self.rank
        counts, starts = self._same_counts(job, call, "splits", "sharing the splits")
        flat, res = x.reshape(-1), out.reshape(-1)
        biggest = max(counts, default=0)
        rounds = self._slot_rounds(job, flat, starts, counts, biggest, dev, stream, watch)
        for lo, per, blocks in rounds:
            s, e = lo, min(lo + per, counts[me])
            if e > s:
                srcs = [blk[me * per : me * per + e - s] for blk in blocks]
                dev.reduce(stream, call.op, srcs, res[s:e])
                if call.op is ReduceOp.AVG:
                    dev.finalize(stream, call.op, res[s:e], n)
        return out

    def _all_to_all_v(self, job: Job, call: Call, dev: IpcDevice, stream: Any,
                      watch: Any) -> Any:  # fmt: skip
        x, out = call.x, call.out
        assert x is not None and out is not None and call.shape is not None
        n, me = self.world_size, self.rank
        ins, outs = list(call.shape[:n]), list(call.shape[n : 2 * n])
        row = int(np.prod(call.shape[2 * n :], dtype=np.int64))
        theirs = self._counts(job, _shared(call, n), ins + outs, "sharing the splits")
        for r, got in enumerate(theirs):
            their_in, their_out = got[:n], got[n:]
            if their_in[me] != outs[r] or their_out[me] != ins[r]:
                raise CollectiveMismatchError(
                    f"rank {self.core.rank}: {job.desc}: rank {r} sends this rank "
                    f"{their_in[me]} rows and expects {their_out[me]}, but this rank expects "
                    f"{outs[r]} from it and sends it {ins[r]}"
                )
        biggest = max((c for got in theirs for c in got[:n]), default=0) * row
        sends = [c * row for c in ins]  # slot j: what goes to rank j
        send_starts = [sum(ins[:j]) * row for j in range(n)]
        recv_starts = [sum(outs[:j]) * row for j in range(n)]
        flat, dst = x.reshape(-1), out.reshape(-1)
        rounds = self._slot_rounds(job, flat, send_starts, sends, biggest, dev, stream, watch)
        for lo, per, blocks in rounds:
            for r in range(n):  # this round's piece of what rank r sends us
                s, e = lo, min(lo + per, outs[r] * row)
                if e > s:
                    dev.copy(stream, dst[recv_starts[r] + s : recv_starts[r] + e],
                             blocks[r][me * per : me * per + e - s])  # fmt: skip
        return out

    # -- small calls: through the host ---------------------------------------------------------
    def _through_host(self, job: Job, call: Call, dev: IpcDevice, stream: Any,
                      watch: Any) -> Any:  # fmt: skip
        """One device-to-host copy into the reused pinned buffer, one wait, the host
        collective on it, one host-to-device copy left on the caller's stream."""
        x, out = call.x, call.out
        assert x is not None
        prev = self._small_stream
        if prev is not None and prev is not stream:
            dev.complete(prev, watch)  # its host-to-device copy still reads the buffer
        self._small_stream = stream
        xin = int(x.nbytes)
        nout = 0 if out is None else int(out.nbytes)
        pinned = dev.pinned(xin + nout)
        hx = pinned[:xin].view(x.dtype).reshape(x.shape)
        sends = call.name != "broadcast" or call.root == self.rank
        if sends:
            dev.d2h(stream, hx, x)
            dev.complete(stream, watch)  # the one wait of the call
        hout = None
        if out is not None:
            hout = pinned[xin : xin + nout].view(out.dtype).reshape(out.shape)
        host_call = call._replace(x=hx, out=hout)
        self.calls.run_host(job, host_call)
        result = x
        if out is not None and hout is not None:
            dev.h2d(stream, out, hout)
            result = out
        elif call.name == "all_reduce" or (call.name == "broadcast" and not sends):
            dev.h2d(stream, x, hx)
        if dev.host_reads:
            dev.complete(stream, watch)
        return result


def _shared(call: Call, n: int) -> Call:
    """``call`` as every rank fingerprints it: an uneven collective's per-rank counts
    (all_to_all_v's differ from rank to rank) are left out, and checked by the call."""
    shape = call.shape
    if shape is None or not call.name.endswith("_v"):
        return call
    rest = shape[2 * n :] if call.name == "all_to_all_v" else shape[n:]
    return call._replace(shape=(n, *rest))


class _Shape:
    """The rows a non-root rank of an ``ipc`` scatter does not have: their shape only."""

    def __init__(self, shape: tuple[int, int], dtype: np.dtype[Any]) -> None:
        self.shape = shape
        self.dtype = dtype


def ipc_of(calls: WorkspaceCollectives) -> IpcCollectives | None:
    """The ``ipc`` extension of a group's workspace collectives, if it has one."""
    ext = calls.extensions.get(IPC_ALGO)
    return ext if isinstance(ext, IpcCollectives) else None
