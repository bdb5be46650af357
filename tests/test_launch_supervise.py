"""ringcomm.launch.supervise: the wording of exits and the supervise loop, on plain processes.

The launchers' end-to-end behaviour is tested in test_launch_local.py and test_launch_ssh.py;
here the shared pieces run on their own, in well under a second.
"""

from __future__ import annotations

import signal
import sys
import time

import pytest

from ringcomm.launch import supervise as sv


@pytest.mark.parametrize(
    ("code", "plain", "raw"),
    [
        (0, "exited with code 0", "exited with exit code 0"),
        (7, "exited with code 7", "exited with exit code 7"),
        (-15, "was killed by SIGTERM", "was killed by SIGTERM (exit code -15)"),
        (-9, "was killed by SIGKILL", "was killed by SIGKILL (exit code -9)"),
        (-99, "was killed by signal 99", "was killed by signal 99 (exit code -99)"),
        (None, "did not exit", "did not exit"),
    ],
)
def test_describe_exit(code: int | None, plain: str, raw: str) -> None:
    assert sv.describe_exit(code) == plain
    assert sv.describe_exit(code, raw_code=True) == raw


def test_exit_status_is_shell_style() -> None:
    assert [sv.exit_status(c) for c in (0, 3, -2, -9, -15)] == [0, 3, 130, 137, 143]


def _start(rank: int, code: str) -> sv.RankProcess:
    popen = sv.start_in_session([sys.executable, "-c", code], sv.pdeathsig_preexec())
    return sv.RankProcess(rank, popen, sv.copy_output(popen, rank))


@pytest.mark.timeout(30)
def test_first_failure_stops_the_rest(capfd: pytest.CaptureFixture[str]) -> None:
    ranks = [
        _start(0, "import time; print('up', flush=True); time.sleep(60)"),
        _start(1, "import sys, time; time.sleep(0.3); sys.exit(7)"),
    ]
    try:
        with sv.LauncherSignals() as signals:
            t0 = time.monotonic()
            status = sv.supervise(ranks, signals, grace_s=5.0)
            elapsed = time.monotonic() - t0
    finally:
        sv.reap(ranks)
    assert status == 7
    assert elapsed < 5.0  # rank 0 went at the SIGTERM, not at the SIGKILL after the grace
    assert ranks[0].popen.returncode == -signal.SIGTERM
    assert ranks[0].describe_exit(-signal.SIGTERM) == "rank 0 was killed by SIGTERM"
    out, err = capfd.readouterr()
    assert "[0] up\n" in out
    assert "ringcomm run: rank 1 exited with code 7; stopping the other ranks\n" in err


@pytest.mark.timeout(30)
def test_all_succeed() -> None:
    ranks = [_start(r, "pass") for r in range(3)]
    try:
        with sv.LauncherSignals() as signals:
            assert sv.supervise(ranks, signals, grace_s=1.0) == 0
    finally:
        sv.reap(ranks)
    assert [r.popen.returncode for r in ranks] == [0, 0, 0]
