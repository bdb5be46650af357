#!/usr/bin/env bash
# `ringcomm train` for every strategy on every device this machine has, side by side:
# cpu (NumPy), host-staged (NumPy compute, collectives and p2p through the staged device
# path with stand-in device arrays) and, when CuPy finds a GPU, cuda.
#
#   bash benchmarks/train_devices.sh OUTDIR [N=4] [STEPS=10] [extra train args...]
#
# Writes OUTDIR/train_<device>_<strategy>.json and OUTDIR/train_devices.md: per run the
# median step time, per-rank peak / pinned staging / sent-per-step MiB, and the largest
# relative loss difference from NumPy's `single` (the oracle).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: $0 OUTDIR [N] [STEPS] [train args...]}
N=${2:-4}
STEPS=${3:-10}
shift $(( $# < 3 ? $# : 3 ))
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
devices=(cpu host-staged)
if "$PY" -c "import cupy, sys; sys.exit(cupy.cuda.runtime.getDeviceCount() < 1)" 2>/dev/null; then
    devices+=(cuda)
fi
common=(--steps "$STEPS" --micro-batches 8 -q "$@")
"$PY" -m ringcomm train --strategy single "${common[@]}" \
    --json "$OUT_DIR/train_cpu_single.json" >/dev/null
for device in "${devices[@]}"; do
    for strategy in dp zero1 zero2 zero3 pipeline; do
        "$PY" -m ringcomm train --strategy "$strategy" -n "$N" --device "$device" "${common[@]}" \
            --json "$OUT_DIR/train_${device}_${strategy}.json" >/dev/null
    done
done
"$PY" - "$OUT_DIR" "${devices[@]}" <<'PYEOF' | tee "$OUT_DIR/train_devices.md"
import json, sys
from pathlib import Path
out, devices = Path(sys.argv[1]), sys.argv[2:]
ref = json.loads((out / "train_cpu_single.json").read_text())
m = ref["model"]
print(f"model {m['in_features']}-{m['hidden']}x{m['depth']}-{m['classes']}, {m['params']:,} "
      f"parameters, {ref['dtype']}, {ref['optimizer']}, batch {ref['batch_size']}, "
      f"{ref['steps']} steps; single (cpu) step {ref['step_time_s'] * 1e3:.1f} ms\n")
print("| strategy | device | step ms | peak MiB (per rank) | staging MiB | sent MiB/step | "
      "max rel loss diff vs single |")
print("|---|---|---|---|---|---|---|")
for strategy in ("dp", "zero1", "zero2", "zero3", "pipeline"):
    for device in devices:
        res = json.loads((out / f"train_{device}_{strategy}.json").read_text())
        rows = res["per_rank"]
        mib = lambda key: " / ".join(f"{r[key] / 2**20:.2f}" for r in rows)  # noqa: E731
        rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref["losses"]))
        print(f"| {strategy} | {device} | {res['step_time_s'] * 1e3:.1f} | {mib('peak_bytes')} "
              f"| {mib('staging_bytes')} | {mib('sent_bytes_per_step')} | {rel:.1e} |")
PYEOF
