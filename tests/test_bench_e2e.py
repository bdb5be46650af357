"""``ringcomm bench`` end to end: real ranks, tiny sweeps, results checked against NumPy.

Each case runs the CLI in-process (``ringcomm.cli.main``), which spawns the ranks, and
checks the JSON rows: one per size and implementation, ``errors == 0``. Sweeps are tiny
(8 B .. 64 KiB, 3 iterations) so the whole module stays within tens of seconds; the
multi-chunk paths are exercised by the collectives' own tests, not here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringcomm.bench.report import JSON_KEYS
from ringcomm.bench.spec import OPS
from ringcomm.cli import main
from ringcomm.group import ProcessGroup

TINY = ["-b", "8", "-e", "64K", "--iters", "3", "--warmup", "1", "--check", "-q"]


def _needs(op: str) -> pytest.MarkDecorator:
    missing = op != "sendrecv" and not hasattr(ProcessGroup, op)
    return pytest.mark.skipif(missing, reason=f"ProcessGroup.{op} does not exist yet")


def _rows(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["bench", *argv])
    return code, capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("op", [pytest.param(op, marks=_needs(op)) for op in OPS])
def test_op_checks_clean(
    op: str, n: int, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_child_processes: None
) -> None:
    out_json = tmp_path / "rows.json"
    code, out = _run([op, "-n", str(n), *TINY, "--json", str(out_json)], capsys)
    assert code == 0, out
    rows = _rows(out_json)
    assert len(rows) >= 10
    for row in rows:
        assert list(row)[: len(JSON_KEYS)] == list(JSON_KEYS)
        assert row["impl"] == "ringcomm" and row["op"] == op and row["world_size"] == n
        assert row["errors"] == 0, row
        assert row["time_us"] > 0 and row["bytes"] == row["count"] * 4
        if op in ("reduce_scatter", "all_gather", "all_to_all"):
            assert row["count"] % n == 0 and row["count"] >= n
    assert [r["bytes"] for r in rows] == sorted({r["bytes"] for r in rows})
    assert "# Out of bounds values : 0 OK" in out
    assert "# Avg bus bandwidth    : " in out


@pytest.mark.timeout(90)
@pytest.mark.needs_torch
@pytest.mark.parametrize(
    ("op", "n"),
    [
        pytest.param("all_reduce", 2, marks=_needs("all_reduce")),
        pytest.param("reduce_scatter", 3, marks=_needs("reduce_scatter")),
        pytest.param("all_gather", 2, marks=_needs("all_gather")),
        pytest.param("sendrecv", 3),
    ],
)
def test_compare_gloo(
    op: str, n: int, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_child_processes: None
) -> None:
    out_json = tmp_path / "rows.json"
    argv = [
        op,
        "-n",
        str(n),
        "-b",
        "8",
        "-e",
        "4K",
        "-f",
        "8",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--check",
        "-q",
        "--compare",
        "gloo",
        "--json",
        str(out_json),
    ]
    code, out = _run(argv, capsys)
    assert code == 0, out
    rows = _rows(out_json)
    impls = [r["impl"] for r in rows]
    assert impls == ["ringcomm", "gloo"] * (len(rows) // 2) and len(rows) == 8
    assert all(r["errors"] == 0 for r in rows), rows
    assert all(r["iters"] == 4 for r in rows)  # 2 iterations x 2 rounds (A B A B)
    assert "ringcomm/gloo" in out and "(gloo)" in out


@pytest.mark.timeout(60)
@pytest.mark.needs_plot
def test_plot_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_child_processes: None
) -> None:
    png = tmp_path / "bench.png"
    code, _ = _run(
        [
            "sendrecv",
            "-n",
            "2",
            "-b",
            "8",
            "-e",
            "1K",
            "-f",
            "16",
            "--iters",
            "2",
            "--warmup",
            "0",
            "-q",
            "--plot",
            str(png),
        ],
        capsys,
    )
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)
def test_console_entry_point_unchecked(tmp_path: Path) -> None:
    """Through ``python -m ringcomm``: exit 0, the table on stdout, ``errors`` null."""
    out_json = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringcomm",
            "bench",
            "sendrecv",
            "-n",
            "2",
            "-b",
            "64",
            "-e",
            "64",
            "--iters",
            "2",
            "--warmup",
            "0",
            "-q",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "#wrong" in proc.stdout and " N/A " in proc.stdout
    (row,) = _rows(out_json)
    assert row["errors"] is None and row["bytes"] == 64 and row["count"] == 16


@pytest.mark.timeout(90)
@pytest.mark.needs_mpi
@pytest.mark.parametrize("op", [pytest.param("all_gather", marks=_needs("all_gather")), "sendrecv"])
def test_compare_mpi(
    op: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_child_processes: None
) -> None:
    out_json = tmp_path / "rows.json"
    argv = [
        op,
        "-n",
        "2",
        "-b",
        "8",
        "-e",
        "4K",
        "-f",
        "8",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--check",
        "-q",
        "--compare",
        "mpi",
        "--json",
        str(out_json),
    ]
    code, out = _run(argv, capsys)
    assert code == 0, out
    rows = _rows(out_json)
    assert [r["impl"] for r in rows] == ["ringcomm", "mpi"] * 4
    assert all(r["errors"] == 0 and r["iters"] == 4 for r in rows), rows
    assert "ringcomm/mpi" in out
