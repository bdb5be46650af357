"""The ssh launcher's command building (ringcomm.launch.ssh), without sshd.

The remote command line is run here through ``sh -c``, exactly as sshd would hand it to the
login shell, with the token line on stdin: quoting is proven by a real shell, not by
inspecting strings. Runs wherever a POSIX shell exists (no ssh needed).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ringcomm.cli import build_parser
from ringcomm.config import UsageError
from ringcomm.launch import local, ssh
from ringcomm.launch.envvars import TOKEN_VAR
from ringcomm.launch.hostfile import HostSlots, assign_ranks

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"

AWKWARD = {
    "RC_SPACES": "a b  c",
    "RC_QUOTES": """it's "quoted" \\ too""",
    "RC_DOLLAR": "$HOME ${PATH} $(echo no) `echo no`",
    "RC_SEMI": "a; echo injected; b && c | d",
    "RC_EMPTY": "",
    "RC_NEWLINE": "line1\nline2",
    "RC_GLOB": "* ? [a-z]",
}


def make_config(tmp_path: Path, **overrides) -> ssh.SshRunConfig:
    fields = {
        "placements": tuple(assign_ranks([HostSlots("h1", 2), HostSlots("h2", 1)])),
        "target": str(SCRIPTS / "print_env.py"),
        "target_args": ("RANK", "LOCAL_RANK", "RINGCOMM_TOKEN", *AWKWARD),
        "cwd": str(tmp_path),
        "env": tuple(dict(AWKWARD, PYTHONPATH=str(REPO)).items()),
    }
    fields.update(overrides)
    return ssh.SshRunConfig(**fields)


@pytest.mark.timeout(60)
def test_remote_command_survives_a_real_shell(tmp_path: Path) -> None:
    config = make_config(tmp_path / "dir with 'quote' and space")
    os.makedirs(config.cwd)
    token = "t0k3n-" + "f" * 58
    for placement in config.placements[1:]:  # rank 1 (local rank 1 on h1), rank 2 (h2)
        command = ssh.remote_command(config, placement, "10.0.0.1", 29500)
        assert token not in command
        proc = subprocess.Popen(
            ["sh", "-c", command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},  # sshd's bare environment
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            proc.stdin.write(json.dumps({TOKEN_VAR: token}) + "\n")
            proc.stdin.flush()
            proc.wait(timeout=30)  # stdin held open: EOF would be the stop request
            out, err = proc.stdout.read(), proc.stderr.read()
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 0, err
        got = json.loads(out)
        assert got == dict(
            AWKWARD,
            RANK=str(placement.rank),
            LOCAL_RANK=str(placement.local_rank),
            RINGCOMM_TOKEN=token,
        )


def test_remote_command_shape() -> None:
    config = make_config(Path("/w d"), grace_s=1.5, target_args=("--lr", "0.1"))
    words = shlex.split(ssh.remote_command(config, config.placements[2], "m.example", 1234))
    assert words[:5] == ["cd", "/w d", "&&", "exec", "env"]
    assigns = dict(w.split("=", 1) for w in words[5:] if "=" in w and not w.startswith("-"))
    assert assigns["RANK"] == "2" and assigns["WORLD_SIZE"] == "3"
    assert assigns["LOCAL_RANK"] == "0" and assigns["LOCAL_WORLD_SIZE"] == "1"
    assert assigns["MASTER_ADDR"] == assigns["RINGCOMM_MASTER_ADDR"] == "m.example"
    assert assigns["MASTER_PORT"] == "1234" and "RINGCOMM_TOKEN" not in assigns
    i = words.index("ringcomm.launch.watchdog")
    assert words[i - 2 : i] == [sys.executable, "-m"]
    assert words[i + 1 :] == [
        "--grace-s",
        "1.5",
        "--env-stdin",
        "--",
        sys.executable,
        "-u",
        str(SCRIPTS / "print_env.py"),
        "--lr",
        "0.1",
    ]
    module = make_config(Path("/w"), module=True, target="pkg.train", target_args=())
    tail = shlex.split(ssh.remote_command(module, module.placements[0], "m", 1))[-4:]
    assert tail == [sys.executable, "-u", "-m", "pkg.train"]


def test_ssh_argv_options_order() -> None:
    config = make_config(
        Path("/w"),
        ssh_config="/c/ssh config",
        ssh_port=2222,
        ssh_identity="/k/id",
        ssh_options=("ConnectTimeout=3", "User=bob"),
        start_timeout_s=7.5,
    )
    argv = ssh.ssh_argv(config, "h1", "true")
    assert argv[:3] == ["ssh", "-T", "-x"]
    assert argv[-2:] == ["h1", "true"]
    pairs = list(zip(argv[3:-2:2], argv[4:-2:2]))
    assert pairs[:3] == [("-F", "/c/ssh config"), ("-p", "2222"), ("-i", "/k/id")]
    opts = [v for k, v in pairs if k == "-o"]
    # the user's first: ssh keeps the first value it sees
    assert opts == [
        "ConnectTimeout=3",
        "User=bob",
        "BatchMode=yes",
        "ConnectTimeout=8",
        "ServerAliveInterval=5",
        "ServerAliveCountMax=3",
    ]


def test_propagated_env_precedence() -> None:
    environ = {
        "RINGCOMM_TIMEOUT_S": "9",
        "RINGCOMM_TOKEN": "never copied",
        "RINGCOMM_RANK": "launcher's own",
        "PYTHONPATH": "/p",
        "HOME": "/not/propagated",
        "A": "from launcher",
    }
    env_file = {"A": "from file", "B": "from file", "RINGCOMM_TIMEOUT_S": "1"}
    got = ssh.propagated_env(environ, env_file, [("B", "from --env")])
    assert got == {
        "A": "from file",  # the launcher's A is not propagated unless named by --env
        "B": "from --env",
        "RINGCOMM_TIMEOUT_S": "9",
        "PYTHONPATH": "/p",
    }


def test_read_env_file(tmp_path: Path) -> None:
    path = tmp_path / ".ringcomm_env"
    assert ssh.read_env_file(str(path)) == {}
    path.write_text("# c\n\nA=1\nexport B = x y \nC=a=b # not a comment\n")
    assert ssh.read_env_file(str(path)) == {"A": "1", "B": " x y ", "C": "a=b # not a comment"}
    for bad, message in (
        ("no equals sign", r":1: expected VAR=VALUE"),
        ("1X=2", r":1: expected VAR=VALUE"),
        ("OK=1\nRANK=3", r":2: RANK is set by the launcher"),
    ):
        path.write_text(bad)
        with pytest.raises(UsageError, match=message):
            ssh.read_env_file(str(path))


def test_config_from_args(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb:2\n")
    (tmp_path / ".ringcomm_env").write_text("FROM_FILE=1\n")
    args = build_parser().parse_args(
        [
            "run",
            "--hostfile",
            str(hostfile),
            "-n",
            "3",
            "--env",
            "X=1",
            "--ssh-option",
            "Compression=yes",
            "--grace-s",
            "2",
            "--start-timeout",
            "5",
            "s.py",
            "--",
            "-v",
        ]
    )
    config = ssh.config_from_args(args, environ={"RINGCOMM_ALGO": "ring"}, cwd=str(tmp_path))
    assert [(p.rank, p.host, p.local_rank) for p in config.placements] == [
        (0, "a", 0),
        (1, "a", 1),
        (2, "b", 0),
    ]
    assert config.hosts == ["a", "b"] and config.world_size == 3
    assert dict(config.env) == {"FROM_FILE": "1", "RINGCOMM_ALGO": "ring", "X": "1"}
    assert config.target_args == ("-v",) and config.ssh_options == ("Compression=yes",)
    assert (config.grace_s, config.start_timeout_s, config.cwd) == (2.0, 5.0, str(tmp_path))
    for argv, message in (
        (["-H", "a", "--start-timeout", "0"], "--start-timeout must be > 0"),
        (["-H", "a", "--ssh-config", str(tmp_path / "nope")], "--ssh-config: no such file"),
        (["-H", "a", "--ssh-port", "0"], "--ssh-port must be in 1..65535"),
        (["-H", "a", "--env", "RANK=1"], "cannot override"),
    ):
        with pytest.raises(UsageError, match=message):
            ssh.config_from_args(build_parser().parse_args(["run", *argv, "s.py"]), environ={})


def test_local_mode_refuses_multi_host_only_options() -> None:
    # (--nproc-per-node without hosts is torchrun's: that many local ranks)
    for argv in (["--ssh-option", "X=y"], ["--start-timeout", "3"]):
        args = build_parser().parse_args(["run", *argv, str(SCRIPTS / "print_env.py")])
        with pytest.raises(UsageError, match="applies to multi-host launch only"):
            local.config_from_args(args, environ={})
