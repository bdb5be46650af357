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
#   train_summary.txt, train_e2e.tar.gz   scripts/gpu_check_train.sh (issue 32): every
#                                 strategy of both models on --device cuda against NumPy's
#                                 single (float32, 1e-4 on every step's loss), the pipeline
#                                 bubble, pytest -m gpu tests/test_gpu_e2e.py (the
#                                 transformer on CuPy; the torch backend on CUDA tensors
#                                 against Gloo); ~3 min
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
# -- the training engine and the torch backend on the GPU (issue 32) -----------------------
# Self-contained: scripts/gpu_check_train.sh (its own parts, timeouts and wall times);
# it writes train_summary.txt and train_e2e.tar.gz and appends to summary.txt.
bash scripts/gpu_check_train.sh "$OUT_DIR" || fail "gpu_check_train.sh (see train_summary.txt)"
# -- end of the issue 32 section ------------------------------------------------------------

echo "gpu_check: exit $status (results in $OUT_DIR)"
exit $status
