"""Figures of bench results (matplotlib, the ``plot`` extra): busbw and latency vs size.

Works on JSON rows (:func:`~ringcomm.bench.report.json_row`), so the same code draws a
fresh ``--plot`` and regenerates published figures from ``--json`` files
(``benchmarks/figures.py``). One row of two panels per operation: bus bandwidth (GB/s,
log-x) and time (us, log-log), one line per implementation.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["matplotlib_missing", "plot_rows"]

_STYLE = {"ringcomm": ("tab:blue", "o"), "gloo": ("tab:orange", "s"), "mpi": ("tab:green", "^")}


def matplotlib_missing() -> str | None:
    """Why plots cannot be drawn here (None: they can)."""
    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'ringcomm[plot]' (or pip install matplotlib)"
    return None


def _size_label(nbytes: float) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g}{unit}"
    return f"{nbytes:g}"


def plot_rows(rows: Sequence[Mapping[str, Any]], path: str, title: str | None = None) -> None:
    """Draw ``rows`` (JSON rows of one world size, any ops and implementations) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ops = list(dict.fromkeys(r["op"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.6 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        ax_bw, ax_t = axes[i]
        for impl in impls:
            mine = sorted(
                (r for r in rows if r["op"] == op and r["impl"] == impl), key=lambda r: r["bytes"]
            )
            if not mine:
                continue
            color, marker = _STYLE.get(impl, (None, "x"))
            xs = [r["bytes"] for r in mine]
            for ax, key in ((ax_bw, "busbw_GBps"), (ax_t, "time_us")):
                ys = [r[key] for r in mine]
                ax.plot(xs, ys, marker=marker, color=color, label=impl, markersize=4)
        world = next((r["world_size"] for r in rows if r["op"] == op), "?")
        dtype = next((r["dtype"] for r in rows if r["op"] == op), "?")
        for ax, what in ((ax_bw, "bus bandwidth (GB/s)"), (ax_t, "time (µs, median)")):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _size_label(v)))
            ax.set_xlabel("size per rank (bytes)")
            ax.set_ylabel(what)
            ax.set_title(f"{op}, {world} ranks, {dtype}")
            ax.grid(True, which="major", alpha=0.3)
            ax.legend()
        ax_t.set_yscale("log")
        # Ticks at 1, 2 and 5 per decade: a sweep whose times span less than a decade
        # still gets several labels (with only the powers of ten it got one, or none).
        ax_t.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax_t.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax_t.yaxis.set_minor_formatter(NullFormatter())
        low, high = ax_t.get_ylim()
        if high / max(low, 1e-12) < 2.5:  # (within one 1-2-5 step: label the minor ticks)
            ax_t.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax_bw.set_ylim(bottom=0)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
