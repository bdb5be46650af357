"""``ringcomm run`` in local mode (ringcomm.launch.local) and the ``ringcomm`` CLI.

The launcher runs as ``python -m ringcomm`` in a subprocess (no reliance on PATH). Every test
tags the processes it starts through the environment and checks none is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import leakcheck

from ringcomm._version import __version__
from ringcomm.cli import build_parser
from ringcomm.launch import local

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture
def tag() -> str:
    """A unique tag in the environment of every process the test starts; none may outlive it."""
    value = uuid.uuid4().hex
    yield value
    left = leakcheck.wait_gone(value, 5.0, exclude=(os.getpid(),))
    assert not left, f"processes left behind: {left}"


def cli_env(tag: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), **extra)
    env[leakcheck.TAG_VAR] = tag
    return env


def ringcomm(
    *args: str, tag: str, timeout_s: float = 60, env: dict[str, str] | None = None, cwd=REPO
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ringcomm", *args],
        check=False,
        env=env if env is not None else cli_env(tag),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def start_ringcomm(*args: str, tag: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ringcomm", *args],
        env=cli_env(tag),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_ready(proc: subprocess.Popen[str], n: int) -> list[str]:
    """Read the launcher's stdout until ``n`` ranks printed "ready"."""
    lines = []
    assert proc.stdout is not None
    while sum(line.endswith("] ready") for line in lines) < n:
        line = proc.stdout.readline()
        assert line, f"launcher ended early: {lines}"
        lines.append(line.rstrip("\n"))
    return lines


def by_rank(text: str, marker: str) -> dict[int, str]:
    """``{rank: rest}`` of the lines ``[rank] <marker> rest``."""
    out = {}
    for m in re.finditer(rf"^\[(\d+)\] {marker} (.*)$", text, re.MULTILINE):
        out[int(m.group(1))] = m.group(2)
    return out


# --- CLI ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_version(tag: str) -> None:
    res = ringcomm("--version", tag=tag)
    assert res.returncode == 0
    assert res.stdout.strip() == f"ringcomm {__version__}"


@pytest.mark.timeout(60)
def test_no_command_prints_help_and_exits_2(tag: str) -> None:
    res = ringcomm(tag=tag)
    assert res.returncode == 2
    assert "run" in res.stderr


def test_parse_run_arguments() -> None:
    args = build_parser().parse_args(
        ["run", "-n", "4", "--env", "A=1", "--env", "B", "x.py", "--lr", "0.1", "-n", "9"]
    )
    assert args.nproc == 4
    assert args.target == "x.py"
    assert args.target_args == ["--lr", "0.1", "-n", "9"]  # the script's, not ours
    config = local.config_from_args(
        build_parser().parse_args(
            ["run", "-n", "2", "--env", "A=1", "--env", "B", "-m", "pkg.mod", "--", "-v"]
        ),
        environ={"B": "from launcher"},
    )
    assert config == local.RunConfig(
        nproc=2,
        target="pkg.mod",
        target_args=("-v",),
        module=True,
        env=(("A", "1"), ("B", "from launcher")),
    )
    assert local.rank_command(config)[1:] == ["-u", "-m", "pkg.mod", "-v"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--env", "NOPE_NOT_SET_ANYWHERE"], "not set in the launcher's environment"),
        (["--env", "RANK=3"], "cannot override"),
        (["--env", "RINGCOMM_TOKEN=x"], "cannot override"),
        (["--env", "1BAD=x"], "not a valid variable name"),
        (["-n", "0"], "-n must be >= 1"),
        (["--ssh-port", "22"], "multi-host"),
    ],
)
def test_config_errors(argv: list[str], message: str) -> None:
    args = build_parser().parse_args(["run", *argv, str(SCRIPTS / "print_env.py")])
    with pytest.raises(local.UsageError, match=message):
        local.config_from_args(args, environ={})


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        (["--hostfile", "no/such/hosts.txt"], "cannot read hostfile"),
        (["-H", "a:2,b:2"], r"-n 5 ranks do not fit in 4 slot"),
    ],
)
def test_multi_host_goes_to_the_ssh_launcher(tag: str, hosts: list[str], message: str) -> None:
    # (the ssh launcher itself is tested against real sshd hosts in test_launch_ssh.py)
    res = ringcomm("run", "-n", "5", *hosts, str(SCRIPTS / "print_env.py"), tag=tag)
    assert res.returncode == 2
    assert re.search(message, res.stderr), res.stderr
    assert res.stdout == ""


@pytest.mark.timeout(60)
def test_busy_master_port_is_a_clean_error(tag: str) -> None:
    from ringcomm.rendezvous import StoreServer

    with StoreServer("127.0.0.1", 0).start() as busy:
        res = ringcomm(
            "run",
            "-n",
            "2",
            "--master-port",
            str(busy.port),
            str(SCRIPTS / "print_env.py"),
            tag=tag,
        )
    assert res.returncode == 1
    assert "Address already in use" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.timeout(60)
def test_missing_script_exits_2(tag: str) -> None:
    res = ringcomm("run", "-n", "2", "no/such/script.py", tag=tag)
    assert res.returncode == 2
    assert "script not found" in res.stderr


# --- running -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_ranks_get_their_environment_and_prefixed_output(tag: str) -> None:
    res = ringcomm("run", "-n", "3", str(SCRIPTS / "rank_env.py"), "a b", "--flag", tag=tag)
    assert res.returncode == 0, res.stderr
    envs = {r: json.loads(v) for r, v in by_rank(res.stdout, "ENV").items()}
    assert sorted(envs) == [0, 1, 2]
    ports = {e["MASTER_PORT"] for e in envs.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    stores = {e["RINGCOMM_MASTER_PORT"] for e in envs.values()}
    assert len(stores) == 1 and int(stores.pop()) > 0
    for r, e in envs.items():
        assert e["RANK"] == e["RINGCOMM_RANK"] == e["LOCAL_RANK"] == str(r)
        assert e["WORLD_SIZE"] == e["RINGCOMM_WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "3"
        assert e["MASTER_ADDR"] == e["RINGCOMM_MASTER_ADDR"] == "127.0.0.1"
        # torch's env:// listens on MASTER_PORT: not the store's port, which the launcher holds
        assert e["RINGCOMM_MASTER_PORT"] != e["MASTER_PORT"]
        assert e["RINGCOMM_STORE_EXTERNAL"] == "1"
        assert e["token_len"] == 64
    assert by_rank(res.stdout, "ARGV") == {r: json.dumps(["a b", "--flag"]) for r in range(3)}
    for r in range(3):
        assert f"[{r}] no newline from {r}\n" in res.stdout  # a last partial line still shows
        assert f"[{r}] to stderr from {r}\n" in res.stderr
    assert "to stderr" not in res.stdout


@pytest.mark.timeout(60)
def test_module_mode(tag: str) -> None:
    res = ringcomm("run", "-n", "2", "-m", "print_env", "RANK", tag=tag, cwd=SCRIPTS)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ['[0] {"RANK": "0"}', '[1] {"RANK": "1"}']


@pytest.mark.timeout(60)
def test_output_lines_never_interleave(tag: str) -> None:
    res = ringcomm("run", "-n", "4", str(SCRIPTS / "chatty.py"), "300", tag=tag)
    assert res.returncode == 0, res.stderr[-2000:]
    for stream in (res.stdout, res.stderr):
        lines = stream.splitlines()
        assert len(lines) == 4 * 300
        for line in lines:
            m = re.fullmatch(r"\[(\d)\] (\d)-(\d+)-(\d+)", line)
            assert m and m.group(1) == m.group(2) and m.group(4) == m.group(1) * 3000, line[:80]


@pytest.mark.timeout(60)
def test_env_passthrough_of_awkward_values(tag: str) -> None:
    awkward = {
        "RC_SPACES": "a b  c",
        "RC_QUOTES": """it's "quoted" \\ too""",
        "RC_DOLLAR": "$HOME ${PATH} $(echo no) `echo no`",
        "RC_SEMI": "a; echo injected; b && c | d",
        "RC_EMPTY": "",
        "RC_EQUALS": "x=y=z",
        "RC_NEWLINE": "line1\nline2",
    }
    env = cli_env(tag, RC_COPIED="copied $value; 'x'")
    args = [f"--env={k}={v}" for k, v in awkward.items()] + ["--env", "RC_COPIED"]
    names = [*awkward, "RC_COPIED"]
    res = ringcomm("run", "-n", "2", *args, str(SCRIPTS / "print_env.py"), *names, tag=tag, env=env)
    assert res.returncode == 0, res.stderr
    expected = dict(awkward, RC_COPIED="copied $value; 'x'")
    rows = [json.loads(line.split("] ", 1)[1]) for line in res.stdout.splitlines()]
    assert len(rows) == 2 and all(row == expected for row in rows), res.stdout


@pytest.mark.timeout(60)
def test_failing_rank_sets_exit_code_and_stops_others(tag: str) -> None:
    t0 = time.monotonic()
    res = ringcomm("run", "-n", "3", str(SCRIPTS / "exit_code.py"), "1", "7", tag=tag)
    elapsed = time.monotonic() - t0
    assert res.returncode == 7, res.stderr
    assert elapsed < 15  # the others sleep 60 s: they were stopped
    assert "rank 1 exited with code 7" in res.stderr


@pytest.mark.timeout(60)
def test_rank_ignoring_sigterm_is_killed_after_grace(tag: str) -> None:
    t0 = time.monotonic()
    res = ringcomm(
        "run",
        "-n",
        "2",
        "--grace-s",
        "1",
        str(SCRIPTS / "exit_code.py"),
        "0",
        "5",
        "0.5",
        "--ignore-sigterm",
        tag=tag,
    )
    assert res.returncode == 5, res.stderr
    assert time.monotonic() - t0 < 15


@pytest.mark.timeout(60)
def test_rank_killed_by_signal_gives_128_plus_signum(tag: str) -> None:
    res = ringcomm("run", "-n", "2", str(SCRIPTS / "exit_code.py"), "1", "-9", tag=tag)
    assert res.returncode == 128 + 9, res.stderr
    assert "SIGKILL" in res.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [0, 4])
def test_all_ranks_exit_with_the_same_code(tag: str, code: int) -> None:
    # rank r exits after (r + 1) * 0.5 s
    res = ringcomm("run", "-n", "3", str(SCRIPTS / "exit_code.py"), "-1", str(code), "0.5", tag=tag)
    assert res.returncode == code, res.stderr
    assert sorted(re.findall(r"^\[(\d)\] ready$", res.stdout, re.MULTILINE)) == ["0", "1", "2"]
    if code:
        assert "rank 0 exited with code 4" in res.stderr  # the first failure wins


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_is_forwarded(tag: str, sig: int, status: int) -> None:
    proc = start_ringcomm("run", "-n", "2", str(SCRIPTS / "sleep_ready.py"), tag=tag)
    try:
        wait_ready(proc, 2)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == status, err
    name = signal.Signals(sig).name
    assert sorted(re.findall(rf"^\[(\d)\] got {name}$", out, re.MULTILINE)) == ["0", "1"], out


@pytest.mark.timeout(60)
def test_launcher_sigkill_leaves_no_ranks(tag: str) -> None:
    proc = start_ringcomm(
        "run", "-n", "3", str(SCRIPTS / "sleep_ready.py"), "--no-handlers", tag=tag
    )
    try:
        wait_ready(proc, 3)
        ranks = leakcheck.processes_with_tag(tag, exclude=(os.getpid(), proc.pid))
        assert len(ranks) == 3, ranks
        proc.kill()
        proc.wait()
        left = leakcheck.wait_gone(tag, 5.0, exclude=(os.getpid(),))
        assert not left, f"ranks outlived the SIGKILLed launcher: {left}"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_dry_run_shows_commands_but_never_the_token(tag: str) -> None:
    secret = "s3cr3t-" + uuid.uuid4().hex
    env = cli_env(tag, RINGCOMM_TOKEN=secret)
    res = ringcomm(
        "run",
        "-n",
        "2",
        "--env",
        "RC_X=a b",
        "--master-port",
        "29555",
        "--dry-run",
        str(SCRIPTS / "print_env.py"),
        "RANK",
        tag=tag,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert secret not in res.stdout + res.stderr
    assert "RINGCOMM_TOKEN=" not in res.stdout
    lines = [line for line in res.stdout.splitlines() if line.startswith("env ")]
    assert len(lines) == 2
    for r, line in enumerate(lines):
        assert (
            f" RANK={r} " in line
            and " WORLD_SIZE=2 " in line
            and " RINGCOMM_MASTER_PORT=29555 " in line
        )
        assert "RC_X='a b'" in line
        assert line.endswith("print_env.py RANK")


def test_format_dry_run_hides_the_token() -> None:
    config = local.RunConfig(nproc=2, target="x.py")
    token = "f" * 64
    assert token not in local.format_dry_run(config, token=token)


@pytest.mark.timeout(120)
def test_ranks_form_a_group_and_pass_a_ring(tag: str) -> None:
    res = ringcomm("run", "-n", "3", str(SCRIPTS / "group_ring.py"), tag=tag, timeout_s=100)
    assert res.returncode == 0, res.stderr
    assert by_rank(res.stdout, "ring") == {0: "0/3 103", 1: "1/3 101", 2: "2/3 103"}


@pytest.mark.timeout(60)
def test_verbose_prefixes_the_host(tag: str) -> None:
    import socket

    res = ringcomm("run", "-n", "2", "-v", str(SCRIPTS / "print_env.py"), "RANK", tag=tag)
    assert res.returncode == 0, res.stderr
    host = socket.gethostname()
    assert sorted(res.stdout.splitlines()) == [
        f'[0 {host}] {{"RANK": "0"}}',
        f'[1 {host}] {{"RANK": "1"}}',
    ]
