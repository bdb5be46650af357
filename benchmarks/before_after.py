"""One ``ringcomm bench`` sweep, this tree against another checkout, interleaved.

Runs the same ``ringcomm bench OP -n N -b B -e E`` on ``--before`` (e.g. a checkout of
main) and on this tree, in the order A B A B ... (``--reps`` times each), so drift on a
shared host hits both alike; reports per size the median over reps of each side's median
time and the ratio after/before (below 1: this tree is faster).

    python benchmarks/before_after.py --before ../ringcomm-before -n 2 -b 8 -e 64M --reps 2 \\
        --out benchmarks/results/core_followups_W2

Writes ``OUT.json`` (every row, tagged with side and rep) and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = pathlib.Path(__file__).resolve().parents[1]


def sweep(tree: pathlib.Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [
        sys.executable,
        "-m",
        "ringcomm",
        "bench",
        args.op,
        "-n",
        str(args.world_size),
        "-b",
        args.begin,
        "-e",
        args.end,
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--check",
        "-q",
        "--json",
        path,
    ]
    try:
        subprocess.run(cmd, env=env, check=True, cwd=str(tree), stdout=subprocess.DEVNULL)
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    finally:
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="tree with the code to compare against")
    p.add_argument("--op", default="all_reduce")
    p.add_argument("-n", "--world-size", type=int, default=2)
    p.add_argument("-b", "--begin", default="8")
    p.add_argument("-e", "--end", default="64M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", required=True, help="output path without extension")
    args = p.parse_args(argv)
    sides = [("before", pathlib.Path(args.before)), ("after", HERE)]
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for side, tree in sides:
            for row in sweep(tree, args):
                if row.get("errors"):
                    raise SystemExit(f"{side} rep {rep}: wrong results at {row['bytes']} B")
                rows.append(dict(row, side=side, rep=rep))
            print(f"rep {rep} {side} done", file=sys.stderr, flush=True)
    out = pathlib.Path(args.out)
    out.with_suffix(".json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sizes = sorted({r["bytes"] for r in rows})
    lines = [
        (
            f"# `ringcomm bench {args.op} -n {args.world_size} -b {args.begin} -e {args.end}`: "
            "before vs after"
        ),
        "",
        (
            f"Command: `python benchmarks/before_after.py --before {args.before} --op {args.op} "
            f"-n {args.world_size} -b {args.begin} -e {args.end} --iters {args.iters} "
            f"--warmup {args.warmup} --reps {args.reps} --out {args.out}`"
        ),
        "",
        "Median over reps of each run's median time (us); ratio = after / before.",
        "",
        "| bytes | before us | after us | ratio | before busbw GB/s | after busbw GB/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        med = {}
        bw = {}
        for side, _ in sides:
            sel = [r for r in rows if r["bytes"] == size and r["side"] == side]
            med[side] = statistics.median(r["time_us"] for r in sel)
            bw[side] = statistics.median(r["busbw_GBps"] for r in sel)
        lines.append(
            f"| {size} | {med['before']:.1f} | {med['after']:.1f} | "
            f"{med['after'] / med['before']:.2f} | {bw['before']:.3f} | {bw['after']:.3f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
