"""`ringcomm train --strategy ps`: data-parallel training over the parameter server.

One spawned job of 4 ranks runs every case on a sub-group of the ranks it needs (2, 3 or 4:
1-3 servers, 1-3 workers), so the whole matrix costs one launch; a second test drives the
CLI end to end. What is shown:

* bsp reproduces ``single`` and ``dp`` in both update modes, with 1 and 2 servers (2 servers
  with ``ps_split_min_bytes`` lowered so that the Linear layers are split over both).
  Tolerances as in test_engine_oracle.py: float64 losses 1e-10 relative and parameters 1e-10
  absolute (not bit-identical: each worker's products cover its rows only, and the servers
  sum the partial gradients; seen ~1e-16), float32 1e-5.
* asp and ssp (K=1) train: the mean of the last 5 of 40 losses falls below 0.8 (the first
  loss is 1.77, ln 5 = 1.61; single reaches 0.46 there), and ssp's largest recorded pull gap
  is at most K.
* The JSON: servers hold the parameters and (server update) the optimizer state, workers a
  replica and the gradients; bytes sent are counted; the ``ps`` object records the gaps.
* Checkpoints: a run of 3 steps with ``--checkpoint-dir``, then a second run of 2 steps on
  the same directory, resumes at step 3 and continues ``single``'s losses.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm.cli import main
from ringcomm.cli.train import run_training
from ringcomm.engine.strategy import TrainConfig
from ringcomm.engine.train import summarize, train_rank

REPO = Path(__file__).resolve().parents[1]
BASE = {
    "strategy": "ps",
    "steps": 5,
    "dtype": "float64",
    "in_features": 16,
    "hidden": 24,
    "depth": 2,
    "classes": 5,
    "batch_size": 26,  # uneven over 3 workers
    "export": True,
    "timeout_s": 60.0,
}
TOL = {"float64": 1e-10, "float32": 1e-5}
SPLIT = 1024  # bytes: the float64 Linear layers (>= 3 KiB) split, LayerNorms (384 B) do not
TRAIN = {"steps": 40, "lr": 0.01, "export": False}
THRESHOLD = 0.8


def _ps(n: int, servers: int, **kw: Any) -> TrainConfig:
    return TrainConfig(**{**BASE, "world_size": n, "ps_servers": servers, **kw})


def _oracle_cases() -> list[TrainConfig]:
    cases = [_ps(2, 1)]  # one worker: the whole batch
    for update in ("server", "worker"):
        cases += [
            _ps(3, 1, ps_update=update),
            _ps(3, 1, ps_update=update, optimizer="sgd", lr=0.05),
            _ps(4, 2, ps_update=update, ps_split_min_bytes=SPLIT),
            _ps(4, 1, ps_update=update),
        ]
    cases.append(_ps(4, 2, dtype="float32", ps_split_min_bytes=SPLIT))
    return cases


def _train_cases() -> list[TrainConfig]:
    return [
        _ps(4, 2, consistency="asp", ps_split_min_bytes=SPLIT, **TRAIN),
        _ps(3, 1, consistency="asp", ps_update="worker", **TRAIN),
        _ps(4, 1, consistency="ssp", staleness=1, ps_update="worker", **TRAIN),
        _ps(4, 2, consistency="ssp", staleness=1, ps_split_min_bytes=SPLIT, **TRAIN),
    ]


def _dp_cases() -> list[TrainConfig]:
    """dp over as many ranks as the ps cases have workers (the same row split)."""
    return [
        TrainConfig(**{**BASE, "strategy": "dp", "world_size": w, "bucket_bytes": 2000})
        for w in (2, 3)
    ]


def ps_job(pg: Any, cases: list[TrainConfig]) -> list[dict[str, Any] | None]:
    """Run each case on the sub-group of its first ``world_size`` ranks; others get None."""
    out: list[dict[str, Any] | None] = []
    for cfg in cases:
        sub = pg.new_group(list(range(cfg.world_size)))
        if sub is None:
            out.append(None)
            continue
        try:
            out.append(train_rank(sub, cfg))
        finally:
            sub.close()
    return out


def _single(cfg: TrainConfig, cache: dict[tuple, dict[str, Any]]) -> dict[str, Any]:
    key = (cfg.dtype, cfg.optimizer, cfg.lr, cfg.steps)
    if key not in cache:
        ref = TrainConfig(
            **{
                **BASE,
                "strategy": "single",
                "world_size": 1,
                "dtype": cfg.dtype,
                "optimizer": cfg.optimizer,
                "lr": cfg.lr,
                "steps": cfg.steps,
            }
        )
        cache[key] = run_training(ref)[0]
    return cache[key]


def _label(cfg: TrainConfig) -> str:
    return (
        f"ps-n{cfg.world_size}-S{cfg.ps_servers}-{cfg.consistency}-{cfg.ps_update}-"
        f"{cfg.optimizer}-{cfg.dtype}"
    )


def _compare(
    cfg: TrainConfig, results: list[dict[str, Any]], ref: dict[str, Any], failures: list[str]
) -> float:
    tol = TOL[cfg.dtype]
    res = summarize(cfg, results)
    losses = np.array(res["losses"])
    if len(losses) != cfg.steps:
        failures.append(f"{_label(cfg)}: {len(losses)} losses")
        return np.inf
    rel = float(np.max(np.abs(losses - ref["losses"]) / np.abs(ref["losses"])))
    if not rel <= tol:
        failures.append(f"{_label(cfg)}: loss rel err {rel:.3g} > {tol}")
    err = 0.0
    for r in results:
        if r["extra"]["ps"]["role"] != "worker":
            assert r["params"] == {}
            continue
        assert set(r["params"]) == set(ref["params"])
        err = max(
            err, *(float(np.max(np.abs(r["params"][k] - ref["params"][k]))) for k in r["params"])
        )
    if not err <= tol:
        failures.append(f"{_label(cfg)}: param err {err:.3g} > {tol}")
    return max(rel, err)


def _check_json(cfg: TrainConfig, results: list[dict[str, Any]]) -> None:
    """Who holds what, bytes sent, the ps record."""
    res = summarize(cfg, results)
    json.dumps(res)  # serialisable as written by --json
    numel = res["model"]["params"]
    model_bytes = numel * np.dtype(cfg.dtype).itemsize
    s, w = cfg.ps_servers, cfg.world_size - cfg.ps_servers
    rows = res["per_rank"]
    servers, workers = rows[:s], rows[s:]
    assert [r["ps"]["role"] for r in rows] == ["server"] * s + ["worker"] * w
    assert sum(r["param_bytes"] for r in servers) == model_bytes
    assert all(r["grad_bytes"] == 0 for r in servers)  # nothing pending after a bsp step
    state_bytes = (2 if cfg.optimizer == "adam" else 1) * model_bytes  # Adam m, v; SGD momentum
    if cfg.ps_update == "server":
        assert sum(r["optim_bytes"] for r in servers) == state_bytes
        assert all(r["optim_bytes"] == 0 for r in workers)
        assert all(r["grad_bytes"] == model_bytes for r in workers)
    else:
        assert all(r["optim_bytes"] == 0 for r in servers)
        assert all(r["optim_bytes"] == state_bytes for r in workers)
        assert all(r["grad_bytes"] == 2 * model_bytes for r in workers)  # grads + the sum
    assert all(r["param_bytes"] == model_bytes for r in workers)  # a replica for forward
    # every step a worker pushes its gradient and every server sends back its pieces
    assert all(r["sent_bytes_per_step"] >= model_bytes for r in workers)
    assert sum(r["sent_bytes_per_step"] for r in servers) >= w * model_bytes
    ps = res["ps"]
    assert (ps["servers"], ps["workers"], ps["consistency"]) == (s, w, cfg.consistency)
    assert ps["max_pull_gap"] == 0 and set(ps["pulls_by_gap"]) == {"0"}
    keys = {sh["key"] for r in servers for sh in r["ps"]["shards"]}
    assert len(keys) == 2 * cfg.depth + 1  # every Linear and LayerNorm, no activation
    assert ps["pulls"] == cfg.steps * w * sum(len(r["ps"]["shards"]) for r in servers)
    if s > 1 and cfg.ps_split_min_bytes == SPLIT:  # a split layer: pieces on both servers
        split = [
            k for k in keys if all(any(sh["key"] == k for sh in r["ps"]["shards"]) for r in servers)
        ]
        assert split, "no layer was split over the servers"
        assert all(r["param_bytes"] > 0 for r in servers)
    for r in workers:
        assert r["ps"]["max_pull_gap"] == 0 and r["ps"]["pulls"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ps_training_matches_single_and_trains(tmp_path: Path, no_child_processes: None) -> None:
    oracle, training, dp = _oracle_cases(), _train_cases(), _dp_cases()
    ckpt = str(tmp_path / "ckpt")
    resume = [  # 3 steps with checkpoints, then 2 more steps resumed from them
        _ps(3, 1, steps=3, ps_checkpoint_dir=ckpt, ps_checkpoint_interval=1),
        _ps(3, 1, steps=2, ps_checkpoint_dir=ckpt, ps_checkpoint_interval=1),
    ]
    cases = oracle + training + dp + resume
    per_rank = rc.spawn(ps_job, 4, args=(cases,), timeout_s=260)
    results = [[per_rank[r][k] for r in range(cfg.world_size)] for k, cfg in enumerate(cases)]
    cache: dict[tuple, dict[str, Any]] = {}
    failures: list[str] = []
    worst: dict[str, float] = {}

    # bsp == single (and the final parameters), both update modes, 1 and 2 servers
    for cfg, res in zip(oracle, results):
        err = _compare(cfg, res, _single(cfg, cache), failures)
        worst[cfg.dtype] = max(worst.get(cfg.dtype, 0.0), err)
        _check_json(cfg, res)
    print(f"bsp vs single: worst relative loss / absolute parameter error: {worst}")
    # bsp == dp over the same number of workers (the same rows per worker)
    dp_res = results[len(oracle) + len(training) :][: len(dp)]
    compared = set()
    for dcfg, dres in zip(dp, dp_res):
        dlosses = np.array(summarize(dcfg, dres)["losses"])
        for cfg, res in zip(oracle, results):
            if (
                cfg.world_size - cfg.ps_servers == dcfg.world_size
                and cfg.dtype == "float64"
                and cfg.optimizer == "adam"
            ):
                losses = np.array(summarize(cfg, res)["losses"])
                compared.add((cfg.ps_servers, dcfg.world_size, cfg.ps_update))
                rel = float(np.max(np.abs(losses - dlosses) / np.abs(dlosses)))
                if not rel <= 1e-10:
                    failures.append(f"{_label(cfg)} vs dp -n {dcfg.world_size}: {rel:.3g}")
    # both update modes; S=1 against dp -n 2 and -n 3, S=2 against dp -n 2
    assert compared == {
        (s, w, u) for s, w in ((1, 2), (1, 3), (2, 2)) for u in ("server", "worker")
    }
    # asp and ssp still train; ssp's bound holds on every pull
    for cfg, res in zip(training, results[len(oracle) :]):
        out = summarize(cfg, res)
        assert len(out["losses"]) == cfg.steps
        first, last5 = out["losses"][0], float(np.mean(out["losses"][-5:]))
        print(
            f"{_label(cfg)}: loss {first:.3f} -> {last5:.3f} (last 5), max gap {out['ps']['max_pull_gap']}"
        )
        if not last5 < THRESHOLD:
            failures.append(f"{_label(cfg)}: mean of the last 5 losses {last5:.3f} >= {THRESHOLD}")
        if cfg.consistency == "ssp":
            assert out["ps"]["max_pull_gap"] <= cfg.staleness
            assert all(r["extra"]["ps"]["max_pull_gap"] <= cfg.staleness for r in res)
        assert out["ps"]["pulls"] > 0
    # resume from the checkpoint: steps 3 and 4 of single
    first, second = results[-2:]
    ref = _single(_ps(3, 1), cache)["losses"]
    a = summarize(resume[0], first)
    b = summarize(resume[1], second)
    assert a["ps"]["checkpoints_written"] >= 3
    assert [r["ps"].get("start_step") for r in b["per_rank"][1:]] == [3, 3]
    assert b["per_rank"][0]["ps"]["restored_progress"] == 3
    np.testing.assert_allclose(a["losses"], ref[:3], rtol=1e-10)
    np.testing.assert_allclose(b["losses"], ref[3:5], rtol=1e-10)
    assert os.path.exists(os.path.join(ckpt, "ps-server-0.npz"))
    assert not failures, "\n".join(failures)


def test_ps_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--strategy", "ps", "-n", "3", "--ps-servers", "3"]) == 2
    assert "--ps-servers must be in [1, 2]" in capsys.readouterr().err
    assert main(["train", "--strategy", "ps", "-n", "1"]) == 2
    assert "--strategy ps needs -n >= 2" in capsys.readouterr().err
    assert main(["train", "--strategy", "ps", "-n", "3", "--staleness", "-1"]) == 2
    assert "--staleness" in capsys.readouterr().err
    assert main(["train", "--strategy", "ps", "-n", "3", "--checkpoint-interval", "2"]) == 2
    assert "--checkpoint-dir" in capsys.readouterr().err
    assert main(["train", "--strategy", "ps", "-n", "3", "--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err


@pytest.mark.timeout(200)
def test_ps_cli_end_to_end(tmp_path: Path, no_child_processes: None) -> None:
    small = shlex.split(
        "--hidden 16 --layers 2 --in-features 8 --classes 3 --batch-size 12 --steps 5"
        " --dtype float64"
    )
    out = tmp_path / "ps.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [
            sys.executable,
            *shlex.split("-m ringcomm train --strategy ps -n 3 --ps-servers 1"),
            *small,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert "strategy ps" in proc.stdout and "[rank 0] step 5/5" in proc.stdout
    assert "ps: 1 server(s)" in proc.stdout and "bsp" in proc.stdout
    assert {"strategy", "world_size", "steps", "losses", "step_time_s", "per_rank"} <= set(res)
    assert res["strategy"] == "ps" and res["world_size"] == 3
    for row in res["per_rank"]:
        assert {
            "rank",
            "param_bytes",
            "grad_bytes",
            "optim_bytes",
            "peak_bytes",
            "sent_bytes_per_step",
            "ps",
        } <= set(row)
        assert row["peak_bytes"] > 0 and row["sent_bytes_per_step"] > 0
    assert res["ps"]["consistency"] == "bsp" and res["ps"]["max_pull_gap"] == 0
    single = TrainConfig(
        strategy="single",
        steps=5,
        dtype="float64",
        hidden=16,
        depth=2,
        in_features=8,
        classes=3,
        batch_size=12,
    )
    ref = run_training(single)[0]["losses"]
    assert res["losses"] == pytest.approx(ref, rel=1e-10)
