"""`train --strategy ps` in its modes beside `dp` and `single`, on one model and batch.

    python benchmarks/train_ps.py [-n 4] [--steps 10] [--split-min-bytes 256K]
        [--json benchmarks/results/train_ps_n4.json] [--md benchmarks/results/train_ps_n4.md]

Runs ``single``, ``dp`` over 2 and 3 ranks, then ``ps`` on ``-n`` local ranks with 1 and 2
servers (the rest workers): bsp with the update on the server and on the workers, ssp K=1
and asp; default model (MLP 64-256x4-10, float32, Adam lr 1e-3, global batch 64, seed 0).
With ``--split-min-bytes 256K`` (default) the 256x256 layers are split over both servers
of the 2-server runs. Prints one Markdown table: median step time (the slowest rank per
step), the final loss and its largest relative difference from ``single`` over the steps
(bsp: rounding; ssp/asp: they train differently), the largest pull gap recorded, and per
rank kind what is held and sent (MiB): a server's parameters and optimizer state, a
worker's parameters, gradients and optimizer state, bytes sent per step. The JSON holds
every ``train --json`` object. Times are wall clock on whatever else the host is doing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

from ringcomm.cli.train import run_training
from ringcomm.config import parse_size
from ringcomm.engine.strategy import TrainConfig
from ringcomm.engine.train import summarize

MIB = 2**20


def _mib(x: float) -> str:
    return f"{x / MIB:.2f}"


def _row(res: dict[str, Any], ref: list[float]) -> str:
    losses = res["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    rows = res["per_rank"]
    if res["strategy"] == "ps":
        ps = res["ps"]
        s = ps["servers"]
        servers, workers = rows[:s], rows[s:]
        mode = f"ps {ps['consistency']}" + (" K=1" if ps["consistency"] == "ssp" else "")
        name = f"{mode}, update on {ps['update']}, S={s} W={ps['workers']}"
        gap = str(ps["max_pull_gap"])
        srv = (
            f"{_mib(max(r['param_bytes'] for r in servers))} / "
            f"{_mib(max(r['optim_bytes'] for r in servers))} / "
            f"{_mib(max(r['sent_bytes_per_step'] for r in servers))}"
        )
    else:
        name, gap, srv, workers = f"{res['strategy']} -n {res['world_size']}", "", "", rows
    w = workers[0]
    wrk = (
        f"{_mib(w['param_bytes'])} / {_mib(w['grad_bytes'])} / {_mib(w['optim_bytes'])} / "
        f"{_mib(w['sent_bytes_per_step'])}"
    )
    return (
        f"| {name} | {res['step_time_s'] * 1e3:.1f} | {losses[-1]:.6f} | {rel:.1e} | {gap} | "
        f"{srv} | {wrk} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=4, help="ranks of the ps runs (servers + workers)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--split-min-bytes", type=parse_size, default=256 * 1024)
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    a = p.parse_args(argv)
    base = {"steps": a.steps, "verbose": False, "timeout_s": 600.0}
    ps = {"strategy": "ps", "world_size": a.n, "ps_split_min_bytes": a.split_min_bytes}
    configs = [TrainConfig(strategy="single", **base)]
    configs += [TrainConfig(strategy="dp", world_size=w, **base) for w in (a.n - 2, a.n - 1)]
    for s in (1, 2):
        configs += [
            TrainConfig(**ps, ps_servers=s, ps_update="server", **base),
            TrainConfig(**ps, ps_servers=s, ps_update="worker", **base),
            TrainConfig(**ps, ps_servers=s, consistency="ssp", staleness=1, **base),
            TrainConfig(**ps, ps_servers=s, consistency="asp", **base),
        ]
    results = []
    for cfg in configs:
        t0 = time.perf_counter()
        results.append(summarize(cfg, run_training(cfg)))
        print(f"{cfg.strategy} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    ref = results[0]["losses"]
    head = (
        f"`python benchmarks/train_ps.py -n {a.n} --steps {a.steps} --split-min-bytes "
        f"{a.split_min_bytes}` on {platform.node()} ({os.cpu_count()} CPUs), "
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; model "
        f"{results[0]['model']['params']:,} parameters, float32, Adam."
    )
    columns = (
        "| run | step ms | final loss | max rel diff vs single | max pull gap | "
        "server param / optim / sent MiB per step (largest) | "
        "worker param / grad / optim / sent MiB per step |"
    )
    lines = [head, "", columns, "|---|---|---|---|---|---|---|"]
    lines += [_row(r, ref) for r in results]
    text = "\n".join(lines)
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
