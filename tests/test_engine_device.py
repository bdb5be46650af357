"""The engine on device arrays, checked without a GPU: ``--device host-staged``.

``host-staged`` computes on the host stand-in device (``ringcomm.device.standin``): every
parameter, gradient, optimizer state, batch and activation is a stand-in device array,
computed with the stand-in's ``xp`` (NumPy underneath) through the very code CuPy runs,
and every collective and p2p call takes the staged path CuPy arrays take: pinned staging
buffers, a stream whose copies and reductions run lazily (only when an event after them is
waited for), events, the pool. The stand-in never turns into a NumPy array implicitly, so a
step that forgot to copy its data over or reads device memory with NumPy raises here as it
would on a GPU; a strategy that reads a buffer before its collective finished gives stale
bytes and misses the oracle. What this cannot check is CUDA itself (``tests/test_gpu.py``,
``tests/test_gpu_e2e.py``, ``scripts/gpu_check.sh``).

* Oracle (MLP): every strategy (dp, zero1, zero2, zero3, pipeline GPipe/1F1B at M = 1, 4)
  with host-staged equals ``single`` on NumPy (float64: losses to 1e-10 relative,
  parameters to 1e-10 absolute, as ``test_engine_oracle``), at W = 2 and 3 (uneven
  shards), with 512-byte pieces so every message is many staged pieces. Each run must have
  taken buffers from the staging pool (the staged path really ran), computed on the
  stand-in, and sent exactly the bytes the same strategy sends on ``cpu``.
* Oracle (transformer): single, dp, zero1/2/3, pipeline, tp (with and without sequence
  parallel) and 3d meshes on host-staged equal NumPy's ``single`` (float64 1e-10, float32
  1e-5) at W = 2 and 4.
* The CLI: ``ringcomm train --device host-staged`` end to end, its JSON.
* The GPU-only bookkeeping that can run on the host: the CuPy-pool meter against a fake
  pool, device selection, the array modules of the devices.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import compare_to_single

import ringcomm as rc
from ringcomm.cli.train import run_training
from ringcomm.device.standin import STANDIN, StandinArray
from ringcomm.engine.memory import CupyPoolMeter, device_used_bytes, make_meter, staging_stats
from ringcomm.engine.strategy import (
    DEVICES,
    StrategyUnavailable,
    TrainConfig,
    array_module,
    select_device,
    strategy_class,
)
from ringcomm.engine.train import train_rank

BASE = {
    "steps": 5,
    "dtype": "float64",
    "in_features": 16,
    "hidden": 24,
    "depth": 2,
    "classes": 5,
    "batch_size": 26,  # uneven over 3 ranks and over 4 micro-batches
    "bucket_bytes": 2000,  # several buckets (each Linear its own)
    "export": True,
    "timeout_s": 60.0,
}
TOL = 1e-10
#: Pieces of at most this many bytes: a 24x24 float64 layer is ~9 pieces per message.
CHUNK_BYTES = 512
#: Strategies also run on ``cpu`` in the same job, to compare the bytes sent.
ALSO_ON_CPU = ("dp", "zero2", "zero3", "pipeline")


def _cases(n: int) -> list[TrainConfig]:
    cases = []
    for device in ("host-staged", "cpu"):
        for strategy in ("dp", "zero1", "zero2", "zero3"):
            if device == "host-staged" or strategy in ALSO_ON_CPU:
                cases.append(TrainConfig(strategy=strategy, world_size=n, device=device, **BASE))
        for m, schedule in ((1, "gpipe"), (4, "gpipe"), (4, "1f1b")):
            if device == "cpu" and (m, schedule) != (4, "1f1b"):
                continue
            cases.append(
                TrainConfig(
                    strategy="pipeline",
                    world_size=n,
                    device=device,
                    micro_batches=m,
                    schedule=schedule,
                    **BASE,
                )
            )
    # SGD with momentum through the staged path too (different optimizer state).
    cases.append(
        TrainConfig(
            strategy="zero3",
            world_size=n,
            device="host-staged",
            **{**BASE, "optimizer": "sgd", "lr": 0.05},
        )
    )
    return cases


#: What staged_job hands back of each case's result.
STAGED_JOB_KEYS = (
    "losses",
    "params",
    "loss_rank",
    "staging_acquires",
    "staging_bytes",
    "sent_bytes_per_step",
    "array_module",
)


def staged_job(pg: Any, cases: list[TrainConfig]) -> list[dict[str, Any]]:
    """Every case on a fresh sub-group (own tag space), with small pieces."""
    out = []
    for cfg in cases:
        sub = pg.new_group(range(pg.world_size))
        sub.chunk_bytes = CHUNK_BYTES
        try:
            r = train_rank(sub, cfg)
        finally:
            sub.close()
        out.append({k: r[k] for k in STAGED_JOB_KEYS})
    return out


def _label(cfg: TrainConfig) -> str:
    s = f"{cfg.strategy}-n{cfg.world_size}-{cfg.device}-{cfg.optimizer}"
    if cfg.strategy == "pipeline":
        s += f"-{cfg.schedule}-m{cfg.micro_batches}"
    return s


_SINGLE: dict[tuple[str, float], dict[str, Any]] = {}


def _single(cfg: TrainConfig) -> dict[str, Any]:
    key = (cfg.optimizer, cfg.lr)
    if key not in _SINGLE:
        ref = TrainConfig(strategy="single", **{**BASE, "optimizer": cfg.optimizer, "lr": cfg.lr})
        _SINGLE[key] = run_training(ref)[0]
    return _SINGLE[key]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3])
def test_host_staged_strategies_match_single(
    n: int, no_child_processes: None, no_workspace: None
) -> None:
    """(Both on the message path: the shared workspace takes host arrays only.)"""
    cases = _cases(n)
    per_rank = rc.spawn(staged_job, n, args=(cases,), timeout_s=200)
    failures: list[str] = []
    sent: dict[tuple[str, str, int], list[float]] = {}
    worst = 0.0
    for k, cfg in enumerate(cases):
        label = _label(cfg)
        results = [per_rank[r][k] for r in range(n)]
        staged = cfg.device == "host-staged"
        for r, res in enumerate(results):
            # The staged path ran (host-staged) or was never touched (cpu).
            if staged and not (res["staging_acquires"] > 0 and res["staging_bytes"] > 0):
                failures.append(f"{label}: rank {r} took no staging buffer: {res}")
            if not staged and res["staging_acquires"] != 0:
                failures.append(f"{label}: rank {r} staged on cpu ({res['staging_acquires']})")
            want = STANDIN.__name__ if staged else "numpy"
            if res["array_module"] != want:
                failures.append(f"{label}: computed with {res['array_module']}, not {want}")
        sent[(cfg.strategy, cfg.schedule, cfg.micro_batches, cfg.optimizer, cfg.device)] = [
            res["sent_bytes_per_step"] for res in results
        ]
        ref = _single(cfg)
        err = compare_to_single(failures, label, results, ref, cfg.steps, TOL)
        if err is not None:
            worst = max(worst, err)
    # The staged path puts the same bytes on the wire as the host path.
    compared = 0
    for key, staged_sent in sent.items():
        if key[-1] == "host-staged" and (*key[:-1], "cpu") in sent:
            compared += 1
            cpu_sent = sent[(*key[:-1], "cpu")]
            if staged_sent != cpu_sent:
                failures.append(f"{key[:-1]}: sent per step staged {staged_sent}, cpu {cpu_sent}")
    assert compared == len(ALSO_ON_CPU)
    print(f"n={n}: worst relative loss / absolute parameter error {worst:.3g}")
    assert not failures, "\n".join(failures)


# -- the transformer on the stand-in device ------------------------------------------------
TBASE = {
    "model": "transformer",
    "vocab": 8,
    "seq_len": 4,
    "d_model": 8,
    "heads": 4,
    "depth": 2,
    "steps": 3,
    "dtype": "float64",
    "batch_size": 6,  # uneven over 4 replicas and over 4 micro-batches
    "micro_batches": 2,
    "export": True,
    "timeout_s": 120.0,
}
TTOL = {"float64": 1e-10, "float32": 1e-5}


def _t(strategy: str, n: int, **kw: Any) -> TrainConfig:
    return TrainConfig(strategy=strategy, world_size=n, device="host-staged", **{**TBASE, **kw})


#: Every strategy of the transformer on the stand-in device (both dtypes among them).
TRANSFORMER_CASES = {
    2: [
        _t("dp", 2),
        _t("zero1", 2),
        _t("zero2", 2, dtype="float32"),
        _t("zero3", 2),
        _t("pipeline", 2),
        _t("pipeline", 2, schedule="1f1b", dtype="float32"),
        _t("tp", 2, tp=2),
        _t("tp", 2, tp=2, sequence_parallel=True),
        _t("tp", 2, tp=2, sequence_parallel=True, dtype="float32"),
        _t("3d", 2, pp=2, schedule="1f1b"),
    ],
    4: [
        _t("tp", 4, tp=4, dtype="float32"),
        _t("pipeline", 4, micro_batches=4),
        _t("3d", 4, dp=2, tp=2, sequence_parallel=True, zero=1),
        _t("3d", 4, dp=2, pp=2, zero=2),
        _t("3d", 4, pp=2, tp=2, sequence_parallel=True, dtype="float32"),
    ],
}


def _tlabel(cfg: TrainConfig) -> str:
    s = f"{cfg.strategy}-n{cfg.world_size}-dp{cfg.dp}-pp{cfg.pp}-tp{cfg.tp}-{cfg.dtype}"
    if cfg.sequence_parallel:
        s += "-sp"
    if cfg.zero:
        s += f"-zero{cfg.zero}"
    return s + (f"-{cfg.schedule}-m{cfg.micro_batches}" if cfg.strategy == "pipeline" else "")


_TSINGLE: dict[str, dict[str, Any]] = {}


def _tsingle(dtype: str) -> dict[str, Any]:
    """NumPy's ``single`` (device cpu): the oracle."""
    if dtype not in _TSINGLE:
        cfg = TrainConfig(strategy="single", **{**TBASE, "dtype": dtype})
        _TSINGLE[dtype] = run_training(cfg)[0]
    return _TSINGLE[dtype]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_host_staged_transformer_single_matches_numpy(dtype: str) -> None:
    """One process: the stand-in device computes exactly what NumPy computes."""
    cfg = TrainConfig(strategy="single", device="host-staged", **{**TBASE, "dtype": dtype})
    res = run_training(cfg)[0]
    assert res["array_module"] == STANDIN.__name__
    failures: list[str] = []
    err = compare_to_single(failures, f"single-{dtype}", [res], _tsingle(dtype), 3, TTOL[dtype])
    assert not failures and err is not None and err <= TTOL[dtype], failures


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 4])
def test_host_staged_transformer_strategies_match_single(n: int, no_child_processes: None) -> None:
    cases = TRANSFORMER_CASES[n]
    per_rank = rc.spawn(staged_job, n, args=(cases,), timeout_s=200)
    failures: list[str] = []
    worst: dict[str, float] = {}
    for k, cfg in enumerate(cases):
        label = _tlabel(cfg)
        results = [per_rank[r][k] for r in range(n)]
        for r, res in enumerate(results):
            if res["array_module"] != STANDIN.__name__:
                failures.append(f"{label}: rank {r} computed with {res['array_module']}")
            if not res["staging_acquires"] > 0:
                failures.append(f"{label}: rank {r} took no staging buffer")
        err = compare_to_single(
            failures, label, results, _tsingle(cfg.dtype), cfg.steps, TTOL[cfg.dtype]
        )
        if err is not None:
            worst[cfg.dtype] = max(worst.get(cfg.dtype, 0.0), err)
    print(f"n={n}: worst relative loss / absolute parameter error per dtype: {worst}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
def test_gpu_e2e_transformer_check_runs_on_the_standin(no_child_processes: None) -> None:
    """``tests/test_gpu_e2e.py``'s transformer job and checker, on the stand-in device (a
    few cases): the GPU test's own code is exercised here, where CI runs."""
    from test_gpu_e2e import check_transformer_results, transformer_cases, transformer_job

    cases = transformer_cases(2, "host-staged")[-4:]
    per_rank = rc.spawn(transformer_job, 2, args=(cases,), timeout_s=100)
    assert not check_transformer_results(per_rank, cases, STANDIN.__name__)
    # and it can fail: a wrong module, or losses off the oracle
    assert check_transformer_results(per_rank, cases, "cupy")
    per_rank[0]["cases"][0]["losses"][1] *= 1.001
    assert any(
        "loss rel err" in f for f in check_transformer_results(per_rank, cases, STANDIN.__name__)
    )


@pytest.mark.timeout(200)
def test_train_cli_host_staged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_child_processes: None
) -> None:
    from ringcomm.cli import main

    small = shlex.split(
        "--steps 4 --dtype float64 --hidden 16 --layers 2 --in-features 8 --classes 3"
        " --batch-size 12 -q"
    )
    assert main(["train", "--strategy", "single", *small, "--json", str(tmp_path / "s.json")]) == 0
    zero1 = shlex.split("train --strategy zero1 -n 2 --device host-staged --bucket-bytes 1K")
    code = main([*zero1, *small, "--json", str(tmp_path / "z.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    single = json.loads((tmp_path / "s.json").read_text())
    zero1 = json.loads((tmp_path / "z.json").read_text())
    assert zero1["device"] == "host-staged" and single["device"] == "cpu"
    assert zero1["peak_bytes_source"] == "tracemalloc"
    assert zero1["losses"] == pytest.approx(single["losses"], rel=1e-10)
    assert [r["rank"] for r in zero1["per_rank"]] == [0, 1]
    for row in zero1["per_rank"]:
        assert row["staging_bytes"] > 0 and row["peak_bytes"] > 0 and row["sent_bytes_per_step"] > 0
    assert single["per_rank"][0]["staging_bytes"] == 0
    assert "device host-staged" in out and "staging MiB" in out


# -- the GPU-only bookkeeping, on the host ----------------------------------------------
def test_device_array_modules() -> None:
    assert DEVICES == ("cpu", "cuda", "host-staged")
    assert array_module("cpu") is np and array_module("host-staged") is STANDIN
    with pytest.raises(StrategyUnavailable, match="cpu, cuda, host-staged"):
        array_module("tpu")


def test_host_staged_model_lives_on_the_standin_device() -> None:
    """Parameters, gradients, optimizer state and the batch are device arrays; the group is
    handed the buffers themselves (views: what a collective writes lands in the model)."""
    cfg = TrainConfig(strategy="single", device="host-staged", **{**BASE, "export": False})
    strat = strategy_class("single")(None, cfg)
    for a in (strat.params, strat.grads, *strat.opt.state_arrays(), *strat.local_batch(0)):
        assert isinstance(a, StandinArray)
    view = strat.as_comm(strat.params[3:9])
    assert isinstance(view, StandinArray)
    view.set(np.arange(6.0))
    assert np.array_equal(strat.params[3:9].get(), np.arange(6.0))
    # a host batch handed to a device layer is refused, as CuPy refuses it
    x_host = strat.data.batch(0)[0]
    with pytest.raises(TypeError, match=r"numpy\.ndarray mixed with stand-in"):
        strat.layers[0].forward(strat.pviews[0], x_host)
    assert strat.step(0) > 0  # (the step itself computes on the device only)
    cpu = strategy_class("single")(None, TrainConfig(strategy="single", **BASE))
    assert cpu.as_comm(cpu.params) is cpu.params and cpu.device_id is None
    assert staging_stats(None) == {"bytes": 0, "acquires": 0}


class _FakePool:
    """CuPy's MemoryPool surface the meter reads: a pool that caches freed blocks."""

    def __init__(self) -> None:
        self.used = 0
        self.cached = 0
        self.freed_all = 0

    def malloc(self, nbytes: int) -> None:
        take = min(self.cached, nbytes)
        self.cached -= take
        self.used += nbytes

    def free(self, nbytes: int) -> None:
        self.used -= nbytes
        self.cached += nbytes

    def total_bytes(self) -> int:
        return self.used + self.cached

    def used_bytes(self) -> int:
        return self.used

    def free_all_blocks(self) -> None:
        self.freed_all += 1
        self.cached = 0


def test_cupy_pool_meter_bookkeeping() -> None:
    pool = _FakePool()
    fake_cp = SimpleNamespace(get_default_memory_pool=lambda: pool)
    meter = make_meter("cuda", fake_cp)
    assert isinstance(meter, CupyPoolMeter)
    meter.start()
    pool.malloc(1000)  # the model, built after start
    pool.malloc(5000)
    pool.free(5000)  # construction's temporary: cached, released before step 1
    for step, temp in enumerate((300, 700, 200)):
        meter.begin_step(step)
        pool.malloc(temp)
        pool.free(temp)
        meter.end_step()
    pool.malloc(50)  # still held at the end (from a cached block: the pool does not grow)
    meter.stop()
    meter.stop()  # idempotent
    assert pool.freed_all == 1  # before the first step only
    assert meter.peak == 1000 + 700  # the pool's high-water over the steps
    assert meter.held == 1050
    probe = device_used_bytes(fake_cp)
    assert probe is not None and probe() == 1050
    assert device_used_bytes(np) is None


def test_select_device_round_robin() -> None:
    used: list[int] = []
    runtime = SimpleNamespace(getDeviceCount=lambda: 3)

    def device(i: int) -> SimpleNamespace:
        return SimpleNamespace(use=lambda: used.append(i))

    fake_cp = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Device=device))
    assert [select_device(fake_cp, r) for r in range(5)] == [0, 1, 2, 0, 1]
    assert used == [0, 1, 2, 0, 1]
