"""The shared-workspace collectives against Open MPI (shared memory) and Gloo, in one run.

    python benchmarks/workspace_sweep.py OUT_DIR [--ops all_reduce,...] [--worlds 2,4]
                                         [--peers mpi,gloo] [--iters 20]

For each op, world size and peer: two ``ringcomm bench`` invocations (8 B - 32 KiB by 8x,
256 KiB - 64 MiB by 4x), ``--compare PEER --check --rounds 2``, ringcomm's buffers plain
(``host``), symmetric (``symmetric``, all_reduce only) and the memory-bandwidth reference
(``copy``: every rank's numpy.copyto of the size at the same time). Writes the JSON rows to
OUT_DIR/*.jsonl and prints a Markdown table per (op, world size, peer): time and busbw of
each, ringcomm/peer ratios (busbw, > 1: ringcomm faster), and ringcomm's busbw as a
fraction of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

RANGES = (("8", "32K", "8"), ("256K", "64M", "4"))


def run(out: Path, op: str, world: int, peer: str, iters: int) -> list[dict[str, object]]:
    devices = "host,symmetric,copy" if op == "all_reduce" else "host,copy"
    rows: list[dict[str, object]] = []
    for lo, hi, factor in RANGES:
        path = out / f"{op}_w{world}_{peer}_{lo}-{hi}.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "ringcomm",
            "bench",
            op,
            "-n",
            str(world),
            "-b",
            lo,
            "-e",
            hi,
            "-f",
            factor,
            "--iters",
            str(iters),
            "--rounds",
            "2",
            "--check",
            "--compare",
            peer,
            "--device",
            devices,
            "--json",
            str(path),
            "-q",
        ]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def table(rows: list[dict[str, object]], peer: str) -> str:
    by_size: dict[int, dict[str, dict[str, object]]] = defaultdict(dict)
    for r in rows:
        by_size[int(r["bytes"])][str(r["impl"])] = r  # type: ignore[call-overload]
    impls = [i for i in ("ringcomm", "ringcomm-symmetric") if any(i in v for v in by_size.values())]
    head = ["size"]
    for i in (*impls, peer):
        head += [f"{i} time", f"{i} busbw"]
    head += [f"{i}/{peer}" for i in impls] + [f"{i}/copy" for i in impls] + ["copy GB/s", "wrong"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for size in sorted(by_size):
        got = by_size[size]
        cells = [_size(size)]
        for i in (*impls, peer):
            r = got.get(i)
            cells += [_time(r), f"{float(r['busbw_GBps']):.2f}" if r else "-"]  # type: ignore[arg-type]
        p = got.get(peer)
        copy = got.get("numpy-copyto")
        for i in impls:
            r = got.get(i)
            cells.append(_ratio(r, p))
        for i in impls:
            r = got.get(i)
            cells.append(
                f"{float(r['busbw_GBps']) / float(copy['algbw_GBps']):.2f}"  # type: ignore[arg-type]
                if r and copy and float(copy["algbw_GBps"]) > 0
                else "-"  # type: ignore[arg-type]
            )
        cells.append(f"{float(copy['algbw_GBps']):.2f}" if copy else "-")  # type: ignore[arg-type]
        cells.append(str(sum(int(r["errors"] or 0) for r in got.values())))  # type: ignore[call-overload]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


def _time(r: dict[str, object] | None) -> str:
    if not r:
        return "-"
    t = float(r["time_us"])  # type: ignore[arg-type]
    return f"{t:.1f} us" if t < 1000 else f"{t / 1000:.2f} ms"


def _ratio(r: dict[str, object] | None, p: dict[str, object] | None) -> str:
    if not r or not p or float(r["time_us"]) <= 0:  # type: ignore[arg-type]
        return "-"
    return f"{float(p['time_us']) / float(r['time_us']):.2f}"  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather,broadcast")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--peers", default="mpi,gloo")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for peer in args.peers.split(","):
        for op in args.ops.split(","):
            for world in map(int, args.worlds.split(",")):
                rows = run(args.out, op, world, peer, args.iters)
                print(f"\n### {op}, W={world}, vs {peer}\n\n{table(rows, peer)}\n", flush=True)


if __name__ == "__main__":
    main()
