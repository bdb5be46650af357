"""Crash safety: however one rank's process ends, the job ends promptly with the right code,
its peers say why, and no process is left (tests/scripts/exit_scenario.py does the ranks).

The matrix: cause (uncaught exception, ``sys.exit(3)``, ``os._exit(3)``, SIGTERM to the
rank, KeyboardInterrupt, a normal end; never with ``close()``) x where the peers are (idle,
in a collective with the failing rank, in an async one, in a sub-group's) x failing rank
(0, which hosts the store where no launcher does, and the last) x launcher:

* ``direct``: plain processes with torchrun's variables (as mpirun or srun start them):
  rank 0 hosts the store; each process's exit code and time are checked;
* ``run``: ``ringcomm run -n 3`` (the launcher hosts the store);
* ``spawn``: ``rc.spawn`` (``fn`` raising is the same as a script's uncaught exception).

Timings checked: the failing rank exits within 2 s of going down (direct), a peer inside a
call with it raises within 1 s, and every launcher returns within 5 s. Set
``RINGCOMM_EXIT_MATRIX_JSON=FILE`` to append each scenario's times to FILE (JSON lines).
The ssh launcher's reduced set lives in test_launch_ssh.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import exit_scenario
import leakcheck
from conftest import free_port

import ringcomm as rc

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "scripts" / "exit_scenario.py"
WORLD = 3
RANK_EXIT_S = 2.0
PEER_NOTICE_S = 1.0
LAUNCHER_EXIT_S = 5.0

#: The failing rank's exit status by cause (a negative number: killed by that signal).
STATUS = {
    "exception": 1,
    "sys_exit": exit_scenario.EXIT_CODE,
    "os_exit": exit_scenario.EXIT_CODE,
    "sigterm": -signal.SIGTERM,
    "sighup": -signal.SIGHUP,
    "keyboard": -signal.SIGINT,
    "normal_end": 0,
}


def peer_text(cause: str, failing: int, launcher: str) -> str:
    """What a peer's error says about the failing rank."""
    if cause == "exception":
        return f"rank {failing} exited: RuntimeError: user bug on rank {failing}"
    if cause == "sys_exit":  # rc.spawn's ranks see the SystemExit itself
        if launcher == "spawn":
            return f"rank {failing} exited: SystemExit: {exit_scenario.EXIT_CODE}"
        return f"rank {failing} left the group"
    if cause == "os_exit":
        return "its connection dropped without a goodbye"
    if cause in ("sigterm", "sighup"):
        return f"rank {failing} exited: killed by SIG{cause[3:].upper()}"
    if cause == "keyboard":
        return f"rank {failing} exited: KeyboardInterrupt"
    return f"rank {failing} left the group"


def shell_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _env(tag: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGCOMM_", "MASTER_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    env.update(PYTHONPATH=str(REPO), **extra)
    env[leakcheck.TAG_VAR] = tag
    return env


def _read(report: Path, name: str) -> object | None:
    try:
        return json.loads((report / name).read_text())
    except FileNotFoundError:
        return None


def _record(**fields: object) -> None:
    path = os.environ.get("RINGCOMM_EXIT_MATRIX_JSON")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def _check_peers(
    report: Path,
    cause: str,
    where: str,
    failing: int,
    launcher: str,
    t_fail: float,
    may_be_stopped: bool,
    output: object = "",
) -> list[float]:
    """Each peer's report: the error naming the failing rank (within 1 s when it was
    inside a call), or a clean end after a plain departure. Under a launcher a peer may
    have been stopped before it noticed (``may_be_stopped``): the launcher said why.
    Returns the notice times."""
    notices = []
    for peer in range(WORLD):
        if peer == failing:
            continue
        got = _read(report, f"peer.{peer}")
        if where == "idle" and cause == "normal_end":
            assert got is not None and got["type"] == "ok", (peer, got)
            continue
        if got is None and may_be_stopped:
            continue  # the launcher stopped it first (at once, when the failing rank exited)
        assert got is not None, f"rank {peer} reported nothing; output: {output}"
        assert got["type"] == "PeerFailedError", (peer, got)
        if may_be_stopped and "exited: killed by SIGTERM" in got["message"]:
            # The launcher stopped another peer first (SIGTERM, its farewell arrived
            # before this rank noticed the failing one: after os._exit, 0.35 s).
            continue
        assert peer_text(cause, failing, launcher) in got["message"], (peer, got["message"])
        if where != "idle":
            notice = got["t"] - t_fail
            assert notice < PEER_NOTICE_S, (peer, notice)
            notices.append(notice)
    return notices


CAUSES = exit_scenario.CAUSES
WHERES = exit_scenario.WHERES
MATRIX = [(c, w, f) for f in (0, WORLD - 1) for c in CAUSES for w in WHERES]
IDS = [f"{c}-{w}-rank{f}" for c, w, f in MATRIX]
# SIGHUP takes the same path as SIGTERM (lifecycle.py): one case of it, plain processes.
DIRECT = [*MATRIX, ("sighup", "collective", WORLD - 1)]
DIRECT_IDS = [*IDS, f"sighup-collective-rank{WORLD - 1}"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("cause", "where", "failing"), DIRECT, ids=DIRECT_IDS)
def test_direct(cause: str, where: str, failing: int, tag: str, tmp_path: Path) -> None:
    """Plain processes, rank 0 hosting the store: every process ends with its code."""
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = _env(
            tag,
            RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LOCAL_RANK=str(rank),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), cause, where, str(failing), str(tmp_path)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 40
    try:
        while len(ended) < WORLD and time.monotonic() < deadline:
            for rank, p in enumerate(procs):
                if rank not in ended and p.poll() is not None:
                    ended[rank] = time.time()
            time.sleep(0.005)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    errs = {rank: p.stderr.read() for rank, p in enumerate(procs)}
    assert len(ended) == WORLD, f"ranks still running after 40 s: {errs}"
    t_fail = _read(tmp_path, f"fail.{failing}")
    assert isinstance(t_fail, float), errs
    assert procs[failing].returncode == STATUS[cause], errs[failing]
    rank_exit = ended[failing] - t_fail
    assert rank_exit < RANK_EXIT_S, rank_exit
    notices = _check_peers(tmp_path, cause, where, failing, "direct", t_fail, False, errs)
    for rank, p in enumerate(procs):
        if rank != failing:
            want = 0 if (cause == "normal_end" and where == "idle") else 1
            assert p.returncode == want, (rank, errs[rank])
    # the failing rank goes first: a launcher watching these reports its code
    if where != "idle":
        assert ended[failing] <= min(t for r, t in ended.items() if r != failing) + 0.1
    _record(
        launcher="direct",
        cause=cause,
        where=where,
        failing=failing,
        rank_exit_s=rank_exit,
        peer_notice_s=max(notices, default=None),
        job_s=max(ended.values()) - t_fail,
    )


def _run_status(cause: str, where: str) -> int:
    status = STATUS[cause]
    if status == 0:
        return 0 if where == "idle" else 1  # the peers in a call with it fail
    return shell_status(status)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("cause", "where", "failing"), MATRIX, ids=IDS)
def test_ringcomm_run(cause: str, where: str, failing: int, tag: str, tmp_path: Path) -> None:
    """``ringcomm run``: its status is the failing rank's, within 5 s."""
    t0 = time.time()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringcomm",
            "run",
            "-n",
            str(WORLD),
            str(SCRIPT),
            cause,
            where,
            str(failing),
            str(tmp_path),
        ],
        env=_env(tag),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    t_end = time.time()
    t_fail = _read(tmp_path, f"fail.{failing}")
    assert isinstance(t_fail, float), res.stderr
    assert res.returncode == _run_status(cause, where), res.stderr
    if STATUS[cause] != 0:
        assert f"ringcomm run: rank {failing} " in res.stderr, res.stderr
    job = t_end - t_fail
    assert job < LAUNCHER_EXIT_S + (exit_scenario.IDLE_S if cause == "normal_end" else 0), job
    notices = _check_peers(tmp_path, cause, where, failing, "run", t_fail, True, res.stderr)
    _record(
        launcher="run",
        cause=cause,
        where=where,
        failing=failing,
        peer_notice_s=max(notices, default=None),
        job_s=job,
        total_s=t_end - t0,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("cause", "where", "failing"), MATRIX, ids=IDS)
def test_spawn(
    cause: str, where: str, failing: int, tmp_path: Path, no_child_processes: None
) -> None:
    """``rc.spawn``: RankFailedError names the failing rank first, with its exit code."""
    args = (cause, where, failing, str(tmp_path))
    error: rc.RankFailedError | None = None
    try:
        rc.spawn(exit_scenario.scenario, WORLD, args=args, timeout_s=40)
    except rc.RankFailedError as exc:
        error = exc
    t_end = time.time()
    t_fail = _read(tmp_path, f"fail.{failing}")
    assert isinstance(t_fail, float), error
    if cause == "normal_end":
        if where == "idle":
            assert error is None, error
        else:  # its peers fail with it: they are the failures
            assert error is not None and failing not in error.failures, error
    else:
        assert error is not None and error.rank == failing, error
        want = STATUS[cause]
        if want > 0:
            assert error.exitcodes.get(failing) == want, error
    job = t_end - t_fail
    assert job < LAUNCHER_EXIT_S + (exit_scenario.IDLE_S if cause == "normal_end" else 0), job
    notices = _check_peers(tmp_path, cause, where, failing, "spawn", t_fail, True, error)
    _record(
        launcher="spawn",
        cause=cause,
        where=where,
        failing=failing,
        peer_notice_s=max(notices, default=None),
        job_s=job,
    )
