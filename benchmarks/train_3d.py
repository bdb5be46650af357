"""Record `ringcomm train --model transformer` over a 3-D mesh against `single`.

    python benchmarks/train_3d.py OUT_DIR [--steps 10] [-- extra train flags]

Runs `single`, `tp -n 2`, `3d -n 8 --dp 2 --pp 2 --tp 2` (with and without
`--sequence-parallel`, and with `--zero 1`) on the same model, seed and global batch, keeps
each run's `--json` in OUT_DIR and prints a Markdown table: step time, the largest relative
loss difference from `single`, parameter bytes and peak bytes per rank, and the bytes sent
per step on each mesh axis next to the formula's (Megatron's count on the tp axis: per
stage, 4 all_reduces of rows*seq*d_model per block, one for the embedding or the LM head,
and the vocab-parallel loss's 3*rows*seq; each all_reduce sends 2(T-1)/T of its buffer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MESH = ["--strategy", "3d", "-n", "8", "--dp", "2", "--pp", "2", "--tp", "2"]
RUNS = [
    ("single", ["--strategy", "single"]),
    ("tp2", ["--strategy", "tp", "-n", "2"]),
    ("3d_2x2x2", MESH),
    ("3d_2x2x2_sp", [*MESH, "--sequence-parallel"]),
    ("3d_2x2x2_zero1", [*MESH, "--zero", "1"]),
]


def run(out: Path, name: str, argv: list[str], steps: int, extra: list[str]) -> dict[str, Any]:
    path = out / f"train_3d_{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "ringcomm",
        "train",
        "--model",
        "transformer",
        *argv,
        "--steps",
        str(steps),
        "-q",
        *extra,
        "--json",
        str(path),
    ]
    print("$", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env={**os.environ})
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def _mib(x: float) -> str:
    return f"{x / 2**20:.3f}"


def tp_formula(res: dict[str, Any], row: dict[str, Any]) -> float:
    """Megatron's tp-axis bytes sent per step for this rank (see the module docstring)."""
    m, shape = res["model"], res["mesh_shape"]
    T, P, D = shape["tp"], shape["pp"], shape["dp"]
    if T == 1:
        return 0.0
    item = 8 if res["dtype"] == "float64" else 4
    rows = res["batch_size"] // D + (1 if row["mesh"]["dp"] < res["batch_size"] % D else 0)
    bsd = rows * m["seq_len"] * m["d_model"] * item
    a, b = row["stage_layers"]
    blocks = sum(1 for i in range(a, b) if 1 <= i <= m["blocks"])
    n = 4 * blocks + (1 if a == 0 else 0) + (1 if b == m["blocks"] + 3 else 0)
    payload = n * bsd + (3 * rows * m["seq_len"] * item if row["mesh"]["pp"] == P - 1 else 0)
    sent = 2 * (T - 1) / T * payload
    if res.get("sequence_parallel"):  # + the replicated gradients' all_reduce
        d = m["d_model"]
        grads = 6 * d * blocks + (m["seq_len"] * d if a == 0 else 0)
        grads += 2 * d if b == m["blocks"] + 3 else 0
        sent += 2 * (T - 1) / T * grads * item
    return sent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("extra", nargs="*", help="more `ringcomm train` flags (after --)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {name: run(args.out, name, argv, args.steps, args.extra) for name, argv in RUNS}
    single = results["single"]
    print("| run | step ms | max rel loss diff vs single | param KiB / rank | peak MiB / rank |")
    print("|---|---|---|---|---|")
    for name, res in results.items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], single["losses"]))
        params = sorted({r["param_bytes"] / 1024 for r in res["per_rank"]})
        peaks = [r["peak_bytes"] / 2**20 for r in res["per_rank"]]
        print(
            f"| {name} | {res['step_time_s'] * 1e3:.1f} | {diff:.1e} | "
            f"{' / '.join(f'{p:.1f}' for p in params)} | {min(peaks):.2f}-{max(peaks):.2f} |"
        )
    print()
    for name, res in results.items():
        if "mesh_shape" not in res:
            continue
        print(f"**{name}**: MiB sent per step by axis (engine's ring count; tp formula)\n")
        print("| rank | mesh (dp, pp, tp) | layers | dp | pp | tp | tp formula |")
        print("|---|---|---|---|---|---|---|")
        for row in res["per_rank"]:
            c, by = row["mesh"], row["sent_bytes_per_step_by_axis"]
            print(
                f"| {row['rank']} | ({c['dp']}, {c['pp']}, {c['tp']}) | {row['stage_layers']} | "
                f"{_mib(by['dp'])} | {_mib(by['pp'])} | {_mib(by['tp'])} | "
                f"{_mib(tp_formula(res, row))} |"
            )
        print()
    print("losses:")
    for name, res in results.items():
        print(f"  {name}: {[round(x, 6) for x in res['losses']]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
