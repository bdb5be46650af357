"""Results of a sweep (pure): aggregation, the nccl-tests-style table, JSON rows, the footer.

Timing convention (BENCHMARKING.md): operations run back to back (no barrier per
iteration); every rank records each iteration's time; ``time_us`` is, per rank, the median
of its iteration times, then the maximum over ranks. ``p50_us``/``p99_us`` are percentiles
of *all* iteration times of *all* ranks pooled (with 20 iterations x 2 ranks the p99 is
nearly the slowest iteration). With ``rounds > 1`` each rank's iterations of every round
are pooled before its median is taken. algbw = bytes / time (GB/s = 1e9 B/s), busbw = algbw
x the op's factor (:func:`~ringcomm.bench.spec.busbw_factor`).

``errors`` is the number of wrong elements summed over ranks (nccl-tests' ``#wrong``), or
None when results were not checked (``N/A`` in the table, ``null`` in JSON).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringcomm.bench.spec import BenchConfig, SizeSpec
from ringcomm.bench.sweep import Record

__all__ = [
    "JSON_KEYS",
    "Result",
    "aggregate",
    "format_footer",
    "format_header",
    "format_markdown",
    "format_row",
    "format_table",
    "json_row",
    "merge_rounds",
    "ratio",
    "summarize",
]

#: Keys every JSON row has (docs/contracts.md, JSON output), in this order; extra keys follow.
JSON_KEYS: tuple[str, ...] = (
    "impl",
    "op",
    "world_size",
    "bytes",
    "count",
    "dtype",
    "time_us",
    "algbw_GBps",
    "busbw_GBps",
    "errors",
    "algo",
)


@dataclass(frozen=True)
class Result:
    """One size of the sweep measured by one implementation."""

    impl: str
    spec: SizeSpec
    time_us: float  # max over ranks of each rank's median
    p50_us: float  # over every iteration of every rank
    p99_us: float
    errors: int | None  # wrong elements summed over ranks; None: not checked
    iters: int  # iterations per rank (all rounds)
    #: The algorithm the calls took (ringcomm's name, e.g. ``ipc``, ``shm``, ``ring``,
    #: ``hier``; ``p2p`` for sendrecv); a peer's: its own name (``gloo``, ``nccl``, ``mpi``).
    algo: str = ""

    @property
    def algbw_GBps(self) -> float:
        return self.spec.nbytes / (self.time_us * 1e-6) / 1e9 if self.time_us > 0 else 0.0

    @property
    def busbw_GBps(self) -> float:
        return self.algbw_GBps * self.spec.busbw_factor


def summarize(
    impl: str,
    spec: SizeSpec,
    per_rank_times_s: Sequence[Sequence[float]],
    errors: Sequence[int | None] | None = None,
    algo: str = "",
) -> Result:
    """Aggregate per-rank iteration times (seconds) into one :class:`Result`.

    ``errors`` holds each rank's wrong-element count (None where not checked); ``algo``
    the algorithm the calls took.
    """
    if not per_rank_times_s or any(len(t) == 0 for t in per_rank_times_s):
        raise ValueError(f"{impl} {spec.op} {spec.nbytes} B: every rank needs >= 1 time")
    time_s = max(statistics.median(t) for t in per_rank_times_s)
    pooled = np.concatenate([np.asarray(t, dtype=np.float64) for t in per_rank_times_s])
    p50_s, p99_s = np.percentile(pooled, [50.0, 99.0])
    total: int | None = None
    if errors is not None and any(e is not None for e in errors):
        total = sum(int(e) for e in errors if e is not None)
    return Result(
        impl=impl,
        spec=spec,
        time_us=time_s * 1e6,
        p50_us=float(p50_s) * 1e6,
        p99_us=float(p99_s) * 1e6,
        errors=total,
        iters=min(len(t) for t in per_rank_times_s),
        algo=algo,
    )


def merge_rounds(rounds: Sequence[Sequence[Sequence[Record]]]) -> list[list[Record]]:
    """Pool per-rank records of several jobs: times of the same (impl, size) concatenated,
    the first checked error count kept."""
    world = len(rounds[0])
    merged: list[dict[tuple[str, int], Record]] = [{} for _ in range(world)]
    for job in rounds:
        if len(job) != world:
            raise ValueError("merge_rounds: jobs of different world sizes")
        for rank, records in enumerate(job):
            for rec in records:
                key = (rec["impl"], rec["count"])
                have = merged[rank].get(key)
                if have is None:
                    merged[rank][key] = {**rec, "times_s": list(rec["times_s"])}
                else:
                    have["times_s"].extend(rec["times_s"])
                    if have["errors"] is None:
                        have["errors"] = rec["errors"]
    return [list(m.values()) for m in merged]


def aggregate(config: BenchConfig, per_rank: Sequence[Sequence[Record]]) -> list[Result]:
    """Results in sweep order, each size's implementations in ``config.impls`` order."""
    specs = {s.count: s for s in config.sizes()}
    keyed: list[dict[tuple[str, int], Record]] = [
        {(r["impl"], r["count"]): r for r in records} for records in per_rank
    ]
    results = []
    for count, spec in specs.items():
        for impl in config.impls:
            recs = [k[(impl, count)] for k in keyed if (impl, count) in k]
            if not recs:
                continue
            if len(recs) != len(per_rank):
                raise ValueError(f"{impl} {spec.nbytes} B: records from only some ranks")
            times, errors = [r["times_s"] for r in recs], [r["errors"] for r in recs]
            results.append(summarize(impl, spec, times, errors, str(recs[0].get("algo") or "")))
    return results


def ratio(ours: Result, theirs: Result) -> tuple[float, float]:
    """``(busbw ratio, time ratio)`` of ``ours`` over ``theirs``, from unrounded values.

    busbw ratio > 1 and time ratio < 1 both mean ``ours`` is faster (each is the other's
    inverse; the time ratio reads better for latency-bound sizes, whose busbw rounds to 0).
    """
    if ours.spec != theirs.spec:
        raise ValueError("ratio: results of different sizes")
    bw = ours.busbw_GBps / theirs.busbw_GBps if theirs.busbw_GBps > 0 else math.nan
    t = ours.time_us / theirs.time_us if theirs.time_us > 0 else math.nan
    return bw, t


def json_row(result: Result) -> dict[str, Any]:
    """The ``bench --json`` object (docs/contracts.md) of one result (plus p50/p99, redop, root, iters)."""
    s = result.spec
    return {
        "impl": result.impl,
        "op": s.op,
        "world_size": s.world_size,
        "bytes": s.nbytes,
        "count": s.count,
        "dtype": s.dtype,
        "time_us": round(result.time_us, 3),
        "algbw_GBps": round(result.algbw_GBps, 6),
        "busbw_GBps": round(result.busbw_GBps, 6),
        "errors": result.errors,
        "algo": result.algo,
        "p50_us": round(result.p50_us, 3),
        "p99_us": round(result.p99_us, 3),
        "redop": s.redop,
        "root": s.root,
        "iters": result.iters,
    }


# --------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------


def _fmt_time(us: float) -> str:
    """nccl-tests' precision: 2 decimals below 100 us, 1 below 10 ms, none above."""
    if us >= 10000.0:
        return f"{us:.0f}"
    if us >= 100.0:
        return f"{us:.1f}"
    return f"{us:.2f}"


def _fmt_ratio(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


@dataclass(frozen=True)
class _Col:
    title: str
    unit: str
    width: int
    value: Callable[[Result], str]


_SIZE_COLS = (
    _Col("size", "(B)", 12, lambda r: str(r.spec.nbytes)),
    _Col("count", "(elements)", 12, lambda r: str(r.spec.count)),
    _Col("type", "", 8, lambda r: r.spec.dtype),
    _Col("redop", "", 6, lambda r: r.spec.redop or "none"),
    _Col("root", "", 6, lambda r: str(r.spec.root)),
)
_IMPL_COLS = (
    _Col("time", "(us)", 8, lambda r: _fmt_time(r.time_us)),
    _Col("algbw", "(GB/s)", 6, lambda r: f"{r.algbw_GBps:.2f}"),
    _Col("busbw", "(GB/s)", 6, lambda r: f"{r.busbw_GBps:.2f}"),
    _Col("#wrong", "", 6, lambda r: "N/A" if r.errors is None else str(r.errors)),
    _Col("p50", "(us)", 8, lambda r: _fmt_time(r.p50_us)),
    _Col("p99", "(us)", 8, lambda r: _fmt_time(r.p99_us)),
)
_RATIO_WIDTH = 7
_SEP = "  "


def _group_width(cols: Sequence[_Col]) -> int:
    return sum(c.width for c in cols) + len(_SEP) * len(cols)


def format_header(impls: Sequence[str]) -> str:
    """Three ``#`` lines: implementation names, column titles, units."""
    base = impls[0]
    peers = impls[1:]
    size_w = sum(c.width for c in _SIZE_COLS) + len(_SEP) * (len(_SIZE_COLS) - 1)
    line0 = "#" + " " * (size_w - 1)
    line1 = _SEP.join(c.title.rjust(c.width) for c in _SIZE_COLS)
    line2 = _SEP.join(c.unit.rjust(c.width) for c in _SIZE_COLS)
    for impl in impls:
        line0 += impl.center(_group_width(_IMPL_COLS))
        line1 += "".join(_SEP + c.title.rjust(c.width) for c in _IMPL_COLS)
        line2 += "".join(_SEP + c.unit.rjust(c.width) for c in _IMPL_COLS)
    for peer in peers:
        width = 2 * (_RATIO_WIDTH + len(_SEP))
        line0 += f"{base}/{peer}".center(width)
        line1 += _SEP + "busbw".rjust(_RATIO_WIDTH) + _SEP + "time".rjust(_RATIO_WIDTH)
        line2 += _SEP + "(x)".rjust(_RATIO_WIDTH) + _SEP + "(x)".rjust(_RATIO_WIDTH)
    line1 = "#" + line1[1:]
    line2 = "#" + line2[1:]
    return "\n".join(s.rstrip() for s in (line0, line1, line2))


def format_row(results: Sequence[Result]) -> str:
    """One table line: the size columns, then each implementation's group, then ratios
    of the first implementation over each other one."""
    if not results:
        raise ValueError("format_row needs at least one result")
    first = results[0]
    parts = [c.value(first).rjust(c.width) for c in _SIZE_COLS]
    line = _SEP.join(parts)
    for r in results:
        line += "".join(_SEP + c.value(r).rjust(c.width) for c in _IMPL_COLS)
    for peer in results[1:]:
        bw, t = ratio(first, peer)
        line += _SEP + _fmt_ratio(bw).rjust(_RATIO_WIDTH) + _SEP + _fmt_ratio(t).rjust(_RATIO_WIDTH)
    return line


def format_table(results: Sequence[Result], impls: Sequence[str]) -> str:
    """Header and one row per size; rows of the same size across ``impls`` side by side."""
    by_size: dict[SizeSpec, dict[str, Result]] = {}
    for r in results:
        by_size.setdefault(r.spec, {})[r.impl] = r
    lines = [format_header(impls)]
    for spec in sorted(by_size, key=lambda s: s.nbytes):
        group = by_size[spec]
        lines.append(format_row([group[i] for i in impls if i in group]))
    return "\n".join(lines) + "\n"


def format_footer(results: Sequence[Result], impls: Sequence[str]) -> str:
    """nccl-tests' footer: out-of-bounds values, then the average busbw (per implementation,
    the first one plain as nccl-tests prints it), then the median ratio per peer."""
    errors = sum(r.errors or 0 for r in results)
    lines = [f"# Out of bounds values : {errors} {'FAILED' if errors else 'OK'}"]
    for i, impl in enumerate(impls):
        mine = [r.busbw_GBps for r in results if r.impl == impl]
        if not mine:
            continue
        avg = sum(mine) / len(mine)
        suffix = "" if i == 0 else f" ({impl})"
        lines.append(f"# Avg bus bandwidth    : {avg:g}{suffix}")
    base = impls[0]
    for peer in impls[1:]:
        ours = {r.spec: r for r in results if r.impl == base}
        bws = [ratio(ours[r.spec], r)[0] for r in results if r.impl == peer and r.spec in ours]
        bws = [b for b in bws if not math.isnan(b)]
        if bws:
            lines.append(
                f"# {base}/{peer} busbw ratio: median {statistics.median(bws):.2f} "
                f"(min {min(bws):.2f}, max {max(bws):.2f}) over {len(bws)} sizes; "
                f"> 1: {base} faster"
            )
    lines.append("#")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Markdown (published tables, from JSON rows)
# --------------------------------------------------------------------------------------


def _human_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def format_markdown(rows: Sequence[dict[str, Any]], summary_bytes: Sequence[int] = ()) -> str:
    """Markdown tables of JSON rows (any ops, one world size): a summary of the busbw
    ratio of ringcomm over each peer at ``summary_bytes`` (nearest measured size at or
    above), then one table per op with every size."""
    ops = list(dict.fromkeys(r["op"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    base, peers = impls[0], impls[1:]
    by = {(r["op"], r["impl"], r["bytes"]): r for r in rows}

    def _ratio(op: str, peer: str, nbytes: int) -> str:
        ours, theirs = by.get((op, base, nbytes)), by.get((op, peer, nbytes))
        if ours is None or theirs is None or ours["time_us"] <= 0:
            return "–"
        return f"{theirs['time_us'] / ours['time_us']:.2f}"

    out: list[str] = []
    if peers and summary_bytes:
        out.append(f"{base}/{'/'.join(peers)} busbw ratio (> 1: {base} faster):\n")
        head = ["op"] + [f"{p} @ {_human_bytes(b)}" for p in peers for b in summary_bytes]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for op in ops:
            sizes = sorted({r["bytes"] for r in rows if r["op"] == op})
            cells = [op]
            for p in peers:
                for b in summary_bytes:
                    near = next((s for s in sizes if s >= b), None)
                    cells.append("–" if near is None else _ratio(op, p, near))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    for op in ops:
        world = next(r["world_size"] for r in rows if r["op"] == op)
        out.append(f"**{op}**, {world} ranks (time: µs, median; busbw: GB/s)\n")
        head = ["size"]
        for impl in impls:
            head += [f"{impl} time", f"{impl} busbw", f"{impl} p99"]
        head += [f"busbw {base}/{p}" for p in peers]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---:|" * len(head))
        for nbytes in sorted({r["bytes"] for r in rows if r["op"] == op}):
            cells = [_human_bytes(nbytes)]
            for impl in impls:
                r = by.get((op, impl, nbytes))
                if r is None:
                    cells += ["–", "–", "–"]
                else:
                    cells += [
                        _fmt_time(r["time_us"]),
                        f"{r['busbw_GBps']:.3f}",
                        _fmt_time(r.get("p99_us", math.nan)),
                    ]
            cells += [_ratio(op, p, nbytes) for p in peers]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)
