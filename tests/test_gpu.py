"""CuPy arrays on a real GPU (``pytest -m gpu``; skipped, with the reason, without one).

What the CPU suite (``test_staging*``, ``test_ipc``, through the host stand-in) cannot show:
the CUDA side of staging and of the device windows, i.e. the stream waiting for the
caller's stream, async copies into and out of pinned memory, reductions as CuPy kernels,
CUDA IPC handles and interprocess events between processes, CuPy's own integer kernels.
Run by ``scripts/gpu_check.sh`` on a machine with an NVIDIA GPU (with the MPS daemon and
without it):

* integer AVG and every op exact on CuPy for the extremes of every integer dtype (CuPy's
  integer ``fmod`` goes through double: the path must not use it), in one process and
  through every path of a group (small-message host path, windows, staged ring);
* the window collectives' matrix (``test_ipc.ipc_cases``, every collective and the uneven
  ones, one-shot and two-shot, 512-byte windows so calls take many rounds) on CuPy arrays,
  world sizes 2 and 4;
* a rank's device is ``LOCAL_RANK % GPUs``; several ranks on one GPU without MPS get one
  warning naming the fix, none with it;

* the collectives matrix of ``test_collectives`` on CuPy arrays, world sizes 2 and 4 on one
  GPU (every rank a process with its own CUDA context), against the NumPy oracle and
  byte-identical across ranks where it must be;
* a producer kernel on the caller's own (non-blocking) stream right before the call: the
  call must see its result (the staging stream waits for the caller's stream);
* p2p between CuPy arrays and between a CuPy and a NumPy end;
* ``ringcomm bench --device cuda,host`` checked clean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_same_results, compare_to_single
from test_collectives import _compare, _digest, matrix_cases, run_case
from test_ipc import IpcProxy, job_extremes, job_ipc_matrix
from test_staging import DeviceProxy

import ringcomm as rc
from ringcomm.device.xp import cupy_or_none


def _why_no_gpu() -> str | None:
    cp = cupy_or_none()
    if cp is None:
        return "CuPy is not installed (pip install 'ringcomm[gpu]')"
    try:
        if int(cp.cuda.runtime.getDeviceCount()) < 1:
            return "CuPy finds no GPU"
    except Exception as exc:  # noqa: BLE001 (no driver / no device: CuPy's own error)
        return f"CuPy finds no usable GPU: {exc}"
    return None


_REASON = _why_no_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]


class CupyProxy(DeviceProxy):
    """:class:`DeviceProxy` handing the group CuPy arrays (results must be CuPy arrays)."""

    @staticmethod
    def _dev(a: Any) -> Any:
        import cupy

        return None if a is None else cupy.asarray(a)

    @staticmethod
    def _host(res: Any) -> Any:
        import cupy

        if res is None:
            return None
        assert isinstance(res, cupy.ndarray), f"result is a {type(res).__name__}"
        return res.get()


def job_cupy_matrix(pg: rc.ProcessGroup, chunk_bytes: int) -> tuple[list[str], dict[int, Any]]:
    pg.chunk_bytes = chunk_bytes
    proxy = CupyProxy(pg)
    failures: list[str] = []
    digests: dict[int, Any] = {}
    for cid, case in enumerate(matrix_cases(pg.world_size)):
        try:
            res, exp, identical = run_case(proxy, cid, case)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            failures.append(f"rank {pg.rank}: {case}: {type(exc).__name__}: {exc}")
            break
        problem = _compare(case, res, exp)
        if problem:
            failures.append(f"rank {pg.rank}: {problem}")
        if identical:
            digests[cid] = _digest(res)
    return failures, digests


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])
def test_cupy_matrix(world_size: int, chunk_bytes: int) -> None:
    """test_collectives' matrix on CuPy arrays: its ring/rd/direct/star cases staged, its
    ``shm`` cases and the defaults through the device windows."""
    results = rc.spawn(job_cupy_matrix, world_size, args=(chunk_bytes,), timeout_s=280)
    assert_same_results(results)


def job_streams_and_p2p(pg: rc.ProcessGroup) -> list[str]:
    import cupy

    n, r = pg.world_size, pg.rank
    failures: list[str] = []
    pg.chunk_bytes = 1 << 20
    count = 8 << 20  # 32 MiB of float32: the producer kernels take a while
    for algo in ("ring", "rd", "ipc", "ipc-async"):
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            x = cupy.ones(count, cupy.float32)
            for _ in range(20):  # slow producer on the caller's stream
                x = x * 1.0 + 0.0
            x += r
            if algo == "ipc-async":  # run on the group's worker, on the stream taken here
                pg.all_reduce(x, async_op=True).wait(timeout_s=60)
            else:  # must wait for the producer, on its own stream
                pg.all_reduce(x, algo=algo)
            y = x * 1.0  # a consumer on the caller's stream sees the result
        want = float(n + n * (n - 1) // 2)
        got = cupy.asnumpy(y)
        if not np.all(got == want):
            failures.append(f"rank {r}: {algo}: producer on the caller's stream not waited for")
    # p2p, device to device and device to host
    right, left = (r + 1) % n, (r - 1) % n
    y = cupy.zeros(3_000_001, cupy.int32)
    w = pg.irecv(y, left, tag=5)
    pg.send(cupy.arange(3_000_001, dtype=cupy.int32) * r, right, tag=5)
    w.wait(timeout_s=60)
    if not np.array_equal(y.get(), np.arange(3_000_001, dtype=np.int32) * left):
        failures.append(f"rank {r}: p2p cupy->cupy")
    h = np.zeros(1000, np.float64)
    w = pg.irecv(h, left, tag=6)
    pg.send(cupy.full(1000, r, cupy.float64), right, tag=6)
    w.wait(timeout_s=60)
    if not np.all(h == left):
        failures.append(f"rank {r}: p2p cupy->numpy")
    return failures


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_cupy_streams_and_p2p(world_size: int) -> None:
    results = rc.spawn(job_streams_and_p2p, world_size, timeout_s=160)
    failures = [f for fails in results for f in fails]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(180)
def test_bench_cuda_vs_host_checks_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringcomm.cli import main

    code = main(
        [
            "bench",
            "all_reduce",
            "-n",
            "2",
            "-b",
            "8",
            "-e",
            "4M",
            "-f",
            "16",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--check",
            "-q",
            "--device",
            "cuda,host",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ringcomm-cuda/ringcomm busbw ratio" in out


# -- the training engine on CuPy (``ringcomm train --device cuda``) ---------------------
#: Engine cases: a small model, uneven shards and micro-batches, several buckets.
ENGINE_BASE = {
    "steps": 5,
    "dtype": "float64",
    "in_features": 16,
    "hidden": 24,
    "depth": 2,
    "classes": 5,
    "batch_size": 26,
    "bucket_bytes": 2000,
    "export": True,
    "timeout_s": 120.0,
}
#: CuPy against the NumPy ``single`` run. float64: cuBLAS and CuPy's reductions add in
#: their own orders and CUDA's exp/tanh/log may differ by an ulp, so results differ from
#: NumPy's at the 1e-16 level, as the ranks' partial sums do on the CPU (there: 1e-10,
#: seen ~1e-16); Adam's elementwise normalisation keeps relative errors relative. 1e-9
#: leaves room. float32: 1e-4 (the CPU oracle's 1e-5 across strategies, seen 2e-7, with
#: a further 10x for a different BLAS and math library).
ENGINE_TOL = {"float64": 1e-9, "float32": 1e-4}


def _engine_cases(n: int, device: str = "cuda") -> list[Any]:
    from ringcomm.engine.strategy import TrainConfig

    cases = [
        TrainConfig(strategy=s, world_size=n, device=device, **ENGINE_BASE)
        for s in ("dp", "zero1", "zero2", "zero3")
    ]
    for schedule in ("gpipe", "1f1b"):
        cases.append(
            TrainConfig(
                strategy="pipeline",
                world_size=n,
                device=device,
                micro_batches=4,
                schedule=schedule,
                **ENGINE_BASE,
            )
        )
    for s in ("dp", "zero3"):
        cases.append(
            TrainConfig(
                strategy=s, world_size=n, device=device, **{**ENGINE_BASE, "dtype": "float32"}
            )
        )
    return cases


_ENGINE_KEEP = (
    "losses",
    "params",
    "loss_rank",
    "array_module",
    "device_id",
    "peak_bytes",
    "traced_bytes_end",
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "staging_bytes",
    "staging_acquires",
)


def _engine_row(r: dict[str, Any]) -> dict[str, Any]:
    row = {k: r[k] for k in _ENGINE_KEEP}
    row["activation_peak_bytes"] = r["extra"].get("activation_peak_bytes")
    return row


def job_engine_cupy(pg: rc.ProcessGroup, cases: list[Any]) -> dict[str, Any]:
    """Every engine case on a fresh sub-group; on rank 0 also ``single`` on the device."""
    from ringcomm.engine.strategy import TrainConfig
    from ringcomm.engine.train import train_rank

    single = None
    if pg.rank == 0:
        cfg = TrainConfig(strategy="single", device=cases[0].device, **ENGINE_BASE)
        single = _engine_row(train_rank(None, cfg))
    rows = []
    for cfg in cases:
        sub = pg.new_group(range(pg.world_size))
        try:
            rows.append(_engine_row(train_rank(sub, cfg)))
        finally:
            sub.close()
    return {"single": single, "cases": rows}


def check_engine_results(
    per_rank: list[dict[str, Any]], cases: list[Any], module: str, gpus: int | None
) -> list[str]:
    """What :func:`test_engine_strategies_match_single_on_cupy` asserts, as failure lines:
    losses and final parameters against NumPy's ``single`` (:data:`ENGINE_TOL`), arrays of
    ``module`` on GPU ``rank % gpus``, the staged path used, memory readings that hold at
    least the model state, activation peaks measured for the pipeline."""
    from ringcomm.cli.train import run_training
    from ringcomm.engine.strategy import TrainConfig

    n = len(per_rank)
    device = cases[0].device
    refs: dict[str, dict[str, Any]] = {}
    failures: list[str] = []
    runs = [(TrainConfig(strategy="single", device=device, **ENGINE_BASE), [per_rank[0]["single"]])]
    runs += [(cfg, [per_rank[r]["cases"][k] for r in range(n)]) for k, cfg in enumerate(cases)]
    for cfg, results in runs:
        label = f"{cfg.strategy}-n{len(results)}-{cfg.dtype}"
        if cfg.strategy == "pipeline":
            label += f"-{cfg.schedule}"
        if cfg.dtype not in refs:
            ref_cfg = TrainConfig(strategy="single", **{**ENGINE_BASE, "dtype": cfg.dtype})
            refs[cfg.dtype] = run_training(ref_cfg)[0]
        ref, tol = refs[cfg.dtype], ENGINE_TOL[cfg.dtype]
        for rank, res in enumerate(results):
            want_id = None if gpus is None else rank % gpus
            if res["array_module"] != module or res["device_id"] != want_id:
                failures.append(
                    f"{label}: rank {rank} on {res['array_module']}, device {res['device_id']}"
                )
            state = res["param_bytes"] + res["grad_bytes"] + res["optim_bytes"]
            if not (res["traced_bytes_end"] >= state and res["peak_bytes"] >= state):
                failures.append(
                    f"{label}: rank {rank}: {res['traced_bytes_end']} bytes in use, "
                    f"peak {res['peak_bytes']}, < model state {state}"
                )
            staged = res["staging_acquires"] > 0 and res["staging_bytes"] > 0
            if cfg.strategy != "single" and not staged and module != "cupy":
                # (CuPy on one host: the device windows carry it, no staging buffer)
                failures.append(f"{label}: rank {rank} staged nothing")
            peaks = res["activation_peak_bytes"]
            if cfg.strategy == "pipeline" and not (peaks and max(peaks) > 0):
                failures.append(f"{label}: rank {rank} activation peaks {peaks}")
        compare_to_single(failures, label, results, ref, cfg.steps, tol)
    return failures


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world_size", [2, 4])
def test_engine_strategies_match_single_on_cupy(world_size: int) -> None:
    """Every strategy on CuPy arrays (params, grads, optimizer state on the GPU) equals
    ``single`` on NumPy; the staged path carried the communication; the CuPy pool's
    readings hold at least the model state."""
    import cupy

    cases = _engine_cases(world_size)
    per_rank = rc.spawn(job_engine_cupy, world_size, args=(cases,), timeout_s=400)
    gpus = int(cupy.cuda.runtime.getDeviceCount())
    failures = check_engine_results(per_rank, cases, "cupy", gpus)
    assert not failures, "\n".join(failures)


# -- issue 31: exact integers, device windows, devices, MPS ------------------------------
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


def test_integer_ops_exact_on_cupy() -> None:
    """CuPy's kernels, no group: AVG's truncation and every op on the extremes of every
    integer dtype equal NumPy's (the oracle's Python-int truncation for AVG)."""
    import cupy

    from ringcomm.ops import finalize, reduce_into, reference_reduce

    bad = []
    for dtn in INT_DTYPES:
        info = np.iinfo(dtn)
        values = np.array(
            [
                info.min,
                info.min + 1,
                info.max,
                info.max - 1,
                0,
                1,
                -1 if info.min else 2,
                2**53 + 1 if info.bits == 64 else 5,
            ],
            dtn,
        )
        for n in (2, 3, 7, 8, 1000):
            acc = cupy.asarray(values)
            finalize("avg", acc, n)
            want = [(abs(int(v)) // n) * (1 if v >= 0 else -1) for v in values.tolist()]
            if acc.get().tolist() != want:
                bad.append(f"{dtn} avg /{n}: {acc.get().tolist()} != {want}")
        other = np.roll(values, 3)
        for op in ("sum", "max", "min", "prod"):
            acc = cupy.asarray(values)
            reduce_into(op, acc, cupy.asarray(other))
            want_arr = reference_reduce(op, [values, other])
            if not np.array_equal(acc.get(), want_arr):
                bad.append(f"{dtn} {op}: {acc.get().tolist()} != {want_arr.tolist()}")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_integer_extremes_through_every_path(world_size: int) -> None:
    import cupy

    assert (
        rc.spawn(job_extremes, world_size, args=(cupy.asarray,), timeout_s=280) == [[]] * world_size
    )


class CupyIpcProxy(IpcProxy):
    """test_ipc's proxy (``algo="ipc"``, the uneven collectives) handing CuPy arrays."""

    _dev = CupyProxy._dev
    _host = CupyProxy._host


@pytest.fixture
def tiny_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGCOMM_IPC_WINDOW_BYTES", "512")
    monkeypatch.setenv("RINGCOMM_IPC_SMALL_BYTES", "0")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ipc_matrix_on_cupy(world_size: int, tiny_windows: None) -> None:
    """Every collective through CUDA IPC windows of 512 bytes (many rounds), exact, the
    same bytes on every rank where they must be."""
    results = rc.spawn(job_ipc_matrix, world_size, args=(CupyIpcProxy,), timeout_s=280)
    assert_same_results(results)


def job_devices(pg: rc.ProcessGroup) -> dict[str, Any]:
    import warnings

    import cupy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = cupy.full(1 << 20, pg.rank, cupy.float32)  # windows, not the small path
        pg.all_reduce(x)
        pg.all_reduce(x)
    ext = pg.core.workspace_calls.extensions["ipc"]
    return {
        "device": int(cupy.cuda.runtime.getDevice()),
        "array_device": int(x.device.id),
        "sum": float(x.get()[0]),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "sharing": dict(ext.sharing),
        "mps": ext.mps,
        "windows": ext.window_calls,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_devices_and_the_mps_warning(world_size: int) -> None:
    """Rank r on GPU ``r % GPUs``; ranks sharing a GPU without MPS: one warning per
    process naming the fix; with MPS, or one rank per GPU: none."""
    import cupy

    from ringcomm.config import mps_active

    gpus = int(cupy.cuda.runtime.getDeviceCount())
    got = rc.spawn(job_devices, world_size, timeout_s=100)
    mps = mps_active()
    n = world_size
    shared = n > gpus
    for r, res in enumerate(got):
        assert res["device"] == r % gpus == res["array_device"], res
        assert res["sum"] == n * sum(range(n)), res
        assert res["mps"] is mps and res["windows"] == 2, res
        if shared and not mps:
            assert len(res["warnings"]) == 1 and "nvidia-cuda-mps-control -d" in res["warnings"][0]
        else:
            assert res["warnings"] == [], res


def job_ipc_large(pg: rc.ProcessGroup) -> list[str]:
    """Large calls (default windows: 64 MiB rounds), one-shot and two-shot, every
    collective once, float32 sums of integers (exact)."""
    import cupy

    import ringcomm.collectives.ipc as ipc_mod

    n, r = pg.world_size, pg.rank
    bad = []
    count = 48 << 20  # 192 MiB of float32: three rounds of the default window
    for threshold in (1 << 20, -1):  # one-shot, then two-shot (at W > 2)
        ipc_mod.ONE_SHOT_MAX_BYTES = threshold
        x = cupy.arange(count, dtype=cupy.float32) % 1000 + r
        pg.all_reduce(x)
        want = (cupy.arange(count, dtype=cupy.float32) % 1000) * n + n * (n - 1) // 2
        if not bool(cupy.all(x == want)):
            bad.append(f"rank {r}: all_reduce threshold {threshold}")
    rows = cupy.full((n, 8 << 20), r + 1, cupy.int32)
    out = pg.reduce_scatter(rows)
    if not bool(cupy.all(out == n * (n + 1) // 2)):
        bad.append(f"rank {r}: reduce_scatter")
    got = pg.all_gather(cupy.full(8 << 20, r, cupy.int16))
    if not bool(cupy.all(got == cupy.arange(n, dtype=cupy.int16)[:, None])):
        bad.append(f"rank {r}: all_gather")
    return bad


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ipc_large_calls(world_size: int) -> None:
    assert rc.spawn(job_ipc_large, world_size, timeout_s=180) == [[]] * world_size
