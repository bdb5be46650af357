"""Every training strategy on the same model and batch: memory, bytes sent, step time.

    python benchmarks/train_strategies.py [-n 4] [--steps 5] [--hidden 1024] [--layers 3]
        [--in-features 256] [--batch-size 64] [--micro-batches 8]
        [--json benchmarks/results/train_strategies_n4.json]
        [--md benchmarks/results/train_strategies_n4.md]

Runs ``single`` (1 process), then ``dp``, ``zero1``, ``zero2``, ``zero3`` and ``pipeline``
(GPipe and 1F1B) on ``-n`` local ranks, float32, Adam, and prints one Markdown table: per
rank (rank 0; the pipeline's stages differ, the table shows the largest) model-state MiB
(params, grads, optimizer), its ratio to dp beside the ZeRO paper's, peak MiB (tracemalloc),
MiB sent per step beside 2Ψ(N-1)/N, median step time, the final loss (equal for all), and
for the pipeline the measured bubble and activation peak. The JSON holds every
``train --json`` object. Times are wall clock on whatever else the host is doing.
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
from ringcomm.engine.strategy import TrainConfig
from ringcomm.engine.train import summarize

MIB = 2**20


def _row(res: dict[str, Any], numel: int, n: int) -> str:
    ranks = res["per_rank"]
    # pipeline stages hold different layers: show the largest; others are alike, show rank 0
    r = max(ranks, key=lambda x: x["param_bytes"] + x["grad_bytes"] + x["optim_bytes"])
    state = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
    dp_state = 16 * numel
    expected = {
        "single": 16,
        "dp": 16,
        "zero1": 8 + 8 / n,
        "zero2": 4 + 12 / n,
        "zero3": 16 / n,
    }.get(res["strategy"])
    ring = 2 * 4 * numel * (n - 1) / n
    name = res["strategy"] + (
        f" {res['schedule']} m={res['micro_batches']}" if "schedule" in res else ""
    )
    extra = ""
    if "bubble_fraction" in res:
        act = max(x["activation_peak_bytes"] for x in ranks)
        extra = (
            f"bubble {res['bubble_fraction']:.2f} (theory {res['bubble_fraction_theory']:.2f}), "
            f"activation peak {act / MIB:.1f} MiB"
        )
    return (
        f"| {name} | {r['param_bytes'] / MIB:.2f} | {r['grad_bytes'] / MIB:.2f} | "
        f"{r['optim_bytes'] / MIB:.2f} | {state / dp_state:.3f} | "
        f"{'' if expected is None else f'{expected / 16:.3f}'} | {r['peak_bytes'] / MIB:.1f} | "
        f"{r['sent_bytes_per_step'] / MIB:.2f} ({r['sent_bytes_per_step'] / ring:.3f}) | "
        f"{res['step_time_s'] * 1e3:.0f} | {res['losses'][-1]:.6f} | {extra} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--in-features", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args()
    base: dict[str, Any] = {
        "steps": a.steps,
        "dtype": "float32",
        "optimizer": "adam",
        "in_features": a.in_features,
        "hidden": a.hidden,
        "depth": a.layers,
        "classes": 10,
        "batch_size": a.batch_size,
        "timeout_s": 600.0,
    }
    runs = [TrainConfig(strategy="single", world_size=1, **base)]
    runs += [
        TrainConfig(strategy=s, world_size=a.n, **base) for s in ("dp", "zero1", "zero2", "zero3")
    ]
    runs += [
        TrainConfig(
            strategy="pipeline", world_size=a.n, micro_batches=a.micro_batches, schedule=s, **base
        )
        for s in ("gpipe", "1f1b")
    ]
    results = []
    for cfg in runs:
        t0 = time.perf_counter()
        results.append(summarize(cfg, run_training(cfg)))
        print(
            f"{cfg.strategy} {cfg.schedule if cfg.strategy == 'pipeline' else ''} done in "
            f"{time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
    numel = results[0]["model"]["params"]
    lines = [
        (
            f"Model: MLP {a.in_features}-{a.hidden}x{a.layers}-10, {numel:,} parameters (Ψ), "
            f"float32, Adam; global batch {a.batch_size}; {a.steps} steps; N = {a.n}; host "
            f"{platform.node() or '?'} ({os.cpu_count()} CPUs), Python {platform.python_version()}."
        ),
        "",
        (
            "| strategy | param MiB | grad MiB | optim MiB | state / dp (16Ψ) | ZeRO paper | "
            "peak MiB | sent MiB/step (/ 2Ψ(N-1)/N) | step ms | final loss | pipeline |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [_row(r, numel, a.n) for r in results]
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
