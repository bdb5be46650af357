"""A shared workspace: one memory segment that every rank of a group on one host maps.

The collectives over it (:mod:`ringcomm.collectives.workspace`) need no ring and no socket:
every rank reads the others' buffers. The segment is an anonymous ``memfd`` made by rank 0
and opened by the others through ``/proc/<pid>/fd/<fd>`` (nothing in /dev/shm, nothing left
behind whichever rank dies first): a control line per rank (only its owner writes it: its
arrival count, whether it sleeps, the first collective it failed, its call's fingerprint),
a bell page, and two buffers per rank. Synchronisation ``k`` is complete when every rank's
arrival count is at least ``k``; rounds alternate each rank's two buffers, so writing
buffer ``b`` in round ``r`` is safe once sync ``r-1`` is complete. Waiting spins
(:data:`SPIN_S`), then sleeps on the bell (a futex) in slices of :data:`SLEEP_SLICE_S`
between which the caller's ``idle`` check runs. It relies on x86-64's store order (TSO),
so it is only used there (``AVAILABLE``). docs/architecture.md ("The shared workspace")
has the layout, the waiting protocol and the ordering argument.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import select
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "AVAILABLE",
    "FAILED",
    "LINE_WORDS",
    "SLOT_BYTES",
    "Window",
    "Workspace",
    "WorkspaceTimeout",
]

#: x86-64 Linux with memfd (the module docstring says why x86-64).
AVAILABLE = (
    hasattr(os, "memfd_create")
    and hasattr(os, "MFD_CLOEXEC")
    and platform.system() == "Linux"
    and platform.machine().lower() in ("x86_64", "amd64")
)
#: Bytes of each of a rank's two buffers: the largest piece of one round.
SLOT_BYTES = 4 << 20
#: The piece of one round of a large call (at most a buffer; smaller if chunk_bytes is).
#: Measured, all_reduce W=2: 1 MiB rounds 1.5-2x the busbw of 4 MiB ones from 4 MiB up
#: (the round's data stays in cache between copy-in, reduction and copy-out).
ROUND_BYTES = 1 << 20
#: A rank's control line: 56 words of 8 bytes (whole cache lines, no false sharing).
LINE_WORDS = 56
_LINE_BYTES = LINE_WORDS * 8
_BELL_BYTES = 4096
# Words of a control line.
ARRIVE = 0  # synchronisations reached
SLEEP = 1  # the synchronisation it sleeps waiting for (0: awake)
FAILED = 2  # the sequence number of the first collective it failed (0: none)
FP = 3  # first fingerprint word (the collectives' module fills FP..LINE_WORDS-1)
#: How long a waiter looks at the counts before it sleeps (yielding the core between
#: looks when ranks outnumber cores). Measured (benchmarks/results/workspace.md): 50 us
#: made large calls sleep between rounds and pay a futex wake each time; 1 ms did not
#: slow the small ones, and at 4 ranks on 2 cores it was the fastest of 0-1 ms (the
#: yields give the core to the rank that is late).
SPIN_S = 1e-3
#: Longest sleep before the waiter runs its ``idle`` check.
SLEEP_SLICE_S = 0.002

_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_SYS_FUTEX = 202  # x86-64


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> Any:
    if not AVAILABLE:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()


class WorkspaceTimeout(Exception):
    """A wait ran past its deadline (the caller turns it into its own error)."""


def segment_bytes(world_size: int, slot_bytes: int = SLOT_BYTES) -> int:
    """Size of the segment of a group of ``world_size`` ranks."""
    head = world_size * _LINE_BYTES + _BELL_BYTES
    head = (head + 4095) // 4096 * 4096
    return head + world_size * 2 * slot_bytes


def create_segment(world_size: int, slot_bytes: int = SLOT_BYTES) -> int:
    """A new segment's descriptor (rank 0 makes it; pages are allocated when touched)."""
    fd = os.memfd_create("ringcomm-workspace", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, segment_bytes(world_size, slot_bytes))
    except OSError:
        os.close(fd)
        raise
    return fd


def create_window(world_size: int, nbytes: int) -> tuple[int, int]:
    """A new window's descriptor and the bytes of each rank's part (page-aligned)."""
    part = max(4096, (nbytes + 4095) // 4096 * 4096)
    fd = os.memfd_create("ringcomm-window", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, world_size * part)
    except OSError:
        os.close(fd)
        raise
    return fd, part


class Window:
    """A symmetric allocation: one part per rank of a segment every rank maps, so each
    rank's array can be read (and written) by the others."""

    def __init__(self, fd: int, world_size: int, part_bytes: int, index: int) -> None:
        self.index = index
        self.part_bytes = part_bytes
        try:
            self._map = mmap.mmap(fd, world_size * part_bytes)
        finally:
            os.close(fd)
        self.parts = [
            np.frombuffer(self._map, np.uint8, part_bytes, r * part_bytes)
            for r in range(world_size)
        ]
        self.bases = [int(p.ctypes.data) for p in self.parts]

    def locate(self, rank: int, address: int, nbytes: int) -> int | None:
        """The offset of ``nbytes`` at ``address`` inside ``rank``'s part, or None."""
        offset = address - self.bases[rank]
        if offset >= 0 and offset + nbytes <= self.part_bytes:
            return offset
        return None


def open_segment(pid: int, fd: int, size: int) -> int:
    """Open the segment that process ``pid`` holds as ``fd``; OSError if it cannot be."""
    mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.fstat(mine).st_size != size:
            raise OSError(f"segment of pid {pid} has {os.fstat(mine).st_size} bytes, not {size}")
    except OSError:
        os.close(mine)
        raise
    return mine


class Workspace:
    """One rank's view of a group's segment (``fd``; the workspace owns it from here)."""

    def __init__(
        self,
        fd: int,
        rank: int,
        world_size: int,
        pids: Sequence[int],
        slot_bytes: int = SLOT_BYTES,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        size = segment_bytes(world_size, slot_bytes)
        self._fd = fd
        self._map = mmap.mmap(fd, size)
        n = world_size
        self.lines = np.frombuffer(self._map, np.uint64, n * LINE_WORDS, 0).reshape(n, LINE_WORDS)
        self.line = self.lines[rank]
        #: The control words as Python ints (a memoryview: cheaper than NumPy per word).
        self.words = memoryview(self._map)[: n * _LINE_BYTES].cast("Q")
        self._arrive_at = [r * LINE_WORDS + ARRIVE for r in range(n)]
        self._sleep_at = [r * LINE_WORDS + SLEEP for r in range(n)]
        self._failed_at = [r * LINE_WORDS + FAILED for r in range(n)]
        self._mine = rank * LINE_WORDS
        self._bell = np.frombuffer(self._map, np.uint32, 1, n * _LINE_BYTES)
        self._bell_addr = self._bell.ctypes.data
        # In the bell's page, a cache line of its own: nonzero once any rank marked a
        # failure (mark_failed), so the check after a sync reads one word while all is well.
        flag_at = n * _LINE_BYTES + 64
        self._any_failed = memoryview(self._map)[flag_at : flag_at + 8].cast("Q")
        head = size - n * 2 * slot_bytes
        #: buffers[rank][b]: rank's buffer b (uint8 views of the segment).
        self.buffers = [
            [
                np.frombuffer(self._map, np.uint8, slot_bytes, head + (2 * r + b) * slot_bytes)
                for b in (0, 1)
            ]
            for r in range(n)
        ]
        self.count = int(self.line[ARRIVE])  # this rank's synchronisations so far
        self.late_wakes = 0
        self.sleeps = 0
        self._pidfds: list[tuple[int, int]] = []  # (group rank, pidfd) of the others
        self._poller = select.poll()
        for r, pid in enumerate(pids):
            if r == rank:
                continue
            try:
                pfd = os.pidfd_open(pid)
            except (OSError, AttributeError):
                continue  # gone already (found at the first wait) or no pidfds here
            self._pidfds.append((r, pfd))
            self._poller.register(pfd, select.POLLIN)
        self.closed = False

    # -- synchronisation ---------------------------------------------------------------
    def arrive(self) -> int:
        """Reach the next synchronisation (returns its number); :meth:`wait` for it."""
        k = self.count = self.count + 1
        self.words[self._mine + ARRIVE] = k
        return k

    def complete(self, k: int) -> bool:
        words = self.words
        for i in self._arrive_at:  # noqa: SIM110 (a loop: cheaper than all() of a generator)
            if words[i] < k:
                return False
        return True

    # -- one outcome per collective -------------------------------------------------------
    def mark_failed(self, seq: int) -> None:
        """This rank failed the group's collective ``seq`` (the first mark stays: the group
        is failed here from then on). Any algorithm on the workspace calls it when a call
        fails, and :meth:`failed_peer` before it completes one."""
        at = self._mine + FAILED
        if not self.words[at] and seq > 0:
            self.words[at] = seq
            self._any_failed[0] = 1  # after the mark (TSO: seen in that order)

    def failed_peer(self, seq: int) -> tuple[int, int] | None:
        """``(rank, its failed seq)`` of a rank that failed collective ``seq`` or an
        earlier one, or None (a few loads: cheap enough after every synchronisation)."""
        if not self._any_failed[0]:
            return None
        words = self.words
        for r, i in enumerate(self._failed_at):
            v = words[i]
            if v and v <= seq:
                return r, int(v)
        return None

    def late(self, k: int) -> list[int]:
        """The ranks that have not reached synchronisation ``k``."""
        words = self.words
        return [r for r, i in enumerate(self._arrive_at) if words[i] < k]

    def wait(self, k: int, deadline: float, idle: Callable[[], None]) -> None:
        """Return once synchronisation ``k`` is complete. ``idle()`` runs between sleeps
        (it raises to give up); WorkspaceTimeout at ``deadline`` (``time.monotonic()``)."""
        complete = self.complete
        if complete(k):
            self._ring_if_sleepers()
            return
        spin_until = time.perf_counter() + SPIN_S
        # Always yield between looks: on a host busy with other work, the rank we wait for
        # may be waiting for our core (measured: without yields a loaded 2-core machine
        # made 2 KiB all_reduce take 1.7 ms instead of 40 us).
        yield_ = os.sched_yield
        while not complete(k):
            yield_()
            if time.perf_counter() > spin_until:
                self._sleep(k, deadline, idle)
                break
        self._ring_if_sleepers()

    def _sleep(self, k: int, deadline: float, idle: Callable[[], None]) -> None:
        words, bell, complete = self.words, self._bell, self.complete
        mine = self._mine + SLEEP
        ts = _Timespec(0, int(SLEEP_SLICE_S * 1e9))
        while True:
            ring = int(bell[0])
            words[mine] = k
            if complete(k):
                words[mine] = 0
                return
            self.sleeps += 1
            if _syscall is not None:
                _syscall(_SYS_FUTEX, ctypes.c_void_p(self._bell_addr), _FUTEX_WAIT, ring,
                         ctypes.byref(ts), None, 0)  # fmt: skip
            else:
                time.sleep(SLEEP_SLICE_S / 4)
            words[mine] = 0
            if complete(k):
                if int(bell[0]) == ring:
                    self.late_wakes += 1  # woken by the slice's end, not by the bell
                return
            idle()
            if time.monotonic() > deadline:
                raise WorkspaceTimeout

    def _ring_if_sleepers(self) -> None:
        words = self.words
        for i in self._sleep_at:
            if words[i]:
                break
        else:
            return  # nobody sleeps: no system call
        self._bell[0] = (int(self._bell[0]) + 1) & 0xFFFFFFFF
        if _syscall is not None:
            _syscall(_SYS_FUTEX, ctypes.c_void_p(self._bell_addr), _FUTEX_WAKE,
                     0x7FFFFFFF, None, None, 0)  # fmt: skip

    def dead_peers(self) -> list[int]:
        """Group ranks of the others whose process has ended (never blocks)."""
        if not self._pidfds or self.closed:
            return []
        ready = {fd for fd, ev in self._poller.poll(0) if ev & select.POLLIN}
        return [r for r, pfd in self._pidfds if pfd in ready]

    # -- closing -----------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for _, pfd in self._pidfds:
            with contextlib.suppress(OSError):
                os.close(pfd)
        self._pidfds = []
        # The arrays view the map: drop them; the map goes with the last view (a user may
        # still hold one of a symmetric buffer).
        self.lines = self.line = np.zeros((1, LINE_WORDS), np.uint64)
        self._bell = np.zeros(1, np.uint32)
        self.buffers = []
        try:
            self._map.close()
        except BufferError:
            pass
        with contextlib.suppress(OSError):
            os.close(self._fd)
