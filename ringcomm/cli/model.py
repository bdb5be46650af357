"""``ringcomm model --hosts H --ranks-per-host L --size S``: predicted times per algorithm.

Prints, from the alpha-beta-gamma model of :mod:`ringcomm.tuning.costmodel`, one row per algorithm
of ``--op`` for the given world (time, nccl-tests busbw, bytes on the busiest host uplink),
the winner and the sizes where the winner changes; then a scan of worlds of 1, 2, 4, ...,
512 hosts of ``L`` ranks (2 to 4096 ranks) with each row's winner and crossover points.
Parameters: ``--model FILE`` (written by ``ringcomm tune``), else the defaults; the link
options override either. ``--plot F.png`` (matplotlib) draws predicted busbw vs ranks;
``--json F`` writes all of it. Exit status: 0; 2 for a usage error, an unreadable model or
a missing matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from ringcomm.config import UsageError, check_output_path, format_size, size_arg
from ringcomm.tuning.costmodel import (
    ALGORITHMS,
    HIER_SEGMENT_BYTES,
    CostModel,
    Crossover,
    LinkModel,
    Prediction,
    best,
    crossovers,
)

__all__ = [
    "ASSUMPTIONS",
    "SCAN_HOSTS",
    "add_link_options",
    "add_parser",
    "format_scan",
    "format_world",
    "main",
    "model_from_args",
    "scan",
]

#: Host counts of the scan (each times --ranks-per-host ranks; rows of 2..4096 ranks kept).
SCAN_HOSTS: tuple[int, ...] = tuple(1 << i for i in range(10))
SCAN_MAX_RANKS = 4096

ASSUMPTIONS = (
    "ranks numbered host by host; same-host links are per rank, not shared; each host has one "
    "full-duplex uplink that all its ranks share; a message costs alpha at its sender and its "
    "receiver once per piece (messages of different ranks overlap their latency); a step lasts "
    "as long as its busiest link and its busiest reducer, overlapped piece by piece; ps: one "
    "server per host (--ps-servers), on hosts of their own; no congestion beyond the uplink, no "
    "jitter; with a CPU term (ringcomm tune --hostfile) a step lasts at least the CPU time of "
    "the busiest host's ranks on the cores they share (with co-located hosts), and hierarchical "
    "calls are priced in segments"
)


def add_link_options(p: argparse.ArgumentParser, *, local: bool = True) -> None:
    """The options that override a model's parameters (shared with ``ringcomm tune``)."""
    g = p.add_argument_group("link parameters (override --model / the defaults)")
    g.add_argument(
        "--net-gbps",
        "--link-gbps",
        type=float,
        metavar="GBIT",
        help="each host's uplink rate, Gbit/s (default 1)",
    )
    g.add_argument(
        "--net-latency-us",
        "--link-latency-us",
        type=float,
        metavar="US",
        help="latency per message across hosts, us (default 50)",
    )
    if local:
        g.add_argument(
            "--local-gbps",
            type=float,
            metavar="GBIT",
            help="same-host link rate, Gbit/s (default 20 = 2.5 GB/s)",
        )
        g.add_argument(
            "--local-latency-us",
            type=float,
            metavar="US",
            help="latency per message on one host, us (default 20)",
        )
        g.add_argument(
            "--reduce-gbps", type=float, metavar="GBYTE", help="reduction rate, GB/s (default 6)"
        )
        g.add_argument(
            "--overhead-us", type=float, metavar="US", help="fixed cost per call, us (default 10)"
        )
        g.add_argument(
            "--chunk-bytes",
            type=size_arg,
            metavar="SIZE",
            help="piece size of pipelined transfers (default 4M)",
        )


def _positive(args: argparse.Namespace, name: str, *, zero_ok: bool = False) -> float | None:
    v = getattr(args, name, None)
    if v is None:
        return None
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        flag = "--" + name.replace("_", "-")
        raise UsageError(f"{flag} must be {'>= 0' if zero_ok else '> 0'}, got {v}")
    return float(v)


def model_from_args(args: argparse.Namespace, base: CostModel | None = None) -> CostModel:
    """``--model FILE`` (or ``base``, or the defaults) with the link options applied."""
    path = getattr(args, "model", None)
    if base is None:
        if path:
            try:
                base = CostModel.load(path)
            except (OSError, ValueError) as exc:
                raise UsageError(f"--model: {exc}") from None
        else:
            base = CostModel()
    changes: dict[str, Any] = {}
    net_gbps, net_lat = _positive(args, "net_gbps"), _positive(args, "net_latency_us", zero_ok=True)
    if net_gbps is not None or net_lat is not None:
        changes["net"] = LinkModel(
            base.net.alpha_s if net_lat is None else net_lat * 1e-6,
            base.net.beta_s_per_byte if net_gbps is None else 8.0 / (net_gbps * 1e9),
        )
    loc_gbps = _positive(args, "local_gbps")
    loc_lat = _positive(args, "local_latency_us", zero_ok=True)
    if loc_gbps is not None or loc_lat is not None:
        changes["local"] = LinkModel(
            base.local.alpha_s if loc_lat is None else loc_lat * 1e-6,
            base.local.beta_s_per_byte if loc_gbps is None else 8.0 / (loc_gbps * 1e9),
        )
    reduce_gbps = _positive(args, "reduce_gbps")
    if reduce_gbps is not None:
        changes["gamma_s_per_byte"] = 1.0 / (reduce_gbps * 1e9)
    overhead = _positive(args, "overhead_us", zero_ok=True)
    if overhead is not None:
        changes["overhead_s"] = overhead * 1e-6
    chunk = getattr(args, "chunk_bytes", None)
    if chunk is not None:
        if chunk < 1:
            raise UsageError(f"--chunk-bytes must be > 0, got {chunk}")
        changes["chunk_bytes"] = int(chunk)
    if changes:
        changes["source"] = base.source + " + options"
        return base.replace(**changes)
    return base


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "model",
        help="predicted time of each collective algorithm on H hosts x L ranks (cost model)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("--hosts", type=int, required=True, metavar="H", help="hosts")
    p.add_argument("--ranks-per-host", type=int, required=True, metavar="L", help="ranks per host")
    p.add_argument(
        "--size",
        type=size_arg,
        required=True,
        metavar="S",
        help="bytes per rank as nccl-tests counts them (K/M/G suffixes)",
    )
    p.add_argument(
        "--op",
        default="all_reduce",
        choices=tuple(ALGORITHMS),
        metavar="OP",
        help=f"one of {', '.join(ALGORITHMS)} (default %(default)s)",
    )
    p.add_argument(
        "--ps-servers",
        type=int,
        metavar="P",
        help="parameter servers (ps rows; default one per host)",
    )
    p.add_argument("--model", metavar="FILE.json", help="parameters written by ringcomm tune")
    add_link_options(p)
    p.add_argument("--no-scan", action="store_true", help="only the given world")
    p.add_argument("--plot", metavar="F.png", help="draw predicted busbw vs ranks (matplotlib)")
    p.add_argument("--json", metavar="F", help="write the predictions, scan and crossovers")
    p.set_defaults(main=main)
    return p


def _fmt_time(seconds: float) -> str:
    us = seconds * 1e6
    if us < 1e3:
        return f"{us:.1f} us"
    if us < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.3g} s"


def _fmt_bytes(nbytes: int) -> str:
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g}{suffix}"
    return f"{nbytes} B"


def _fmt_cross(found: Sequence[Crossover]) -> str:
    if not found:
        return "none"
    return ", ".join(f"{c.before}->{c.after} at {_fmt_bytes(c.size)}" for c in found)


def format_world(preds: Sequence[Prediction], winner: str) -> str:
    """The table of one world: one row per algorithm."""
    lines = [f"{'algorithm':<14}{'time':>12}{'busbw GB/s':>12}{'uplink bytes':>14}  "]
    for p in preds:
        mark = "  <- best" if p.algo == winner else ""
        lines.append(
            f"{p.algo:<14}{_fmt_time(p.time_s):>12}{p.busbw_GBps:>12.3f}"
            f"{p.uplink_bytes:>14.4g}{mark}"
        )
    return "\n".join(lines) + "\n"


def _group_choice(model: CostModel, hosts: int, ranks_per_host: int, size: int, op: str) -> str:
    """What a group of this shape runs with ``model`` (the registry's chooser: its
    algorithms, piece sizes and, with a CPU term, hier's segment size), as a ``#`` line."""
    from ringcomm.collectives import ALGORITHMS as REGISTRY
    from ringcomm.collectives.chooser import MODELLED, ModelChooser

    n = hosts * ranks_per_host
    if op not in MODELLED or n < 2:
        return ""
    nbytes = max(1, size // n) if MODELLED[op] else size
    chooser = ModelChooser(model, hosts, ranks_per_host, n, REGISTRY, chunk_bytes=model.chunk_bytes)
    hier = hosts >= 2 and ranks_per_host >= 2
    choice = chooser.choose(op, nbytes, hier=hier)
    if choice is None:
        return ""
    how = [f"pieces of {format_size(choice.chunk_bytes or model.chunk_bytes)}"]
    if choice.algo == "hier":
        how = [f"segments of {format_size(choice.segment_bytes or HIER_SEGMENT_BYTES)}"]
    return (
        f"# a group of this shape runs: {choice.algo} ({', '.join(how)}), predicted "
        f"{_fmt_time(choice.time_s)} (the registry's choice; sizes priced per quarter octave)\n"
    )


def scan(
    model: CostModel, ranks_per_host: int, size: int, op: str, servers: int | None = None
) -> list[tuple[int, str, list[Prediction], list[Crossover]]]:
    """(hosts, winner, predictions, crossovers) for 1..512 hosts of ``ranks_per_host``
    (worlds of 2 to 4096 ranks)."""
    rows = []
    for hosts in SCAN_HOSTS:
        n = hosts * ranks_per_host
        if n < 2 or n > SCAN_MAX_RANKS:
            continue
        winner, preds = best(model, hosts, ranks_per_host, size, op, servers=servers)
        found = crossovers(model, hosts, ranks_per_host, op, servers=servers)
        rows.append((hosts, winner, preds, found))
    return rows


def format_scan(
    rows: Sequence[tuple[int, str, list[Prediction], list[Crossover]]], ranks_per_host: int
) -> str:
    if not rows:
        return "# scan: no world of 2..4096 ranks with this many ranks per host\n"
    algos = [p.algo for p in rows[0][2]]
    head = f"{'hosts':>6}{'ranks':>7}" + "".join(f"{a:>14}" for a in algos)
    lines = [head + f"  {'winner':<14}crossovers (winner changes, 1 B..4 GiB)"]
    for hosts, winner, preds, found in rows:
        cells = "".join(f"{_fmt_time(p.time_s):>14}" for p in preds)
        lines.append(
            f"{hosts:>6}{hosts * ranks_per_host:>7}{cells}  {winner:<14}{_fmt_cross(found)}"
        )
    return "\n".join(lines) + "\n"


def _plot(
    rows: Sequence[tuple[int, str, list[Prediction], list[Crossover]]], path: str, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    algos = [p.algo for p in rows[0][2]]
    for i, algo in enumerate(algos):
        xs = [r[2][i].world_size for r in rows]
        ax.plot(xs, [r[2][i].busbw_GBps for r in rows], marker="o", markersize=4, label=algo)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if args.hosts < 1:
        raise UsageError(f"--hosts must be >= 1, got {args.hosts}")
    if args.ranks_per_host < 1:
        raise UsageError(f"--ranks-per-host must be >= 1, got {args.ranks_per_host}")
    if args.size < 1:
        raise UsageError(f"--size must be >= 1 byte, got {args.size}")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError(
                "--plot needs matplotlib: pip install 'ringcomm[plot]' (or pip install matplotlib)"
            )
        if args.no_scan:
            raise UsageError("--plot draws the scan: drop --no-scan")
    if args.ps_servers is not None and args.ps_servers < 1:
        raise UsageError(f"--ps-servers must be >= 1, got {args.ps_servers}")
    model = model_from_args(args)
    H, L, S, op, P = args.hosts, args.ranks_per_host, args.size, args.op, args.ps_servers
    winner, preds = best(model, H, L, S, op, servers=P)
    found = crossovers(model, H, L, op, servers=P)
    out = sys.stdout
    out.write(
        f"# ringcomm model {op}: {H} host(s) x {L} rank(s) = {H * L} ranks, "
        f"{format_size(S)} ({S} B) per rank\n"
        f"# parameters: {model.describe()}\n"
        f"# assumptions: {ASSUMPTIONS}\n"
        "# busbw: nccl-tests' factors (all_reduce 2(n-1)/n, gathers (n-1)/n, broadcast 1); "
        "uplink bytes: sent by the busiest host, summed over steps\n#\n"
    )
    out.write(format_world(preds, winner))
    out.write(f"# best: {winner}; winner changes over 1 B..4 GiB: {_fmt_cross(found)}\n")
    out.write(_group_choice(model, H, L, S, op))
    rows = [] if args.no_scan else scan(model, L, S, op, P)
    if not args.no_scan:
        out.write(f"#\n# scan: {op} of {format_size(S)}, 1..512 hosts x {L} ranks per host\n")
        out.write(format_scan(rows, L))
    out.flush()
    if args.json:
        doc = {
            "op": op,
            "hosts": H,
            "ranks_per_host": L,
            "bytes": S,
            "model": model.to_dict(),
            "assumptions": ASSUMPTIONS,
            "predictions": [p.to_dict() for p in preds],
            "winner": winner,
            "crossovers": [vars(c) for c in found],
            "scan": [
                {
                    "hosts": h,
                    "world_size": h * L,
                    "winner": w,
                    "predictions": [p.to_dict() for p in ps],
                    "crossovers": [vars(c) for c in cs],
                }
                for h, w, ps, cs in rows
            ],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if args.plot:
        if not rows:
            raise UsageError("--plot: the scan has no world of 2..4096 ranks to draw")
        _plot(rows, args.plot, f"{op} of {format_size(S)}: predicted busbw, {L} ranks per host")
        print(f"wrote {args.plot}")
    return 0
