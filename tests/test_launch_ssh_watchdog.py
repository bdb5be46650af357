"""The remote rank watchdog (ringcomm.launch.watchdog), run here as a plain subprocess.

It is what makes fail-fast real over ssh: stdin EOF (or SIGTERM/SIGHUP) must stop the rank's
whole process group, with SIGKILL after the grace period, and the exit status must be the
rank's. Every test tags its processes and checks none is left behind.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import leakcheck

from ringcomm.launch import watchdog

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"
WATCHDOG_FILE = REPO / "ringcomm" / "launch" / "watchdog.py"


def start(tag: str, *command: str, options: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env[leakcheck.TAG_VAR] = tag
    return subprocess.Popen(
        [sys.executable, "-m", "ringcomm.launch.watchdog", *options, "--", *command],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def read_ready(proc: subprocess.Popen[bytes]) -> tuple[int, int]:
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("ready "), line
    _, pid, grandchild = line.split()
    return int(pid), int(grandchild)


def finish(
    proc: subprocess.Popen[bytes], timeout_s: float = 30, *, keep_stdin: bool = False
) -> tuple[int, str, str]:
    """Exit status and output. ``keep_stdin``: hold stdin open until the watchdog exits by
    itself (closing it would be the stop request)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        if not keep_stdin and not proc.stdin.closed:
            proc.stdin.close()
        proc.wait(timeout=timeout_s)  # outputs here are small: the pipes never fill
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, out.decode(), err.decode()


def test_imports_only_the_standard_library() -> None:
    tree = ast.parse(WATCHDOG_FILE.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add((node.module or "").split(".")[0])
    assert modules and modules <= set(sys.stdlib_module_names), modules - set(
        sys.stdlib_module_names
    )


@pytest.mark.timeout(60)
def test_runs_as_a_bare_file_in_isolated_mode(tag: str) -> None:
    # -I: no PYTHONPATH, no user site: nothing but the standard library is importable.
    proc = subprocess.Popen(
        [sys.executable, "-I", str(WATCHDOG_FILE), "--", sys.executable, "-c", "exit(3)"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, **{leakcheck.TAG_VAR: tag}),
    )
    status, _, err = finish(proc, keep_stdin=True)
    assert status == 3, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [0, 7])
def test_exit_code_is_the_ranks(tag: str, code: int) -> None:
    proc = start(tag, sys.executable, "-c", f"print('hi'); raise SystemExit({code})")
    status, out, _ = finish(proc, keep_stdin=True)
    assert status == code
    assert out == "hi\n"


@pytest.mark.timeout(60)
def test_death_by_signal_is_128_plus_n(tag: str) -> None:
    proc = start(tag, sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)")
    assert finish(proc, keep_stdin=True)[0] == 128 + 9


@pytest.mark.timeout(60)
def test_env_line_reaches_the_rank_and_no_command_line(tag: str) -> None:
    secret = "s3cr3t " + uuid.uuid4().hex + " $HOME; 'q'"
    script = (
        "import os, json, time; "
        "print(json.dumps([os.environ['RC_SECRET'], os.environ['RC_OTHER']]), flush=True); "
        "time.sleep(60)"
    )
    proc = start(tag, sys.executable, "-c", script, options=("--env-stdin",))
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"RC_SECRET": secret, "RC_OTHER": "x"}).encode() + b"\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == [secret, "x"]
    for pid, cmdline in leakcheck.processes_with_tag(tag, exclude=(os.getpid(),)):
        assert uuid.UUID(secret.split()[1]).hex not in cmdline, (pid, cmdline)
    proc.stdin.close()  # EOF: stop the rank
    status, _, _ = finish(proc)
    assert status == 128 + signal.SIGTERM


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "line", [b"not json\n", b'["a list"]\n', b'{"A": 1}\n', b'{"A": "no newline"}']
)
def test_bad_env_line_exits_2_without_starting_the_rank(tag: str, line: bytes) -> None:
    marker = uuid.uuid4().hex
    proc = start(tag, sys.executable, "-c", f"open({marker!r}, 'w')", options=("--env-stdin",))
    assert proc.stdin is not None
    proc.stdin.write(line)
    proc.stdin.close()
    status, _, err = finish(proc)
    assert status == watchdog.EXIT_USAGE
    assert "error:" in err
    assert not (REPO / marker).exists()


@pytest.mark.timeout(60)
def test_no_command_is_a_usage_error(tag: str) -> None:
    res = subprocess.run(
        [sys.executable, str(WATCHDOG_FILE), "--"],
        check=False,
        input=b"",
        capture_output=True,
        timeout=30,
    )
    assert res.returncode == watchdog.EXIT_USAGE
    assert b"no command given" in res.stderr


@pytest.mark.timeout(60)
def test_stdin_eof_stops_the_whole_process_group(tag: str) -> None:
    proc = start(tag, sys.executable, str(SCRIPTS / "tree_ready.py"), "--handle-sigterm")
    read_ready(proc)
    assert len(leakcheck.processes_with_tag(tag, exclude=(os.getpid(), proc.pid))) == 2
    assert proc.stdin is not None
    t0 = time.monotonic()
    proc.stdin.close()
    status, out, _ = finish(proc)
    assert time.monotonic() - t0 < 10
    assert status == 0  # the rank handled SIGTERM and exited 0: its status is ours
    assert out == "got SIGTERM\n"
    assert not leakcheck.wait_gone(tag, 5.0, exclude=(os.getpid(),))  # grandchild too


@pytest.mark.timeout(60)
def test_rank_ignoring_sigterm_is_killed_after_the_grace(tag: str) -> None:
    proc = start(
        tag,
        sys.executable,
        str(SCRIPTS / "tree_ready.py"),
        "--ignore-sigterm",
        options=("--grace-s", "1"),
    )
    read_ready(proc)
    assert proc.stdin is not None
    t0 = time.monotonic()
    proc.stdin.close()
    status, _, _ = finish(proc)
    elapsed = time.monotonic() - t0
    assert status == 128 + signal.SIGKILL
    assert 0.9 <= elapsed < 15, elapsed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_to_the_watchdog_stops_the_rank(tag: str, sig: int) -> None:
    proc = start(tag, sys.executable, str(SCRIPTS / "tree_ready.py"))
    read_ready(proc)
    proc.send_signal(sig)
    status, _, _ = finish(proc)
    assert status == 128 + signal.SIGTERM  # the rank died of the SIGTERM we sent it


@pytest.mark.timeout(60)
def test_rank_exit_sweeps_what_it_left_in_its_group(tag: str) -> None:
    script = (
        "import subprocess, sys; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('started', flush=True)"
    )
    proc = start(tag, sys.executable, "-c", script)
    status, out, _ = finish(proc, keep_stdin=True)
    assert (status, out) == (0, "started\n")
    assert not leakcheck.wait_gone(tag, 5.0, exclude=(os.getpid(),))


@pytest.mark.timeout(60)
def test_watchdog_sigkilled_takes_the_rank_along(tag: str) -> None:
    proc = start(tag, sys.executable, str(SCRIPTS / "tree_ready.py"))
    rank_pid, _ = read_ready(proc)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{rank_pid}") and time.monotonic() < deadline:
        with open(f"/proc/{rank_pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    state = None
    if os.path.exists(f"/proc/{rank_pid}"):
        with open(f"/proc/{rank_pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    assert state in (None, "Z"), f"rank {rank_pid} outlived its SIGKILLed watchdog"
    # Its grandchild is an orphan now (PDEATHSIG covers the rank only): clean it up.
    for pid, _ in leakcheck.processes_with_tag(tag, exclude=(os.getpid(),)):
        os.kill(pid, signal.SIGKILL)
