"""The rank-side timing loop, the same for every implementation (ringcomm, Gloo, MPI).

For each size of the sweep, every rank, for ``rounds`` rounds, for each implementation in
turn (A B A B ..., so machine drift hits all of them alike):

1. ``impl.sync()`` -- the ranks line up (a barrier of that implementation; only here, never
   between iterations);
2. ``step = impl.prepare(spec, input)`` -- fresh buffers holding this rank's rank-seeded
   input; ``step()`` runs the operation once and returns the output buffer;
3. first round with ``check``: one ``step()`` and its output compared with the NumPy oracle
   (:mod:`~ringcomm.bench.inputs`), before any timing;
4. ``warmup`` untimed steps, then ``iters`` timed ones, back to back, each timed on its own.

Each rank returns plain records (picklable, JSON-able) for the parent to aggregate:
``{"impl", "count", "times_s": [...], "errors": int | None, "algo": str}``, one per
implementation and size, the iteration times of every round pooled (``algo``: what the
implementation's ``algo`` attribute said after its steps, the algorithm its calls took).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ringcomm.bench.inputs import count_wrong, expected_output, rank_input
from ringcomm.bench.spec import BenchConfig, SizeSpec

__all__ = ["MARK", "Impl", "Record", "returning", "run_sweep"]

Record = dict[str, Any]
#: Prefix of the line a rank (or MPI's rank 0) prints with its records, for the parent to
#: pick out of everything else the job prints (a multi-host job's records travel so).
MARK = "RINGCOMM-BENCH-RECORDS "
Step = Callable[[], np.ndarray]

#: Progress lines start once a sweep has run this long (short sweeps stay silent).
PROGRESS_AFTER_S = 2.0


def returning(result: Any, call: Callable[..., object], *args: Any) -> Step:
    """A step that runs ``call(*args)`` and returns ``result``, the buffer the call fills.

    Positional arguments only: a timed step then costs what the call written out in a
    closure costs (the bound method and its arguments are looked up once, here)."""

    def step() -> Any:
        call(*args)
        return result

    return step


class Impl(Protocol):
    """One implementation of the operations, as the sweep drives it."""

    name: str

    def sync(self) -> None:
        """All ranks line up (called between implementations, never between iterations)."""

    def prepare(self, spec: SizeSpec, data: np.ndarray) -> Step:
        """Allocate the buffers of ``spec`` (input initialised from ``data``); return a
        function that runs the operation once and returns the output buffer as NumPy."""


def run_sweep(
    impls: Sequence[Impl],
    config: BenchConfig,
    rank: int,
    *,
    specs: Sequence[SizeSpec] | None = None,
    progress: bool | None = None,
) -> list[Record]:
    """Run the sweep of ``config`` over ``impls`` on this rank; return its records.

    ``progress`` (default: rank 0 unless ``config.quiet``) prints one line per size on
    stderr once the sweep has run for :data:`PROGRESS_AFTER_S`.
    """
    specs = config.sizes() if specs is None else list(specs)
    show = (rank == 0 and not config.quiet) if progress is None else progress
    start = time.perf_counter()
    records: list[Record] = []
    for index, spec in enumerate(specs):
        data = rank_input(spec, rank, config.seed)
        expected = expected_output(spec, rank, config.seed) if config.check else None
        times: dict[str, list[float]] = {impl.name: [] for impl in impls}
        errors: dict[str, int | None] = {impl.name: None for impl in impls}
        algos: dict[str, str] = {impl.name: impl.name for impl in impls}
        for rnd in range(config.rounds):
            for impl in impls:
                impl.sync()
                step = impl.prepare(spec, data)
                if rnd == 0 and expected is not None and getattr(impl, "checked", True):
                    errors[impl.name] = count_wrong(step(), expected)
                times[impl.name].extend(_time_steps(step, config.warmup, config.iters))
                algos[impl.name] = str(getattr(impl, "algo", impl.name))
                del step
        for impl in impls:
            records.append(
                {
                    "impl": impl.name,
                    "count": spec.count,
                    "times_s": times[impl.name],
                    "errors": errors[impl.name],
                    "algo": algos[impl.name],
                }
            )
        elapsed = time.perf_counter() - start
        if show and elapsed >= PROGRESS_AFTER_S:
            medians = "  ".join(
                f"{name} {statistics.median(t) * 1e6:.1f} us" for name, t in times.items()
            )
            print(
                f"# [{index + 1}/{len(specs)}] {spec.op} {spec.nbytes} B: {medians} "
                f"(rank 0 medians; {elapsed:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return records


def _time_steps(step: Step, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        step()
    clock = time.perf_counter
    out = []
    for _ in range(iters):
        t0 = clock()
        step()
        out.append(clock() - t0)
    return out
