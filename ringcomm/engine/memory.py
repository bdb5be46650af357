"""Measuring a rank's memory: tracemalloc on the host, the CuPy memory pool on a GPU.

A meter is started before the strategy is built, told when each step begins and ends, and
read at the end (docs/contracts.md, JSON output: ``peak_bytes`` is measured, not computed).
:class:`TracemallocMeter` (``cpu``, ``host-staged``): the largest tracemalloc peak within a
step. :class:`CupyPoolMeter` (``cuda``): the high-water of CuPy's default pool's
``total_bytes()`` over the steps (cached blocks released before the first), at least the
true peak of live bytes, exceeding it only by the pool's rounding and fragmentation; the
pinned staging buffers are reported apart (:func:`staging_stats`).
:func:`device_used_bytes` is the pipeline's cheap probe of live device bytes. Why not
CuPy's memory hooks: docs/architecture.md, section "engine/memory.py".
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from typing import Any

__all__ = [
    "CupyPoolMeter",
    "MemoryMeter",
    "TracemallocMeter",
    "device_used_bytes",
    "make_meter",
    "staging_stats",
]


class MemoryMeter:
    """Interface: ``start()``, ``begin_step(step)``, ``end_step()``, ``stop()`` (idempotent:
    the first call takes the final reading); then the ``peak`` and ``held`` bytes and
    ``source`` (what measured them, for the JSON)."""

    source = ""

    def __init__(self) -> None:
        self.peak = 0
        self.held = 0
        self.stopped = False

    def start(self) -> None: ...

    def begin_step(self, step: int) -> None: ...

    def end_step(self) -> None: ...

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self._final()

    def _final(self) -> None: ...


class TracemallocMeter(MemoryMeter):
    source = "tracemalloc"

    def __init__(self) -> None:
        super().__init__()
        self._started = False
        #: Bytes held outside the Python heap that the rank allocated (its parts of
        #: shared-memory buffers): added to what tracemalloc measures.
        self.untraced_bytes = 0

    def start(self) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start()
            self._started = True

    def begin_step(self, step: int) -> None:
        # (a strategy may reset the peak inside its step too: end_step keeps the max)
        tracemalloc.reset_peak()

    def end_step(self) -> None:
        self.peak = max(self.peak, tracemalloc.get_traced_memory()[1] + self.untraced_bytes)

    def _final(self) -> None:
        self.held = tracemalloc.get_traced_memory()[0] + self.untraced_bytes
        if self._started:
            tracemalloc.stop()
            self._started = False


class CupyPoolMeter(MemoryMeter):
    source = "cupy memory pool (high-water of total_bytes)"

    def __init__(self, cp: Any) -> None:
        super().__init__()
        self.pool = cp.get_default_memory_pool()

    def _release_cached(self) -> None:
        gc.collect()  # arrays a finished collective kept alive sit in reference cycles
        self.pool.free_all_blocks()

    # (Nothing at start: CuPy's pool methods act on the *current* device's pool, and the
    # strategy makes the rank's GPU current when it is built, after start.)

    def begin_step(self, step: int) -> None:
        if step == 0:  # outside the timed region, and step 1 is the warm-up anyway
            self._release_cached()

    def end_step(self) -> None:
        self.peak = max(self.peak, int(self.pool.total_bytes()))

    def _final(self) -> None:
        self.peak = max(self.peak, int(self.pool.total_bytes()))
        self.held = int(self.pool.used_bytes())


def make_meter(device: str, xp: Any) -> MemoryMeter:
    """The meter of ``device`` (``xp``: the strategy's array module)."""
    return CupyPoolMeter(xp) if device == "cuda" else TracemallocMeter()


def device_used_bytes(xp: Any) -> Callable[[], int] | None:
    """A probe of the device bytes in use now (the CuPy pool's ``used_bytes``), or None
    for NumPy."""
    get_pool = getattr(xp, "get_default_memory_pool", None)
    if get_pool is None:
        return None
    pool = get_pool()
    return lambda: int(pool.used_bytes())


def staging_stats(device_array: Any | None) -> dict[str, int]:
    """``{"bytes": pinned staging bytes allocated, "acquires": buffers handed out}`` of the
    staging pool serving ``device_array``'s device in this process (zeros for None)."""
    if device_array is None:
        return {"bytes": 0, "acquires": 0}
    from ringcomm.device.staging import backend_for

    pool = backend_for(device_array).pool
    return {"bytes": int(pool.allocated_bytes), "acquires": int(pool.acquires)}
