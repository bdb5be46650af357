"""``ringcomm trace DIR``: the first line names the straggler (DESIGN.md §8 Trace).

Three ways a straggler shows in the flight records, each checked on files built here and on
a real job (``tests/scripts/straggler.py``: rank 1 sleeps before op #6, the others time
out waiting for it):

* it arrived after the others gave up, and wrote a file (``RINGCOMM_TRACE=1``): same op,
  entered late;
* it left no file (started by hand; it finished without a reason to write): the world size
  the others' files record says it is missing, their errors name it;
* under ``ringcomm run``, which asks every rank for its record (SIGUSR1) before it stops
  them: its file shows it at the previous op.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launcher_results import clean_env

from ringcomm.core import flight

STRAGGLER = Path(__file__).resolve().parent / "scripts" / "straggler.py"
SLEEP_S, TIMEOUT_S = "4", "1.5"


def _entry(
    seq: int, state: str = "done", start: float = 100.0, end: float | None = None
) -> dict[str, Any]:
    return {
        "group": 0,
        "seq": seq,
        "op": "all_reduce",
        "dtype": "float64",
        "shape": [10],
        "bytes": 80,
        "algo": "shm",
        "peers": [0, 1, 2],
        "start_s": start,
        "end_s": end if end is not None else (None if state == "running" else start + 0.1),
        "state": state,
    }


def _file(rank: int, entries: list[dict[str, Any]], dumped: float = 120.0) -> dict[str, Any]:
    return {"rank": rank, "reason": "test", "dumped_s": dumped, "world_size": 3, "entries": entries}


WAITED = (
    "failed: CommTimeoutError: rank {r}: all_reduce(float64[10]) timed out after 3 s: "
    "waiting for rank 1 at sync 1 of round 1/1; rank 1's last call here: "
    "all_reduce(float64[10], op=sum) #5"
)


def test_late_arrival_with_a_file() -> None:
    files = [_file(r, [_entry(5), _entry(6, WAITED.format(r=r), 100.0, 103.0)]) for r in (0, 2)]
    files.insert(1, _file(1, [_entry(5), _entry(6, "done", 108.0)]))
    first = flight.desync_report(files).splitlines()[0]
    assert first == (
        "rank 1 is behind: ranks 0, 2 waited 3.0 s for it in op #6 "
        "all_reduce(float64[10]); rank 1 entered op #6 8.0 s late"
    )


def test_a_straggler_without_a_file_is_found_from_the_recorded_world_size() -> None:
    files = [_file(r, [_entry(5), _entry(6, WAITED.format(r=r), 100.0, 103.0)]) for r in (0, 2)]
    first = flight.desync_report(files).splitlines()[0]
    assert first.startswith(
        "rank 1 is behind (no trace file from it): ranks 0, 2 waited 3.0 s "
        "for it in op #6 all_reduce(float64[10]); its last call there: "
        "all_reduce(float64[10], op=sum) #5"
    )


def test_a_rank_at_an_older_op() -> None:
    files = [_file(r, [_entry(5), _entry(6, WAITED.format(r=r), 100.0, 103.0)]) for r in (0, 2)]
    files.insert(1, _file(1, [_entry(5, start=99.0)]))
    first = flight.desync_report(files).splitlines()[0]
    assert first == (
        "rank 1 is behind: ranks 0, 2 waited 3.0 s for it in op #6 "
        "all_reduce(float64[10]); rank 1 is at op #5 all_reduce(float64[10]) "
        "(finished; it has not entered the next collective)"
    )


def test_nothing_wrong_says_so() -> None:
    files = [_file(r, [_entry(5), _entry(6)]) for r in range(3)]
    assert flight.desync_report(files).splitlines()[0].startswith("no rank is behind")


# -- real jobs --------------------------------------------------------------------------------
def _straggle_by_hand(folder: Path, *, silent: int | None = None, **extra: str) -> None:
    """Rank 1 straggles; rank ``silent`` (if any) writes no flight record (as one hung or
    SIGKILLed would not)."""
    port = _free_port()
    procs = []
    for r in range(3):
        env = {
            "RINGCOMM_RANK": str(r),
            "RINGCOMM_WORLD_SIZE": "3",
            "RINGCOMM_MASTER_PORT": str(port),
            **extra,
        }
        if r != silent:
            env["RINGCOMM_TRACE_DIR"] = str(folder)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(STRAGGLER), SLEEP_S, TIMEOUT_S],
                env=clean_env(env),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        for p in procs:
            p.communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _report_first_line(folder: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "ringcomm", "trace", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()[0]


@pytest.mark.timeout(90)
def test_real_straggler_that_arrives_late_and_writes_a_file(tmp_path: Path) -> None:
    _straggle_by_hand(tmp_path, RINGCOMM_TRACE="1")
    first = _report_first_line(tmp_path)
    assert first.startswith("rank 1 is behind: ranks 0, 2 waited "), first
    assert "for it in op #6 all_reduce(float64[10]); rank 1 entered op #6 " in first, first


@pytest.mark.timeout(90)
def test_real_straggler_without_a_file(tmp_path: Path) -> None:
    _straggle_by_hand(tmp_path, silent=1)
    assert sorted(os.listdir(tmp_path)) == ["rank0.json", "rank2.json"]
    first = _report_first_line(tmp_path)
    assert first.startswith("rank 1 is behind (no trace file from it): ranks 0, 2 waited "), first
    assert "for it in op #6 all_reduce(float64[10])" in first, first


@pytest.mark.timeout(90)
def test_ringcomm_run_asks_for_every_record_before_it_stops_the_ranks(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ringcomm", "run", "-n", "3", str(STRAGGLER), SLEEP_S, TIMEOUT_S],
        env=clean_env({"RINGCOMM_TRACE_DIR": str(tmp_path)}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    files = flight.load_dir(tmp_path)
    assert [f["rank"] for f in files] == [0, 1, 2], proc.stderr
    assert files[1]["reason"] == "SIGUSR1"
    first = _report_first_line(tmp_path)
    assert first.startswith("rank 1 is behind: ranks 0, 2 waited "), first
    assert first.endswith(
        "rank 1 is at op #5 all_reduce(float64[10]) (finished; it has not "
        "entered the next collective)"
    ), first


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
