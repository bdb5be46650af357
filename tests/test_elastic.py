"""Restart and rejoin: ``ringcomm run --max-restarts K`` starts a failed rank's slot again;
the survivors shrink, then admit it with ``pg.grow()`` at a step boundary
(tests/scripts/elastic_loop.py checks every step's all_reduce against that step's members).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "scripts" / "elastic_loop.py"


def _run(tmp_path: Path, world: int, victim: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ringcomm",
            "run",
            "-n",
            str(world),
            *extra,
            str(SCRIPT),
            str(victim),
            "3",
            "20",
            str(tmp_path),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "victim"), [(4, 0), (4, 2), (3, 1)])
def test_a_killed_rank_is_restarted_and_rejoins(tmp_path: Path, world: int, victim: int) -> None:
    out = _run(tmp_path, world, victim, "--max-restarts", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"rank {victim} was killed by SIGKILL; starting it again (restart 1 of 1)" in out.stderr
    survivors = [s for s in range(world) if s != victim]
    others = [s for s in range(world) if s != victim]
    for s in survivors:
        rep = json.loads((tmp_path / f"slot.{s}.0").read_text())
        kinds = [c[1] for c in rep["changes"]]
        assert kinds == ["shrank", "grew"], rep
        assert rep["changes"][0] == [3, "shrank", others]
        assert rep["changes"][1][2] == list(range(world))
        assert rep["final"] == list(range(world)) and rep["last_step"] >= 20
    back = json.loads((tmp_path / f"slot.{victim}.1").read_text())
    assert back["changes"][0][1] == "rejoined" and back["checked"] >= 5, back
    assert not (tmp_path / f"slot.{victim}.0").exists()  # the first one died at step 3


@pytest.mark.timeout(120)
def test_without_restarts_the_first_failure_ends_the_job(tmp_path: Path) -> None:
    out = _run(tmp_path, 3, 1)
    assert out.returncode == 128 + 9, out.stderr[-2000:]
    assert "stopping the other ranks" in out.stderr


def test_max_restarts_is_refused_below_zero_and_across_hosts_without_an_address(
    tmp_path: Path,
) -> None:
    for extra in (["--max-restarts", "-1"], ["--max-restarts", "1", "-H", "localhost:2"]):
        out = subprocess.run(
            [sys.executable, "-m", "ringcomm", "run", *extra, str(SCRIPT)],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and "--max-restarts" in out.stderr, out.stderr
