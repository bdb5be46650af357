"""Tensor parallel and the 3-D mesh reproduce `single` on the transformer, and move the
bytes Megatron's count says.

One spawned job per world size (1, 2, 4, 8) runs every case on a fresh sub-group of all ranks
(as test_engine_oracle.py). Cases: ``tp`` at T = 2 and 4 (float64 and float32, with and
without sequence parallel), and ``3d`` over the factorisations dp x pp x tp = 2x1x1, 1x2x1,
2x2x1, 1x2x2, 2x1x2, 4x1x1, 2x2x2, 1x2x4, 4x1x2, with ZeRO-1/2 over dp and both pipeline
schedules among them; and ``dp``/``zero3`` on the unsplit transformer. Tolerances as the MLP oracle: float64 1e-10 (relative on losses,
absolute on parameters), float32 1e-5. The runs are not bit-identical: a row-parallel
layer sums the ranks' partial products in the ring's order, a few ulps from the single
matrix product.

Bytes (tp axis, the engine's per-axis counter, :mod:`ringcomm.engine.mesh`): per step,
each block all-reduces ``batch*seq*d_model`` twice forward (after attention and after the
MLP) and twice backward (before the two column-parallel inputs), Megatron's count; around
them the vocab-parallel embedding adds one forward, the LM head's input one backward, and
the vocab-parallel loss an all_reduce MAX of ``batch*seq`` and one SUM of ``2*batch*seq``
(never the ``batch*seq*vocab`` logits). Each all_reduce sends ``2 (T-1)/T`` of its buffer.
Sequence parallel sends the same volume as reduce_scatter + all_gather, plus one
all_reduce of the replicated parameters' gradients (norms, row biases, positions). The
group's own shared-workspace counter must see the same payload.

Activation memory under sequence parallel: measured with tracemalloc (last test).
"""

from __future__ import annotations

import os
import shlex
from typing import Any

import numpy as np
import pytest
from conftest import compare_to_single

import ringcomm as rc
from ringcomm.cli.train import run_training
from ringcomm.engine.strategy import TrainConfig
from ringcomm.engine.tp import local_shape
from ringcomm.engine.train import train_rank
from ringcomm.engine.transformer import transformer

MODEL = {"vocab": 8, "seq_len": 4, "d_model": 8, "heads": 4, "depth": 2}
BASE = {
    "model": "transformer",
    "steps": 3,
    "dtype": "float64",
    "batch_size": 6,  # uneven over micro-batches and over 4 replicas
    "micro_batches": 2,
    "export": True,
    "verbose": False,
    "timeout_s": 120.0,
    **MODEL,
}
TOL = {"float64": 1e-10, "float32": 1e-5}
#: Whether the ranks' groups run on the shared workspace (its counter checks the payload).
WORKSPACE = os.environ.get("RINGCOMM_WORKSPACE", "1") != "0"


def _3d(dp: int, pp: int, tp: int, **kw: Any) -> TrainConfig:
    return TrainConfig(
        strategy="3d", world_size=dp * pp * tp, dp=dp, pp=pp, tp=tp, **{**BASE, **kw}
    )


def _tp(t: int, **kw: Any) -> TrainConfig:
    return TrainConfig(strategy="tp", world_size=t, tp=t, **{**BASE, **kw})


CASES = {
    1: [_tp(1), _3d(1, 1, 1)],
    2: [
        _tp(2),
        _tp(2, dtype="float32"),
        _tp(2, sequence_parallel=True),
        _3d(2, 1, 1),
        _3d(1, 2, 1, schedule="1f1b"),
        # the data-parallel family runs the (unsplit) transformer too
        TrainConfig(strategy="dp", world_size=2, **BASE),
        TrainConfig(strategy="zero3", world_size=2, **BASE),
    ],
    4: [
        _tp(4),
        _tp(4, sequence_parallel=True, dtype="float32"),
        _3d(2, 2, 1),
        _3d(1, 2, 2, sequence_parallel=True, schedule="1f1b"),
        _3d(2, 1, 2),
        _3d(2, 1, 2, sequence_parallel=True),  # dp overlapped, then the sp gradient sums
        _3d(2, 1, 2, zero=1),
        _3d(2, 2, 1, zero=2),
        _3d(2, 1, 2, zero=2, device="host-staged"),  # every buffer through the staged path
        _3d(4, 1, 1),
    ],
    8: [
        _3d(2, 2, 2),
        _3d(2, 2, 2, sequence_parallel=True, zero=1, schedule="1f1b"),
        _3d(1, 2, 4),
        _3d(4, 1, 2, zero=2),
    ],
}


def tp_job(pg: Any, cases: list[TrainConfig]) -> list[dict[str, Any]]:
    out = []
    for cfg in cases:
        sub = pg.new_group(range(pg.world_size))
        try:
            r = train_rank(sub, cfg)
        finally:
            sub.close()
        out.append({k: r[k] for k in ("losses", "params", "loss_rank", "extra", "param_bytes")})
    return out


_SINGLE: dict[str, dict[str, Any]] = {}


def _single(dtype: str) -> dict[str, Any]:
    if dtype not in _SINGLE:
        ref = TrainConfig(strategy="single", world_size=1, **{**BASE, "dtype": dtype})
        _SINGLE[dtype] = run_training(ref)[0]
    return _SINGLE[dtype]


def _label(cfg: TrainConfig) -> str:
    s = f"{cfg.strategy}-dp{cfg.dp}-pp{cfg.pp}-tp{cfg.tp}-{cfg.dtype}"
    if cfg.sequence_parallel:
        s += "-sp"
    if cfg.zero:
        s += f"-zero{cfg.zero}"
    if cfg.device != "cpu":
        s += f"-{cfg.device}"
    return s + (f"-{cfg.schedule}" if cfg.pp > 1 else "")


def _tp_bytes(cfg: TrainConfig, itemsize: int) -> tuple[float, float]:
    """(payload, ring-sent) bytes per step and rank on the tp axis (module docstring)."""
    B, S, D, L, T = cfg.batch_size, cfg.seq_len, cfg.d_model, cfg.depth, cfg.tp
    if T == 1:  # a group of one: every pair is the identity
        return 0.0, 0.0
    activations = (4 * L + 2) * B * S * D * itemsize  # all_reduces of b*s*d
    loss = 3 * B * S * itemsize
    payload = activations + loss
    sent = 2 * (T - 1) / T * payload
    if cfg.sequence_parallel:
        # each all_reduce becomes an all_gather (handed b*s*d/T) in one direction and a
        # reduce_scatter (b*s*d) in the other, and f/g communicate both ways: same volume
        payload = activations / T + activations + loss
        grads = (6 * D * L + S * D + 2 * D) * itemsize  # one all_reduce of them
        sent += 2 * (T - 1) / T * grads
        payload += grads
    return payload, sent


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_tp_and_3d_match_single(n: int, no_child_processes: None) -> None:
    cases = CASES[n]
    per_rank = rc.spawn(tp_job, n, args=(cases,), timeout_s=360)
    failures: list[str] = []
    worst: dict[str, float] = {}
    for k, cfg in enumerate(cases):
        results = [per_rank[r][k] for r in range(n)]
        err = compare_to_single(
            failures, _label(cfg), results, _single(cfg.dtype), cfg.steps, TOL[cfg.dtype]
        )
        if err is not None:
            worst[cfg.dtype] = max(worst.get(cfg.dtype, 0.0), err)
        if cfg.strategy not in ("tp", "3d"):
            continue
        # the mesh coordinates are the rank's, and every axis but the mesh's own is silent
        for r, res in enumerate(results):
            c, by = res["extra"]["mesh"], res["extra"]["sent_bytes_per_step_by_axis"]
            assert r == (c["dp"] * cfg.pp + c["pp"]) * cfg.tp + c["tp"], (_label(cfg), r, c)
            for axis, size in (("dp", cfg.dp), ("pp", cfg.pp), ("tp", cfg.tp)):
                assert (by[axis] > 0) == (size > 1), (_label(cfg), r, axis, by)
        if cfg.strategy == "tp":
            _check_tp_bytes(cfg, results, failures)
    print(f"n={n}: worst relative loss / absolute parameter error per dtype: {worst}")
    assert not failures, "\n".join(failures)


def _check_tp_bytes(cfg: TrainConfig, results: list[dict[str, Any]], failures: list[str]) -> None:
    itemsize = np.dtype(cfg.dtype).itemsize
    payload, sent = _tp_bytes(cfg, itemsize)
    # parameter bytes: the split tensors 1/T of single's, the replicated ones whole
    split = repl = 0
    for layer in transformer(
        **{k: getattr(cfg, k) for k in ("vocab", "seq_len", "d_model", "heads")}, layers=cfg.depth
    ):
        for spec in layer.specs():
            numel = int(np.prod(spec.shape))
            if spec.dim is None:
                repl += numel
            else:
                split += numel
                assert int(np.prod(local_shape(spec, cfg.tp))) * cfg.tp == numel
    want_params = (split // cfg.tp + repl) * itemsize
    single_params = _single(cfg.dtype)["param_bytes"]
    assert single_params == (split + repl) * itemsize
    for r, res in enumerate(results):
        got = res["extra"]["collective_bytes_per_step_by_axis"]["tp"]
        if got != payload:
            failures.append(f"{_label(cfg)} rank {r}: tp payload {got} != {payload}")
        got = res["extra"]["sent_bytes_per_step_by_axis"]["tp"]
        if got != pytest.approx(sent, rel=1e-12):
            failures.append(f"{_label(cfg)} rank {r}: tp sent {got} != {sent}")
        measured = res["extra"]["workspace_bytes_per_step_by_axis"]["tp"]
        if WORKSPACE and measured != payload:  # the group's own count of its inputs
            failures.append(f"{_label(cfg)} rank {r}: workspace saw {measured} != {payload}")
        if res["param_bytes"] != want_params:
            failures.append(f"{_label(cfg)} rank {r}: params {res['param_bytes']} != {want_params}")


def test_tp_byte_formula_counts_megatron_all_reduces() -> None:
    """The formula itself: 2 L blocks x 2 directions of b*s*d, sp the same volume."""
    cfg = _tp(2)
    payload, sent = _tp_bytes(cfg, 8)
    bsd = 6 * 4 * 8 * 8
    assert payload == (4 * 2 + 2) * bsd + 3 * 6 * 4 * 8
    assert sent == payload  # 2 (T-1)/T = 1 at T = 2
    _, sent_sp = _tp_bytes(_tp(2, sequence_parallel=True), 8)
    assert sent_sp == sent + (6 * 8 * 2 + 4 * 8 + 2 * 8) * 8


# -- the CLI -------------------------------------------------------------------------------
TINY = shlex.split("--vocab 8 --seq-len 4 --d-model 8 --heads 2 --layers 2 --batch-size 6")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "3d", "-n", "4", "--dp", "2", "--pp", "2", "--tp", "2"], "multiply"),
        (["--strategy", "3d", "-n", "8", "--dp", "2", "--tp", "2"], "multiply"),
        (["--strategy", "tp", "-n", "4", "--tp", "2"], "multiply"),
        (["--strategy", "tp", "-n", "2", "--heads", "3", "--d-model", "9"], "uneven heads"),
        (["--strategy", "tp", "-n", "2", "--vocab", "7"], "uneven vocab"),
        (["--strategy", "tp", "-n", "2", "--seq-len", "5", "--sequence-parallel"], "--seq-len"),
        (["--strategy", "3d", "-n", "2", "--pp", "2", "--layers", "1"], "--layers"),
        (["--strategy", "tp", "-n", "2", "--model", "mlp"], "transformer"),
        (["--strategy", "tp", "-n", "2", "--pp", "2"], "3d"),
        (["--strategy", "dp", "-n", "2", "--tp", "2"], "--tp needs"),
        (["--strategy", "dp", "-n", "2", "--sequence-parallel"], "needs --strategy"),
        (["--strategy", "ps", "-n", "2", "--model", "transformer"], "transformer runs with"),
        (["--strategy", "pipeline", "-n", "8", "--model", "transformer"], "7 layers cannot"),
        (["--strategy", "3d", "-n", "2", "--dp", "2", "--batch-size", "1"], "micro-batch"),
        (["--strategy", "3d", "-n", "2", "--tp", "2", "--zero", "1"], "--dp > 1"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], message: str, capsys) -> None:
    from ringcomm.cli import main

    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


def test_mesh_options_parse() -> None:
    from ringcomm.cli import build_parser
    from ringcomm.cli.train import config_from_args

    mesh = "--dp 2 --pp 2 --tp 2 --sequence-parallel --zero 1 --micro-batches 2"
    args = build_parser().parse_args(shlex.split(f"train --strategy 3d -n 8 {mesh}") + TINY)
    cfg = config_from_args(args)
    assert (cfg.model, cfg.dp, cfg.pp, cfg.tp, cfg.zero) == ("transformer", 2, 2, 2, 1)
    assert cfg.sequence_parallel and (cfg.vocab, cfg.seq_len, cfg.d_model) == (8, 4, 8)
    cfg = config_from_args(build_parser().parse_args(["train", "--strategy", "tp", "-n", "4"]))
    assert (cfg.tp, cfg.dp, cfg.pp, cfg.model) == (4, 1, 1, "transformer")
    cfg = config_from_args(build_parser().parse_args(["train", "--strategy", "dp", "-n", "2"]))
    assert cfg.model == "mlp"  # still the default elsewhere


@pytest.mark.timeout(200)
def test_3d_cli_end_to_end(tmp_path, no_child_processes: None) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(*argv: str) -> tuple[str, dict[str, Any]]:
        out = tmp_path / "r.json"
        common = [*shlex.split("--steps 3 --dtype float64"), *TINY, "--json", str(out)]
        proc = subprocess.run(
            [sys.executable, "-m", "ringcomm", "train", *argv, *common],
            capture_output=True,
            text=True,
            timeout=150,
            env=env,
            cwd=tmp_path,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, json.loads(out.read_text())

    _, single = run("--strategy", "single", "--model", "transformer")
    out, res = run("--strategy", "3d", "-n", "4", "--dp", "1", "--pp", "2", "--tp", "2")
    assert res["losses"] == pytest.approx(single["losses"], rel=1e-10)
    assert res["mesh_shape"] == {"dp": 1, "pp": 2, "tp": 2}
    assert (
        res["model"]["kind"] == "transformer"
        and res["model"]["params"] == single["model"]["params"]
    )
    assert "mesh dp 1 x pp 2 x tp 2" in out
    for r, row in enumerate(res["per_rank"]):
        assert row["mesh"] == {"dp": 0, "pp": r // 2, "tp": r % 2}
        by = row["sent_bytes_per_step_by_axis"]
        assert set(by) == {"dp", "pp", "tp"} and by["dp"] == 0 and by["pp"] > 0 and by["tp"] > 0
        # a stage holds its layers' tp slices: under half of single's parameters
        assert row["param_bytes"] < single["per_rank"][0]["param_bytes"] / 2


def sp_memory_job(pg: Any, cases: list[TrainConfig]) -> list[dict[str, Any]]:
    out = []
    for cfg in cases:
        sub = pg.new_group(range(pg.world_size))
        try:
            out.append(train_rank(sub, cfg)["extra"])
        finally:
            sub.close()
    return out


@pytest.mark.timeout(200)
def test_sequence_parallel_shards_the_norm_activations(no_child_processes: None) -> None:
    """Measured (tracemalloc, bytes held right after forward, above the step's start): with
    sequence parallel each rank keeps its LayerNorms' saved activations (normalised input
    ``b*s*d`` and ``1/std`` ``b*s``: two per block and the final norm) for ``s/T`` of the
    sequence instead of all of it; everything else it holds is the same."""
    T, b, S, D, L = 2, 16, 32, 32, 2
    base = {
        **BASE,
        "steps": 2,
        "export": False,
        "vocab": 16,
        "seq_len": S,
        "d_model": D,
        "heads": 2,
        "depth": L,
        "batch_size": b,
    }
    cases = [_tp(T, **{**base, "sequence_parallel": sp}) for sp in (False, True)]
    per_rank = rc.spawn(sp_memory_job, T, args=(cases,), timeout_s=150)
    norm_bytes = (2 * L + 1) * (b * S * D + b * S) * 8  # float64, whole sequence
    for plain, sp in per_rank:
        saved = plain["activation_held_bytes"] - sp["activation_held_bytes"]
        print(
            f"held {plain['activation_held_bytes']} -> {sp['activation_held_bytes']}: saved {saved}, formula {norm_bytes * (1 - 1 / T):.0f}"
        )
        # (tracemalloc also sees the progress thread's few-KiB message objects: 3%)
        assert saved == pytest.approx(norm_bytes * (1 - 1 / T), rel=0.03), (saved, norm_bytes)
        assert sp["activation_peak_bytes"] < plain["activation_peak_bytes"]


def wire_job(pg: Any, cases: list[TrainConfig]) -> list[float]:
    out = []
    for cfg in cases:
        sub = pg.new_group(range(pg.world_size))
        try:
            out.append(train_rank(sub, cfg)["sent_bytes_per_step"])
        finally:
            sub.close()
    return out


@pytest.mark.timeout(200)
def test_tp_bytes_on_the_wire_are_megatrons(no_child_processes: None, no_workspace: None) -> None:
    """Measured by the transport (off the shared workspace, every collective a message): at
    T = 2 the only traffic of ``tp`` is the tp axis, and every all_reduce algorithm sends its
    buffer once, so the socket counter equals the formula (plain and sequence parallel).
    (At T > 2 the tiny buffers here take latency-bound algorithms that send more than the
    ring's 2(T-1)/T; the per-axis counter stays the ring's.)"""
    cases = [_tp(2, export=False), _tp(2, export=False, sequence_parallel=True)]
    per_rank = rc.spawn(wire_job, 2, args=(cases,), timeout_s=150)
    for k, cfg in enumerate(cases):
        _, sent = _tp_bytes(cfg, 8)
        for rank in range(2):
            assert per_rank[rank][k] == pytest.approx(sent, rel=1e-12), (_label(cfg), rank)
