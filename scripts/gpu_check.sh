#!/usr/bin/env bash
# ringcomm on an NVIDIA GPU: one short, prepared check (issue 7).
#
#   bash scripts/gpu_check.sh [OUTDIR]       # on the GPU machine, from anywhere
#   bash scripts/gpu_check.sh --fetch-wheels # beforehand, on a machine that reaches PyPI
#
# The GPU machine is expected to have python3 with CuPy, NumPy, msgpack, pytest and
# pytest-timeout, but maybe not pyzmq and no network: what is missing is installed from
# wheels carried in .whl/ (RINGCOMM_WHEELS), into a private --target folder; ringcomm
# itself runs from this working tree (PYTHONPATH), nothing is built.
#
# Steps, each one's output saved under OUTDIR (default: $OUT, else ./gpu_check_results):
#   env.txt                       GPU, driver, Python and package versions
#   pytest_gpu.txt                pytest -m gpu: collectives on CuPy arrays at world sizes
#                                 2 and 4 on one GPU, caller-stream ordering, p2p, and
#                                 every engine strategy on CuPy equal to NumPy's single
#   bench_cuda_vs_host_W{2,4}.md  ringcomm bench all_reduce --device cuda,host --check: CuPy
#   bench_cuda_vs_host_W{2,4}.json  buffers and host buffers in the same run, alternating
#   summary.txt                   the target: CuPy busbw at 16 MiB within 20% of the host's
#   train_cuda_<strategy>.{json,txt}  ringcomm train --device cuda for every strategy (4 ranks
#   train_cpu_single.{json,txt}   on the GPU; float32, 3.4M parameters, Adam), and NumPy's
#                                 single run, their oracle: losses within 1e-4 (summary.txt)
# Exit status: 0 if every step passed (the 20% target is reported, not enforced; the
# engine's losses against the oracle are enforced), else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${RINGCOMM_WHEELS:-.whl}
PY=${PYTHON:-python3}

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
status=0
fail() { echo "gpu_check: FAILED: $*" | tee -a "$OUT_DIR/summary.txt"; status=1; }

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
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
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
import ringcomm
print("ringcomm", ringcomm.__version__, "from", ringcomm.__file__)
PYEOF
} >"$OUT_DIR/env.txt" 2>&1 || fail "environment probe (see env.txt)"
cat "$OUT_DIR/env.txt"

# -- the gpu-marked tests ----------------------------------------------------------------
timeout 480 "$PY" -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider \
    >"$OUT_DIR/pytest_gpu.txt" 2>&1 || fail "pytest -m gpu (see pytest_gpu.txt)"
tail -5 "$OUT_DIR/pytest_gpu.txt"
if grep -q "skipped" "$OUT_DIR/pytest_gpu.txt" && ! grep -q "passed" "$OUT_DIR/pytest_gpu.txt"; then
    fail "every gpu test skipped (no CuPy or no GPU?)"
fi

# -- CuPy buffers against host buffers, in the same run ----------------------------------
for n in 2 4; do
    timeout 300 "$PY" -m ringcomm bench all_reduce -n "$n" -b 8 -e 64M --iters 20 --warmup 5 \
        --rounds 2 --check -q --device cuda,host \
        --json "$OUT_DIR/bench_cuda_vs_host_W$n.json" >"$OUT_DIR/bench_cuda_vs_host_W$n.md" 2>&1 \
        || fail "bench all_reduce -n $n --device cuda,host (see bench_cuda_vs_host_W$n.md)"
    cat "$OUT_DIR/bench_cuda_vs_host_W$n.md"
done

# -- the target --------------------------------------------------------------------------
"$PY" - "$OUT_DIR" <<'PYEOF' | tee -a "$OUT_DIR/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for n in (2, 4):
    path = out / f"bench_cuda_vs_host_W{n}.json"
    if not path.exists():
        print(f"W={n}: no results")
        continue
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    at = {r["impl"]: r for r in rows if r["bytes"] == 16 << 20}
    if len(at) < 2:
        print(f"W={n}: no 16 MiB rows")
        continue
    cuda, host = at["ringcomm-cuda"]["busbw_GBps"], at["ringcomm"]["busbw_GBps"]
    ratio = cuda / host if host else float("nan")
    verdict = "within 20%" if ratio >= 0.8 else "NOT within 20%"
    print(f"W={n} all_reduce 16 MiB busbw: cuda {cuda:.3f} GB/s, host {host:.3f} GB/s, "
          f"ratio {ratio:.2f} ({verdict} of the host figure)")
    big = [r for r in rows if r["bytes"] >= 1 << 20]
    print("  errors:", sum(r["errors"] or 0 for r in rows), "| >= 1 MiB cuda/host busbw:",
          ", ".join(f"{r['bytes'] >> 20}M "
                    f"{r['busbw_GBps'] / max(1e-12, next(h['busbw_GBps'] for h in big if h['bytes'] == r['bytes'] and h['impl'] == 'ringcomm')):.2f}"
                    for r in big if r["impl"] == "ringcomm-cuda"))
PYEOF
# -- the training engine on CuPy -----------------------------------------------------------
# Every strategy with params, grads, optimizer state and activations on the GPU (4 ranks
# sharing it, each its own process and CUDA context), against NumPy's `single` on the host.
TRAIN_ARGS=(--steps 6 --in-features 256 --hidden 1024 --layers 4 --batch-size 256 --bucket-mb 4 -q)
timeout 120 "$PY" -m ringcomm train --strategy single --device cpu "${TRAIN_ARGS[@]}" \
    --json "$OUT_DIR/train_cpu_single.json" >"$OUT_DIR/train_cpu_single.txt" 2>&1 \
    || fail "train --strategy single --device cpu (see train_cpu_single.txt)"
for spec in "single 1" "dp 4" "zero1 4" "zero2 4" "zero3 4" "pipeline 4"; do
    read -r strategy ranks <<<"$spec"
    timeout 150 "$PY" -m ringcomm train --strategy "$strategy" -n "$ranks" --device cuda \
        --micro-batches 8 "${TRAIN_ARGS[@]}" --json "$OUT_DIR/train_cuda_$strategy.json" \
        >"$OUT_DIR/train_cuda_$strategy.txt" 2>&1 \
        || fail "train --strategy $strategy --device cuda (see train_cuda_$strategy.txt)"
    cat "$OUT_DIR/train_cuda_$strategy.txt"
done
"$PY" - "$OUT_DIR" <<'PYEOF' | tee -a "$OUT_DIR/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
TOL = 1e-4  # float32, CuPy/cuBLAS against NumPy: relative, on every step's loss
ref_path = out / "train_cpu_single.json"
if not ref_path.exists():
    print("train: no NumPy single run to compare with")
    sys.exit(0)
ref = json.loads(ref_path.read_text())["losses"]
bad = 0
print(f"train --device cuda, {len(ref)} steps, losses against NumPy single (tol {TOL}):")
for name in ("single", "dp", "zero1", "zero2", "zero3", "pipeline"):
    path = out / f"train_cuda_{name}.json"
    if not path.exists():
        print(f"  {name:9s} no results")
        bad += 1
        continue
    res = json.loads(path.read_text())
    rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref))
    ok = len(res["losses"]) == len(ref) and rel <= TOL
    bad += not ok
    rows = res["per_rank"]
    mib = lambda key: "/".join(f"{r[key] / 2**20:.1f}" for r in rows)  # noqa: E731
    extra = f", bubble {res['bubble_fraction']:.2f}" if "bubble_fraction" in res else ""
    print(f"  {name:9s} max rel loss diff {rel:.1e} {'ok' if ok else 'NOT within tol'}; "
          f"step {res['step_time_s'] * 1e3:.1f} ms; per rank MiB: state "
          + "/".join(f"{(r['param_bytes'] + r['grad_bytes'] + r['optim_bytes']) / 2**20:.1f}"
                     for r in rows)
          + f", pool peak {mib('peak_bytes')}, pinned staging {mib('staging_bytes')}, "
          f"sent/step {mib('sent_bytes_per_step')}{extra}")
sys.exit(1 if bad else 0)
PYEOF
[ "${PIPESTATUS[0]}" = 0 ] || fail "train --device cuda: losses not within tolerance of NumPy single (see summary.txt)"

echo "gpu_check: exit $status (results in $OUT_DIR)"
exit $status
