"""Cost of the reliability and security work on the two headline numbers, interleaved.

Runs ``ringcomm bench all_reduce`` at 8 B (time) and 64 MiB (busbw) for three setups, in
the order A B C A B C ... so drift on a shared host hits all of them alike:

* ``before``: the code in ``--before`` (a checkout of main; no data-plane authentication,
  no liveness watch, no write gate);
* ``handshake``: this tree, default security (ZAP-checked PLAIN handshake with a
  token-derived credential; heartbeats, monitors, fingerprint gate);
* ``curve``: this tree with ``RINGCOMM_SECURITY=curve`` (CurveZMQ: every byte encrypted).

    python benchmarks/reliability_cost.py --before ../ringcomm-before -n 2 --reps 3 \\
        --out benchmarks/results/reliability_cost_W2

Writes ``OUT.json`` (every row, tagged with setup and rep) and ``OUT.md`` (medians over
reps and ratios to ``before``).
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


def bench(
    tree: pathlib.Path, world: int, size: str, iters: int, extra_env: dict[str, str]
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, PYTHONPATH=str(tree), **extra_env)
    cmd = [
        sys.executable,
        "-m",
        "ringcomm",
        "bench",
        "all_reduce",
        "-n",
        str(world),
        "-b",
        size,
        "-e",
        size,
        "--iters",
        str(iters),
        "--warmup",
        str(max(2, iters // 10)),
        "--check",
        "-q",
        "--json",
        path,
    ]
    subprocess.run(cmd, env=env, check=True, cwd=str(tree), stdout=subprocess.DEVNULL)
    with open(path) as f:
        row = json.loads(f.readline())
    os.unlink(path)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="tree with the code to compare against")
    p.add_argument("-n", "--world-size", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", required=True, help="output path without extension")
    args = p.parse_args(argv)
    setups = [
        ("before", pathlib.Path(args.before), {}),
        ("handshake", HERE, {"RINGCOMM_SECURITY": "handshake"}),
        ("curve", HERE, {"RINGCOMM_SECURITY": "curve"}),
    ]
    sizes = [("8", 300), ("64M", 8)]
    rows = []
    for rep in range(args.reps):
        for size, iters in sizes:
            for name, tree, env in setups:
                row = bench(tree, args.world_size, size, iters, env)
                row.update(setup=name, rep=rep)
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out + ".json", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    lines = [
        (
            f"# Reliability/security cost, all_reduce W={args.world_size}, medians of "
            f"{args.reps} interleaved reps"
        ),
        "",
        (
            f"`python benchmarks/reliability_cost.py --before {args.before} "
            f"-n {args.world_size} --reps {args.reps} --out {args.out}`"
        ),
        "",
        "| setup | 8 B time (us) | vs before | 64 MiB busbw (GB/s) | vs before |",
        "|---|---|---|---|---|",
    ]
    med: dict[tuple[str, int], float] = {}
    for name, _, _ in setups:
        for size, _ in sizes:
            sel = [
                r
                for r in rows
                if r["setup"] == name and r["bytes"] == (8 if size == "8" else 64 << 20)
            ]
            key = "time_us" if size == "8" else "busbw_GBps"
            med[(name, sel[0]["bytes"])] = statistics.median(r[key] for r in sel)
    for name, _, _ in setups:
        t, b = med[(name, 8)], med[(name, 64 << 20)]
        lines.append(
            f"| {name} | {t:.1f} | {t / med[('before', 8)]:.2f}x | {b:.3f} | "
            f"{b / med[('before', 64 << 20)]:.2f}x |"
        )
    errors = [r for r in rows if r.get("errors")]
    lines += ["", f"Rows with wrong results: {len(errors)}."]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
