#!/usr/bin/env bash
# ringcomm on an NVIDIA GPU, the training half (issue 32): every strategy of both models on
# --device cuda against NumPy's single, and the torch backend on CUDA tensors against Gloo.
#
#   bash scripts/gpu_check_train.sh OUTDIR     # called by scripts/gpu_check.sh, or alone
#
# Self-contained: it expects only what gpu_check.sh sets up (python3 with CuPy and NumPy;
# pyzmq importable, PYTHONPATH naming this tree) and torch with CUDA for part 3 (skipped,
# and said so, without it). It writes two files into OUTDIR: train_summary.txt (also
# appended to OUTDIR/summary.txt) and train_e2e.tar.gz (every part's output and JSON).
#
# Parts, with the wall time expected on the H200 machine (16 cores, one GPU; not yet
# measured there: the first run records it in train_summary.txt):
#   1. NumPy references: ringcomm train --strategy single --device cpu, the MLP and the
#      transformer, float32                                                    ~5 s
#   2. ringcomm train --device cuda, 4 ranks sharing the GPU: the MLP's single, dp,
#      zero1/2/3, pipeline; the transformer's single, dp, zero1/2/3, pipeline, tp with and
#      without --sequence-parallel, 3d (dp2 x pp2 ZeRO-2, pp2 x tp2 sequence parallel);
#      every step's loss within 1e-4 (relative) of NumPy's single; the pipeline's bubble,
#      measured and by the formula, with why they differ                      ~70 s
#   3. pytest -m gpu tests/test_gpu_e2e.py: the transformer's strategy matrix on CuPy at
#      W = 2 and 4 (float64 1e-9, float32 1e-4), DDP and FSDP2 on CUDA tensors through
#      "ringcomm" against Gloo (2 ranks on one GPU), the collectives on CUDA tensors with
#      3 ranks sharing the GPU (stream order, no copy, bad input)               ~100 s
# GPU_CHECK_TRAIN_PARTS="1 2 3" selects parts; GPU_CHECK_TRAIN_DEVICE=host-staged runs part 2
# on the CPU stand-in (a dry run of this script without a GPU). Exit status: 0 if every
# part passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-gpu_check_results}}
PARTS=${GPU_CHECK_TRAIN_PARTS:-1 2 3}
DEVICE=${GPU_CHECK_TRAIN_DEVICE:-cuda}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d /tmp/ringcomm-gpu-train.XXXXXX)
SUMMARY="$WORK/train_summary.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
note() { echo "$*" | tee -a "$SUMMARY"; }
fail() { note "gpu_check_train: FAILED: $*"; status=1; }
part_start() { T0=$(date +%s); note "== part $1: $2"; }
part_end() { note "   part $1 took $(($(date +%s) - T0)) s"; }
want() { [[ " $PARTS " == *" $1 "* ]]; }

MLP=(--in-features 64 --hidden 256 --layers 2 --batch-size 64)
TRANSFORMER=(--model transformer --vocab 256 --seq-len 32 --d-model 64 --heads 4 --layers 2
             --batch-size 16)
COMMON=(--steps 4 --micro-batches 4 --bucket-mb 1 --dtype float32 -q)

run_train() {  # name timeout args...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$PY" -m ringcomm train "$@" "${COMMON[@]}" --json "$WORK/$name.json" \
        >"$WORK/$name.txt" 2>&1 || fail "train $name (see $name.txt in train_e2e.tar.gz)"
}

if want 1; then
    part_start 1 "NumPy references (single, --device cpu, float32)"
    run_train cpu_mlp_single 60 --strategy single "${MLP[@]}"
    run_train cpu_transformer_single 60 --strategy single "${TRANSFORMER[@]}"
    part_end 1
fi

if want 2; then
    part_start 2 "train --device $DEVICE, every strategy of both models (4 ranks share the GPU)"
    for spec in "single 1" "dp 4" "zero1 4" "zero2 4" "zero3 4" "pipeline 4"; do
        read -r strategy n <<<"$spec"
        run_train "cuda_mlp_$strategy" 90 --strategy "$strategy" -n "$n" --device "$DEVICE" "${MLP[@]}"
    done
    for spec in "single:1:" "dp:4:" "zero1:4:" "zero2:4:" "zero3:4:" "pipeline:4:" \
        "tp:4:" "tp:4:--sequence-parallel" "3d:4:--dp 2 --pp 2 --zero 2" \
        "3d:4:--pp 2 --tp 2 --sequence-parallel"; do
        IFS=: read -r strategy n extra <<<"$spec"
        name="cuda_transformer_${strategy}$(echo "$extra" | tr -d ' -' | sed 's/^/_/;s/_$//')"
        # shellcheck disable=SC2086  # (extra holds several options)
        run_train "$name" 90 --strategy "$strategy" -n "$n" --device "$DEVICE" "${TRANSFORMER[@]}" $extra
    done
    "$PY" - "$WORK" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path

from ringcomm.engine.train import bubble_lines

work = Path(sys.argv[1])
TOL = 1e-4  # float32, CuPy/cuBLAS against NumPy: relative, on every step's loss
bad = 0
for model in ("mlp", "transformer"):
    ref_path = work / f"cpu_{model}_single.json"
    if not ref_path.exists():
        print(f"  {model}: no NumPy single run to compare with")
        bad += 1
        continue
    ref = json.loads(ref_path.read_text())["losses"]
    print(f"  {model}: {len(ref)} steps, every step's loss against NumPy single (tol {TOL}):")
    for path in sorted(work.glob(f"cuda_{model}_*.json")):
        name = path.stem.removeprefix(f"cuda_{model}_")
        res = json.loads(path.read_text())
        rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref))
        ok = len(res["losses"]) == len(ref) and rel <= TOL
        bad += not ok
        rows = res["per_rank"]
        source = res["peak_bytes_source"].split(" (")[0]  # the CuPy pool, or tracemalloc
        print(f"    {name:28s} max rel diff {rel:.1e} {'ok' if ok else 'NOT within tol'}; "
              f"step {res['step_time_s'] * 1e3:.1f} ms; peak MiB "
              + "/".join(f"{r['peak_bytes'] / 2**20:.1f}" for r in rows) + f" ({source})")
        if "bubble_fraction" in res:
            for line in bubble_lines(res):
                print("      " + line.strip())
    missing = 6 if model == "mlp" else 10
    found = len(list(work.glob(f"cuda_{model}_*.json")))
    if found != missing:
        print(f"  {model}: {found} of {missing} cuda runs have results")
        bad += 1
sys.exit(1 if bad else 0)
PYEOF
    [ "${PIPESTATUS[0]}" = 0 ] || fail "train --device cuda: losses not within 1e-4 of NumPy single"
    part_end 2
fi

if want 3; then
    part_start 3 "pytest -m gpu tests/test_gpu_e2e.py (transformer on CuPy; torch on CUDA tensors)"
    timeout 300 "$PY" -m pytest -m gpu tests/test_gpu_e2e.py -q -rs -p no:cacheprovider \
        --durations=10 >"$WORK/pytest_gpu_e2e.txt" 2>&1 || fail "pytest tests/test_gpu_e2e.py"
    tail -15 "$WORK/pytest_gpu_e2e.txt" | tee -a "$SUMMARY"
    if ! grep -q " passed" "$WORK/pytest_gpu_e2e.txt"; then
        fail "no test of tests/test_gpu_e2e.py passed (no CuPy, no GPU?)"
    fi
    part_end 3
fi

note "gpu_check_train: exit $status"
cp "$SUMMARY" "$OUT_DIR/train_summary.txt"
cat "$SUMMARY" >>"$OUT_DIR/summary.txt"
tar czf "$OUT_DIR/train_e2e.tar.gz" -C "$WORK" . && rm -rf "$WORK"
exit $status
