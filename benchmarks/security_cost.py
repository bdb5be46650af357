"""Cost of issue 29 (a token always, fresh logins, store sessions, one outcome per
collective), before vs after, interleaved (A B A B) so drift on a shared host hits both.

* Formation: W processes (plain environment: ``RINGCOMM_RANK``/``_WORLD_SIZE``/
  ``_MASTER_*``, rank 0 serves the store) start ``init_process_group`` together (each has
  imported ringcomm and waits for "go"); the time is the slowest rank's call. Two ways: no
  token (before: no authentication at all; after: rank 0 mints one and hands it over under
  a key exchange) and ``RINGCOMM_TOKEN`` set (both authenticated; after: per-connection
  logins and a signed store session).
* The 8 B all_reduce: ``ringcomm bench all_reduce -b 8 -e 8`` (median time), on the
  shared workspace (the one-host default) and over sockets (``RINGCOMM_WORKSPACE=0``,
  where each call now looks for a peer's abort before it returns).
* ``--paired``: the hot-path checks alone, in one job of this tree (so under the same
  load): blocks of 8 B all_reduces alternate between the checks as they are and stubbed
  out (``Progress.aborted``, ``Workspace.failed_peer``); medians of the blocks' medians.

    git archive faf82b9 | (mkdir -p /tmp/before && tar -x -C /tmp/before)
    python benchmarks/security_cost.py --before /tmp/before -n 8 --reps 3 \\
        --out benchmarks/results/security_cost

Writes ``OUT.json`` (every sample) and ``OUT.md`` (medians and after/before ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = pathlib.Path(__file__).resolve().parents[1]

_CHILD = """
import os, sys, time
import ringcomm as rc
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
pg = rc.init_process_group()
t1 = time.perf_counter()
pg.barrier()
print(f"{t1 - t0:.6f}", flush=True)
pg.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def formation(tree: pathlib.Path, world: int, token: bool) -> float:
    """Seconds of the slowest rank's ``init_process_group`` (all started together)."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if "TOKEN" not in k}
        env.update(
            PYTHONPATH=str(tree),
            RINGCOMM_RANK=str(r),
            RINGCOMM_WORLD_SIZE=str(world),
            RINGCOMM_MASTER_ADDR="127.0.0.1",
            RINGCOMM_MASTER_PORT=str(port),
            RINGCOMM_TIMEOUT_S="120",
        )
        if token:
            env["RINGCOMM_TOKEN"] = "a token the user gave every rank"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                env=env,
                cwd=str(tree),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        times = [float(p.communicate(timeout=180)[0].strip()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return max(times)


def small_all_reduce(tree: pathlib.Path, world: int, sockets: bool, iters: int) -> float:
    """Median µs of an 8-byte all_reduce (``ringcomm bench``)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = {k: v for k, v in os.environ.items() if "TOKEN" not in k}
    env["PYTHONPATH"] = str(tree)
    if sockets:
        env["RINGCOMM_WORKSPACE"] = "0"
    cmd = [
        sys.executable,
        "-m",
        "ringcomm",
        "bench",
        "all_reduce",
        "-n",
        str(world),
        "-b",
        "8",
        "-e",
        "8",
        "--iters",
        str(iters),
        "--warmup",
        "50",
        "--check",
        "-q",
        "--json",
        path,
    ]
    subprocess.run(cmd, env=env, check=True, cwd=str(tree), stdout=subprocess.DEVNULL)
    with open(path) as f:
        row = json.loads(f.readline())
    os.unlink(path)
    return float(row["time_us"])


def _paired_rank(pg: Any, blocks: int, calls: int) -> dict[str, float]:
    import time

    import numpy as np

    from ringcomm.core.progress import Progress
    from ringcomm.transport.workspace import Workspace

    real_aborted, real_failed = Progress.aborted, Workspace.failed_peer

    def stub_aborted(self: Any, group_id: int, seq: int, what: str) -> None:
        return None

    def stub_failed(self: Any, seq: int) -> None:
        return None

    x = np.ones(2, np.float32)
    for _ in range(300):
        pg.all_reduce(x)
    per: dict[str, list[float]] = {"checks": [], "stubbed": []}
    for b in range(blocks):
        on = b % 2 == 0
        Progress.aborted = real_aborted if on else stub_aborted  # type: ignore[assignment]
        Workspace.failed_peer = real_failed if on else stub_failed  # type: ignore[assignment]
        pg.barrier()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            pg.all_reduce(x)
            times.append(time.perf_counter() - t0)
        per["checks" if on else "stubbed"].append(statistics.median(times) * 1e6)
    Progress.aborted, Workspace.failed_peer = real_aborted, real_failed  # type: ignore[method-assign]
    return {k: statistics.median(v) for k, v in per.items()}


def paired(world: int, sockets: bool, blocks: int, calls: int) -> dict[str, float]:
    """Median µs per call with the checks and stubbed, interleaved in one job."""
    import ringcomm as rc

    if sockets:
        os.environ["RINGCOMM_WORKSPACE"] = "0"
    try:
        rows = rc.spawn(_paired_rank, world, args=(blocks, calls), timeout_s=600)
    finally:
        os.environ.pop("RINGCOMM_WORKSPACE", None)
    return {k: max(r[k] for r in rows) for k in ("checks", "stubbed")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="a tree with the code to compare against")
    p.add_argument("-n", "--world-size", type=int, default=8, help="ranks at formation")
    p.add_argument("--bench-world-size", type=int, default=2, help="ranks of the all_reduce")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("--paired", action="store_true", help="also the in-job A/B of the checks")
    args = p.parse_args(argv)
    trees = {"before": pathlib.Path(args.before).resolve(), "after": HERE}
    samples: list[dict[str, Any]] = []
    cases = [
        ("formation, no token", lambda t: formation(t, args.world_size, False)),
        ("formation, RINGCOMM_TOKEN", lambda t: formation(t, args.world_size, True)),
        (
            "8 B all_reduce, workspace",
            lambda t: small_all_reduce(t, args.bench_world_size, False, args.iters),
        ),
        (
            "8 B all_reduce, sockets",
            lambda t: small_all_reduce(t, args.bench_world_size, True, args.iters),
        ),
    ]
    for rep in range(args.reps):
        for case, run in cases:
            for which in ("before", "after") if rep % 2 == 0 else ("after", "before"):
                value = run(trees[which])
                samples.append({"case": case, "tree": which, "rep": rep, "value": value})
                print(f"rep {rep} {case:28s} {which:6s} {value:.6g}", flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump(
            {
                "world_size": args.world_size,
                "bench_world_size": args.bench_world_size,
                "samples": samples,
            },
            f,
            indent=1,
        )
    lines = ["| case | before (median) | after (median) | after/before |", "|---|---:|---:|---:|"]
    for case, _ in cases:
        unit, scale = ("ms", 1e3) if case.startswith("formation") else ("µs", 1.0)
        med = {
            w: statistics.median(
                s["value"] for s in samples if s["case"] == case and s["tree"] == w
            )
            for w in trees
        }
        lines.append(
            f"| {case} | {med['before'] * scale:.3g} {unit} | "
            f"{med['after'] * scale:.3g} {unit} | {med['after'] / med['before']:.2f} |"
        )
    if args.paired:
        lines += [
            "",
            "| 8 B all_reduce, in one job | checks | stubbed | difference |",
            "|---|---:|---:|---:|",
        ]
        for sockets in (False, True):
            got = [paired(args.bench_world_size, sockets, 12, 1000) for _ in range(args.reps)]
            on = statistics.median(g["checks"] for g in got)
            off = statistics.median(g["stubbed"] for g in got)
            samples.append(
                {
                    "case": f"paired {'sockets' if sockets else 'workspace'}",
                    "checks": [g["checks"] for g in got],
                    "stubbed": [g["stubbed"] for g in got],
                }
            )
            lines.append(
                f"| {'sockets' if sockets else 'workspace'} | {on:.1f} µs | "
                f"{off:.1f} µs | {on - off:+.1f} µs |"
            )
        with open(args.out + ".json", "w") as f:
            json.dump(
                {
                    "world_size": args.world_size,
                    "bench_world_size": args.bench_world_size,
                    "samples": samples,
                },
                f,
                indent=1,
            )
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
