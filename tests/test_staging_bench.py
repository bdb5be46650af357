"""``ringcomm bench --device``: the staged path end to end, and the refusal without CuPy.

``--device host-staged,host`` runs the sweep on stand-in device arrays (the staging path a
CuPy array takes) and on NumPy arrays side by side, checked against NumPy; ``--device
cuda`` on a machine without CuPy (or without a GPU) is a usage error: exit 2, a clear line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringcomm.bench.spec import OPS
from ringcomm.cli import main
from ringcomm.device.xp import cupy_or_none

TINY = ["-b", "8", "-e", "256K", "-f", "8", "--iters", "3", "--warmup", "1", "--check", "-q"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", OPS)
def test_bench_host_staged_checks_clean(
    op: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_child_processes: None
) -> None:
    out_json = tmp_path / "rows.json"
    code = main(
        ["bench", op, "-n", "3", *TINY, "--device", "host-staged,host", "--json", str(out_json)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [json.loads(line) for line in out_json.read_text().splitlines()]
    impls = [r["impl"] for r in rows]
    assert impls[:2] == ["ringcomm-staged", "ringcomm"]  # side by side, per size
    assert impls.count("ringcomm-staged") == impls.count("ringcomm") >= 4
    assert all(r["errors"] == 0 for r in rows), rows
    assert "buffers on host-staged, host" in out
    assert "ringcomm-staged/ringcomm busbw ratio" in out


@pytest.mark.skipif(cupy_or_none() is not None, reason="CuPy is installed here")
def test_bench_device_cuda_without_cupy_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "all_reduce", "-n", "2", "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--device cuda needs CuPy" in err


def test_bench_device_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "all_reduce", "-n", "2", "--device", "tpu"]) == 2
    assert "choose from host, cuda, host-staged" in capsys.readouterr().err
    assert main(["bench", "all_reduce", "-n", "2", "--device", "host,host"]) == 2
    assert "twice" in capsys.readouterr().err
