#!/usr/bin/env bash
# ringcomm on an NVIDIA GPU: one short, prepared check (issues 7, 31).
#
#   bash scripts/gpu_check.sh [OUTDIR]       # on the GPU machine, from anywhere
#   bash scripts/gpu_check.sh --fetch-wheels # beforehand, on a machine that reaches PyPI
#
# The GPU machine is expected to have python3 with CuPy, NumPy, msgpack, pytest,
# pytest-timeout and torch, but maybe not pyzmq and no network: what is missing is
# installed from wheels carried in .whl/ (RINGCOMM_WHEELS), into a private --target
# folder; ringcomm itself runs from this working tree (PYTHONPATH), nothing is built.
#
# At most 6 minutes wall (BUDGET_S, default 345 s: every step's timeout is cut to what is
# left) and at most 8 files in OUTDIR (default: $OUT, else ./gpu_check_results):
#   summary.txt          verdicts: tests, wrong results, and the issue-31 targets (ratios
#                        taken in one run: device windows vs the staged path, vs Gloo on
#                        CUDA tensors; busbw and 8-byte times, with and without MPS)
#   env.txt              GPU, driver, Python and package versions, whether MPS can run
#   gpu_check.tar.gz     every log and JSON below
# Steps, once without the MPS daemon ("nomps") and, where nvidia-cuda-mps-control exists,
# once with it ("mps": started here with temporary pipe and log directories, quit at the
# end whatever happens):
#   pytest_<mode>.txt    pytest -m gpu tests/test_gpu.py: the collectives matrix over every
#                        algorithm that takes CuPy arrays (staged rings and trees, device
#                        windows with one-shot/two-shot and the small-message path, the
#                        uneven collectives), int64/uint64 extremes of every op, devices,
#                        the MPS warning, caller-stream ordering, p2p (not the engine's
#                        cases: issue 32's block below)
#   ar_<mode>_W{2,4}.{json,md}  bench all_reduce 8 B - 256 MiB --device cuda,cuda-staged,host
#                        --compare gloo (Gloo on CUDA tensors), checked
#   rsag_<mode>_W4_{reduce_scatter,all_gather}.{json,md}  the same at W=4, 16 B - 64 MiB
# then issue 32's half (scripts/gpu_check_train.sh: train_summary.txt, train_e2e.tar.gz) in
# what is left of the budget. GPU_CHECK_PARTS="31" or "32" runs one half.
# Exit status: 0 if every test passed and every checked result was right (the targets are
# reported, not enforced), else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${RINGCOMM_WHEELS:-.whl}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-345}

if [ "${1:-}" = "--fetch-wheels" ]; then
    # pyzmq is the one dependency the GPU image lacks (it bundles libzmq). Python 3.12,
    # x86-64 manylinux, as the GPU machine runs.
    mkdir -p "$WHEELS"
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "pyzmq>=25"
fi

OUT_DIR=${1:-${OUT:-gpu_check_results}}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d)
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
status=0
fail() { echo "gpu_check: FAILED: $*" | tee -a "$SUMMARY"; status=1; }
left() { echo $((BUDGET_S - SECONDS)); }
# A step's timeout: what it needs, at most what is left (at least 5 s, so it says so).
within() { local want=$1 l; l=$(left); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 5 ] && want=5; echo "$want"; }

# -- install what is missing -----------------------------------------------------------
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import zmq" 2>/dev/null; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/ringcomm-site "$WHEELS"/*.whl || fail "installing wheels from $WHEELS"
        export PYTHONPATH="$PYTHONPATH:/tmp/ringcomm-site"
    else
        fail "pyzmq is missing and $WHEELS/ has no wheels (run: $0 --fetch-wheels)"
    fi
fi
export PYTHONUNBUFFERED=1

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv 2>&1 || true
    command -v nvidia-cuda-mps-control >/dev/null && echo "nvidia-cuda-mps-control: present" \
        || echo "nvidia-cuda-mps-control: absent (no MPS run)"
    "$PY" - <<'PYEOF'
import platform
import numpy, zmq, msgpack
print("python", platform.python_version(), "numpy", numpy.__version__, "pyzmq", zmq.__version__,
      "libzmq", zmq.zmq_version(), "msgpack", msgpack.version)
try:
    import cupy
    print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount())
except Exception as exc:
    print("cupy unavailable:", exc)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.cuda.is_available())
except Exception as exc:
    print("torch unavailable:", exc)
import ringcomm
import os
from ringcomm.config import mps_active
print("ringcomm", ringcomm.__version__, "from", ringcomm.__file__)
print("MPS daemon already running (CUDA_MPS_PIPE_DIRECTORY",
      os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "unset: /tmp/nvidia-mps"), "):", mps_active())
PYEOF
} >"$OUT_DIR/env.txt" 2>&1 || fail "environment probe (see env.txt)"
cat "$OUT_DIR/env.txt"

# -- one mode: the gpu tests and the sweeps --------------------------------------------
run_mode() {  # MODE TEST_S BENCH_S
    local mode=$1 test_s=$2 bench_s=$3 t n op
    t=$(within "$test_s")
    timeout "$t" "$PY" -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider \
        -k "not engine" >"$WORK/pytest_$mode.txt" 2>&1 || fail "$mode: pytest -m gpu (see pytest_$mode.txt)"
    echo "[$mode] $(tail -1 "$WORK/pytest_$mode.txt")" | tee -a "$SUMMARY"
    if grep -q "skipped" "$WORK/pytest_$mode.txt" && ! grep -q "passed" "$WORK/pytest_$mode.txt"; then
        fail "$mode: every gpu test skipped (no CuPy or no GPU?)"
    fi
    for n in 2 4; do
        t=$(within $((bench_s * 3 / 10)))
        timeout "$t" "$PY" -m ringcomm bench all_reduce -n "$n" -b 8 -e 256M -f 2 --iters 5 \
            --warmup 2 --rounds 1 --check -q --device cuda,cuda-staged,host --compare gloo \
            --json "$WORK/ar_${mode}_W$n.json" >"$WORK/ar_${mode}_W$n.md" 2>&1 \
            || fail "$mode: bench all_reduce -n $n (see ar_${mode}_W$n.md)"
    done
    for op in reduce_scatter all_gather; do
        t=$(within $((bench_s * 2 / 10)))
        timeout "$t" "$PY" -m ringcomm bench "$op" -n 4 -b 16 -e 64M -f 4 --iters 5 \
            --warmup 2 --rounds 1 --check -q --device cuda --compare gloo \
            --json "$WORK/rsag_${mode}_W4_$op.json" >"$WORK/rsag_${mode}_W4_$op.md" 2>&1 \
            || fail "$mode: bench $op -n 4 (see rsag_${mode}_W4_$op.md)"
    done
}

MPS_PIPE=""
stop_mps() {
    if [ -n "$MPS_PIPE" ]; then
        echo quit | CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" nvidia-cuda-mps-control >/dev/null 2>&1
        MPS_PIPE=""
    fi
}
trap 'stop_mps; rm -rf "$WORK"' EXIT

PART31=0
[[ " ${GPU_CHECK_PARTS:-31 32} " == *" 31 "* ]] && PART31=1
[ "$PART31" = 1 ] && run_mode nomps 110 55
if [ "$PART31" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
    MPS_PIPE=$(mktemp -d)
    MPS_LOG=$(mktemp -d)
    if CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" CUDA_MPS_LOG_DIRECTORY="$MPS_LOG" \
        nvidia-cuda-mps-control -d; then
        export CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" CUDA_MPS_LOG_DIRECTORY="$MPS_LOG"
        run_mode mps 100 55
        stop_mps
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        cp "$MPS_LOG/control.log" "$WORK/mps_control.log" 2>/dev/null || true
    else
        fail "could not start the MPS daemon (nvidia-cuda-mps-control -d)"
        MPS_PIPE=""
    fi
fi

# -- the verdicts and the targets of issue 31 --------------------------------------------
if [ "$PART31" = 1 ]; then
"$PY" - "$WORK" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
MiB = 1 << 20
wrong = 0


def rows(name):
    path = work / name
    if not path.exists():
        print(f"  {name}: no results")
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    global wrong
    wrong += sum(r["errors"] or 0 for r in out)
    return out


def at(rs, impl, nbytes):
    for r in rs:
        if r["impl"] == impl and r["bytes"] == nbytes:
            return r
    return None


def verdict(ok):
    return "ok" if ok else "MISSED"


for mode in ("nomps", "mps"):
    if not (work / f"ar_{mode}_W2.json").exists() and mode == "mps":
        print("mps: not run (no nvidia-cuda-mps-control, or it did not start)")
        continue
    print(f"== {mode} ==")
    for n in (2, 4):
        rs = rows(f"ar_{mode}_W{n}.json")
        if not rs:
            continue
        algos = sorted({r["algo"] for r in rs if r["impl"] == "ringcomm-cuda"})
        print(f" all_reduce W={n} (ringcomm-cuda algos: {', '.join(algos)})")
        for size in (8, MiB, 64 * MiB, 256 * MiB):
            c, s, g = at(rs, "ringcomm-cuda", size), at(rs, "ringcomm-cuda-staged", size), \
                at(rs, "gloo-cuda", size)
            if c is None:
                continue
            line = f"  {size:>10} B: cuda {c['time_us']:.1f} us {c['busbw_GBps']:.2f} GB/s"
            if s:
                line += f" | staged {s['busbw_GBps']:.2f} (x{c['busbw_GBps'] / max(s['busbw_GBps'], 1e-12):.1f})"
            if g:
                line += f" | gloo-cuda {g['busbw_GBps']:.2f} (x{c['busbw_GBps'] / max(g['busbw_GBps'], 1e-12):.1f})"
            print(line)
        cuda = [r for r in rs if r["impl"] == "ringcomm-cuda"]
        slower_staged = [r["bytes"] for r in cuda if (s := at(rs, "ringcomm-cuda-staged", r["bytes"]))
                         and r["time_us"] > s["time_us"]]
        slower_gloo = [r["bytes"] for r in cuda if (g := at(rs, "gloo-cuda", r["bytes"]))
                       and r["time_us"] > g["time_us"]]
        print(f"  never slower than the staged path: {verdict(not slower_staged)} {slower_staged or ''}")
        print(f"  never slower than Gloo on CUDA tensors: {verdict(not slower_gloo)} {slower_gloo or ''}")
        c64, g64 = at(rs, "ringcomm-cuda", 64 * MiB), at(rs, "gloo-cuda", 64 * MiB)
        if c64 and g64:
            x = c64["busbw_GBps"] / max(g64["busbw_GBps"], 1e-12)
            print(f"  >= 50x Gloo-on-CUDA busbw at 64 MiB: x{x:.0f} {verdict(x >= 50)}")
        targets = ([(256 * MiB, 400), (64 * MiB, 300), (MiB, 30)] if mode == "mps"
                   else ([(64 * MiB, 120)] if n == 2 else []))
        for size, gbps in targets:
            c = at(rs, "ringcomm-cuda", size)
            if c:
                print(f"  busbw >= {gbps} GB/s at {size >> 20} MiB: {c['busbw_GBps']:.1f} "
                      f"{verdict(c['busbw_GBps'] >= gbps)}")
        c8 = at(rs, "ringcomm-cuda", 8)
        if mode == "mps" and c8:
            print(f"  8 B <= 40 us: {c8['time_us']:.1f} us {verdict(c8['time_us'] <= 40)}")
    for op in ("reduce_scatter", "all_gather"):
        rs = rows(f"rsag_{mode}_W4_{op}.json")
        c = [r for r in rs if r["impl"] == "ringcomm-cuda"]
        if not c:
            continue
        big = max(c, key=lambda r: r["bytes"])
        g = at(rs, "gloo-cuda", big["bytes"])
        line = f" {op} W=4 {big['bytes'] >> 20} MiB: {big['busbw_GBps']:.1f} GB/s"
        if g:
            line += f" (gloo-cuda {g['busbw_GBps']:.2f})"
        if mode == "mps":
            line += f" >= 200: {verdict(big['busbw_GBps'] >= 200)}"
        print(line)
print(f"wrong elements in every checked sweep: {wrong}")
sys.exit(1 if wrong else 0)
PYEOF
[ "${PIPESTATUS[0]}" = 0 ] || fail "checked sweeps found wrong results (see summary.txt)"
fi

# == issue 32: the training engine on CuPy and the torch backend's CUDA tensors ===========
# Self-contained: scripts/gpu_check_train.sh (its own parts and timeouts, ~3 min); it
# writes train_summary.txt and train_e2e.tar.gz into OUTDIR and appends to summary.txt.
# It gets what is left of BUDGET_S; with less than TRAIN_MIN_S left it is skipped, and
# said so (run it alone then: bash scripts/gpu_check_train.sh OUTDIR).
# GPU_CHECK_PARTS="31 32" (the default) selects the halves.
if [[ " ${GPU_CHECK_PARTS:-31 32} " == *" 32 "* ]]; then
    if [ "$(left)" -ge "${TRAIN_MIN_S:-120}" ]; then
        timeout "$(within 600)" bash scripts/gpu_check_train.sh "$OUT_DIR" \
            || fail "gpu_check_train.sh (see train_summary.txt)"
    else
        echo "gpu_check: issue 32's half skipped: $(left) s left of ${BUDGET_S} s" \
            "(run: bash scripts/gpu_check_train.sh $OUT_DIR)" | tee -a "$SUMMARY"
    fi
fi
# == end of issue 32's block ================================================================

tar -czf "$OUT_DIR/gpu_check.tar.gz" -C "$WORK" . || fail "packing the logs"
echo "gpu_check: exit $status after ${SECONDS} s (results in $OUT_DIR)" | tee -a "$SUMMARY"
exit $status
