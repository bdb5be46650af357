"""`ringcomm train`: options of DESIGN.md §2 parse, usage errors exit 2, and a run end to
end through `python -m ringcomm` writes the contract's JSON with single's losses."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ringcomm.cli import build_parser, main
from ringcomm.cli.train import config_from_args
from ringcomm.device.xp import cupy_or_none

REPO = Path(__file__).resolve().parents[1]
SMALL = shlex.split("--hidden 16 --layers 2 --in-features 8 --classes 3 --batch-size 12")


def _parse(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_every_contract_option_parses() -> None:
    argv = shlex.split(
        "--strategy ps -n 3 --steps 7 --device cpu --micro-batches 2 --json x.json"
        " --ps-servers 2 --consistency ssp --staleness 3 --ps-update worker --schedule 1f1b"
        " --bucket-mb 0.5 --dtype float64 --seed 9 --lr 0.1 --optimizer sgd --act relu"
    )
    args = _parse(*argv)
    assert (args.strategy, args.nproc, args.steps, args.micro_batches) == ("ps", 3, 7, 2)
    assert (args.ps_servers, args.consistency, args.staleness, args.ps_update) == (
        2,
        "ssp",
        3,
        "worker",
    )
    args = _parse("--strategy", "dp", "-n", "2", "--bucket-mb", "0.5", "--lr", "0.1", *SMALL)
    cfg = config_from_args(args)
    assert cfg.bucket_bytes == 512 * 1024 and cfg.lr == 0.1 and cfg.world_size == 2
    assert (
        config_from_args(
            _parse("--strategy", "dp", "-n", "2", "--bucket-bytes", "64K")
        ).bucket_bytes
        == 65536
    )
    assert config_from_args(_parse("--strategy", "zero1", "-n", "2")).bucket_bytes == 25 * 2**20


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "ps", "-n", "2", "--ps-servers", "2"], "--ps-servers"),
        (["--strategy", "ps", "-n", "3", "--batch-size", "1"], "without rows"),
        (["--strategy", "single", "-n", "2"], "-n 1"),
        (["--strategy", "dp", "-n", "0"], "-n must be"),
        (["--strategy", "pipeline", "-n", "2", "--micro-batches", "0"], "--micro-batches"),
        (["--strategy", "pipeline", "-n", "9", "--layers", "2"], "stages"),
        (["--strategy", "dp", "-n", "4", "--batch-size", "3"], "without rows"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys) -> None:
    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(cupy_or_none() is not None, reason="CuPy is installed here")
def test_cuda_without_cupy_exits_2(capsys) -> None:
    assert main(["train", "--strategy", "dp", "-n", "2", "--device", "cuda"]) == 2
    assert "CuPy" in capsys.readouterr().err
    # the transformer too (every strategy of both models runs on cuda): CuPy is what is missing
    assert main(["train", "--strategy", "tp", "-n", "2", "--device", "cuda"]) == 2
    assert "needs CuPy" in capsys.readouterr().err


def test_bucket_options_are_exclusive(capsys) -> None:
    with pytest.raises(SystemExit):
        _parse("--strategy", "dp", "--bucket-mb", "1", "--bucket-bytes", "1M")


def _run_cli(tmp_path: Path, *argv: str) -> tuple[str, dict]:
    out = tmp_path / f"{argv[1]}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "ringcomm", "train", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.timeout(200)
def test_zero3_end_to_end_matches_single(tmp_path: Path, no_child_processes: None) -> None:
    common = ["--steps", "5", "--dtype", "float64", *SMALL]
    _out1, single = _run_cli(tmp_path, "--strategy", "single", *common)
    out3, zero3 = _run_cli(tmp_path, "--strategy", "zero3", "-n", "3", *common)
    # header names strategy and model size; one progress line per step
    assert "strategy zero3" in out3 and "parameters" in out3
    assert len(re.findall(r"step \d/5 +loss \d", out3)) == 5
    # DESIGN.md §2 keys
    for res in (single, zero3):
        assert {"strategy", "world_size", "steps", "losses", "step_time_s", "per_rank"} <= set(res)
        for row in res["per_rank"]:
            assert {
                "rank",
                "param_bytes",
                "grad_bytes",
                "optim_bytes",
                "peak_bytes",
                "sent_bytes_per_step",
            } <= set(row)
            assert row["peak_bytes"] > 0
    assert zero3["world_size"] == 3 and [r["rank"] for r in zero3["per_rank"]] == [0, 1, 2]
    assert zero3["losses"] == pytest.approx(single["losses"], rel=1e-10)
    # one host: the collectives go through the shared workspace, not a socket
    assert all(r["workspace_bytes_per_step"] > 0 for r in zero3["per_rank"])
    assert single["per_rank"][0]["sent_bytes_per_step"] == 0
    assert zero3["per_rank"][0]["param_bytes"] < single["per_rank"][0]["param_bytes"]


@pytest.mark.timeout(200)
def test_pipeline_cli_reports_bubble(tmp_path: Path, no_child_processes: None) -> None:
    out, res = _run_cli(
        tmp_path,
        *shlex.split("--strategy pipeline -n 2 --steps 3 --micro-batches 3 --schedule 1f1b"),
        *SMALL,
    )
    assert res["schedule"] == "1f1b" and res["micro_batches"] == 3
    assert 0.0 <= res["bubble_fraction"] < 1.0
    assert res["bubble_fraction_theory"] == pytest.approx(1 / 4)
    assert len(res["losses"]) == 3 and "bubble" in out
    place = res["pipeline_placement"]
    assert place["stages"] == 2 and place["unit"] == "CPU core" and place["units"] >= 1
    assert "by the formula (p-1)/(m+p-1) = 1/4" in out


def _pipeline_result(device_ids: list[int | None], device: str, m: int = 4) -> Any:
    from ringcomm.engine.strategy import TrainConfig
    from ringcomm.engine.train import stage_placement

    cfg = TrainConfig(
        strategy="pipeline", world_size=len(device_ids), device=device, micro_batches=m
    )
    per_rank = [{"device_id": d} for d in device_ids]
    p = len(device_ids)
    return {
        "schedule": "gpipe",
        "micro_batches": m,
        "bubble_fraction": 0.80,
        "bubble_fraction_theory": (p - 1) / (m + p - 1),
        "pipeline_placement": stage_placement(cfg, per_rank),
    }


def test_bubble_on_a_shared_gpu_says_why_it_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 stages on one GPU without MPS (the H200 run: 0.80 measured, 0.27 by the formula):
    both figures, and the floor the sharing alone implies, 1 - 1/4."""
    from ringcomm.engine.train import bubble_lines

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # no control pipe there
    res = _pipeline_result([0, 0, 0, 0], "cuda", m=8)
    assert res["pipeline_placement"] == {
        "stages": 4,
        "units": 1,
        "unit": "GPU",
        "mps": False,
        "shared_floor": 0.75,
    }
    text = "\n".join(bubble_lines(res))
    assert "bubble 0.800 measured, 0.273 by the formula (p-1)/(m+p-1) = 3/11" in text
    assert "4 stages share 1 GPU" in text and "without MPS" in text
    assert "at least 1 - 1/4 = 0.750" in text and "not a schedule bug" in text
    # two GPUs for four stages: at most two compute at once
    assert _pipeline_result([0, 1, 0, 1], "cuda")["pipeline_placement"]["shared_floor"] == 0.5
    # a GPU per stage: no floor, no explanation needed
    alone = _pipeline_result([0, 1, 2, 3], "cuda")
    assert alone["pipeline_placement"]["shared_floor"] == 0.0
    assert len(bubble_lines(alone)) == 1
    # MPS active: the stages' kernels may overlap; no floor
    (tmp_path / "control").touch()
    shared = _pipeline_result([0, 0, 0, 0], "cuda")
    assert shared["pipeline_placement"]["mps"] and shared["pipeline_placement"]["shared_floor"] == 0
    assert "MPS is active" in "\n".join(bubble_lines(shared))
