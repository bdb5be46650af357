"""``ringcomm run --hostfile`` / ``-H`` against real sshd hosts (see tests/sshd_hosts.py).

Each module-scoped cluster is 3 sshd hosts, started once: ``loopback`` (127.0.0.2-4) and,
where ``ip netns add`` is permitted, ``netns`` (a network namespace and hostname per host).
The launcher runs as ``python -m ringcomm`` in a subprocess. Processes get a unique tag in
their environment (``RINGCOMM_TEST_TAG``, propagated to remote ranks as a ``RINGCOMM_*``
variable) and, where it matters, on their command line; none may outlive its test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
sys.path.insert(0, str(Path(__file__).parent))
import leakcheck
from sshd_hosts import (
    SshdHosts,
    descendants,
    netns_unavailable,
    processes_with_cmdline,
)

from ringcomm._version import __version__

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"

pytestmark = pytest.mark.needs_ssh  # skipped without sshd/ssh/root (tests/conftest.py)


def _start_cluster(tmp_path_factory: pytest.TempPathFactory, mode: str) -> SshdHosts:
    if mode == "netns":
        why = netns_unavailable()
        if why:
            pytest.skip(f"netns mode: {why}")
    return SshdHosts(tmp_path_factory.mktemp(f"sshd-{mode}"), mode).__enter__()


@pytest.fixture(scope="module", params=["loopback", "netns"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[SshdHosts]:
    hosts = _start_cluster(tmp_path_factory, request.param)
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def loopback(tmp_path_factory) -> Iterator[SshdHosts]:
    """For behaviour that does not depend on the network layout."""
    hosts = _start_cluster(tmp_path_factory, "loopback")
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.fixture
def tag() -> Iterator[str]:
    value = uuid.uuid4().hex
    yield value
    left = leakcheck.wait_gone(value, 5.0, exclude=(os.getpid(),))
    left += processes_with_cmdline(value, exclude=(os.getpid(),))
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


def cli_env(tag: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), **extra)
    env[leakcheck.TAG_VAR] = tag
    return env


def launcher_argv(hosts: SshdHosts, *args: str) -> list[str]:
    return [sys.executable, "-m", "ringcomm", "run", "--ssh-config", str(hosts.ssh_config), *args]


def ringcomm_run(
    hosts: SshdHosts,
    *args: str,
    tag: str,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    timeout_s: float = 90,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        launcher_argv(hosts, *args),
        env=env if env is not None else cli_env(tag),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def start_run(hosts: SshdHosts, *args: str, tag: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        launcher_argv(hosts, *args),
        env=cli_env(tag),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_lines(proc: subprocess.Popen[str], pattern: str, n: int) -> list[re.Match[str]]:
    """Read the launcher's stdout until ``n`` lines match ``pattern``."""
    assert proc.stdout is not None
    found, seen = [], []
    while len(found) < n:
        line = proc.stdout.readline()
        assert line, f"launcher ended early: {seen}; stderr: {proc.stderr.read()[-3000:]}"
        seen.append(line)
        m = re.fullmatch(pattern, line.rstrip("\n"))
        if m:
            found.append(m)
    return found


def expected_hostname(hosts: SshdHosts, host_index: int) -> str:
    return hosts.hosts[host_index].hostname


HOSTS_3X2 = "node1:2,node2:2,node3:2"


# --- the job runs where it should, with what it should --------------------------------


@pytest.mark.timeout(120)
def test_rank_world_local_rank_and_hostname(cluster: SshdHosts, tag: str, tmp_path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# three hosts\nnode1 slots=2\nnode2:2\n\nnode3 slots=2 # last\n")
    res = ringcomm_run(
        cluster,
        "--hostfile",
        str(hostfile),
        "-v",
        str(SCRIPTS / "host_env.py"),
        "PYTHONPATH",
        tag=tag,
    )
    assert res.returncode == 0, res.stderr
    rows = {}
    for m in re.finditer(r"^\[(\d+) (node\d)\] HOST (.*)$", res.stdout, re.MULTILINE):
        rows[int(m.group(1))] = (m.group(2), json.loads(m.group(3)))
    assert sorted(rows) == list(range(6)), res.stdout
    ports = {info["MASTER_PORT"] for _, info in rows.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r, (alias, info) in rows.items():
        assert alias == f"node{r // 2 + 1}"
        assert info["RANK"] == info["RINGCOMM_RANK"] == str(r)
        assert info["WORLD_SIZE"] == info["RINGCOMM_WORLD_SIZE"] == "6"
        assert info["LOCAL_RANK"] == str(r % 2) and info["LOCAL_WORLD_SIZE"] == "2"
        assert info["hostname"] == expected_hostname(cluster, r // 2)
        # the first host as the others reach it: its HostName from the ssh_config
        assert info["MASTER_ADDR"] == info["RINGCOMM_MASTER_ADDR"] == cluster.hosts[0].address
        assert info["RINGCOMM_STORE_EXTERNAL"] is None  # rank 0 serves the store
        assert info["token_len"] == 64
        assert info["cwd"] == str(REPO)
        assert info["PYTHONPATH"] == str(REPO)
        assert info["stdin_is_devnull"] is True  # the watchdog owns the ssh's stdin


@pytest.mark.timeout(180)
def test_all_reduce_across_3_hosts_x_2_slots(cluster: SshdHosts, tag: str) -> None:
    # RINGCOMM_* variables travel: a tiny chunk size forces many pipelined ring pieces.
    env = cli_env(tag, RINGCOMM_CHUNK_BYTES="512")
    res = ringcomm_run(
        cluster, "-H", HOSTS_3X2, str(SCRIPTS / "allreduce_hosts.py"), tag=tag, env=env
    )
    assert res.returncode == 0, res.stderr[-4000:]
    rows = {
        int(m.group(1)): (m.group(2), m.group(3), json.loads(m.group(4)))
        for m in re.finditer(r"^\[(\d+)\] SUM (\d+) (\S+) (.*)$", res.stdout, re.MULTILINE)
    }
    assert sorted(rows) == list(range(6)), res.stdout
    for r, (rank, hostname, (ok, x1, xlast)) in rows.items():
        assert rank == str(r)
        assert hostname == expected_hostname(cluster, r // 2)
        assert ok and x1 == 21.0 and xlast == 1002.0 * 21


@pytest.mark.timeout(120)
def test_env_propagation_of_awkward_values(loopback: SshdHosts, tag: str, tmp_path) -> None:
    awkward = {
        "RC_SPACES": "a b  c",
        "RC_QUOTES": """it's "quoted" \\ too""",
        "RC_DOLLAR": "$HOME ${PATH} $(echo no) `echo no`",
        "RC_SEMI": "a; echo injected; b && c | d",
        "RC_EMPTY": "",
        "RC_EQUALS": "x=y=z",
        "RC_NEWLINE": "line1\nline2",
    }
    (tmp_path / ".ringcomm_env").write_text(
        "# read from the working directory\n"
        "RC_FROM_FILE=file $value; 'x' \"y\"\n"
        "export RC_EXPORTED=e\n"
        "RC_SEMI=overridden by --env\n"
    )
    env = cli_env(
        tag,
        RC_COPIED="copied $value; 'x'",
        RINGCOMM_FOR_EVERYONE="r; $x",
        RC_NOT_LISTED="stays home",
    )
    args = [f"--env={k}={v}" for k, v in awkward.items()] + ["--env", "RC_COPIED"]
    names = [*awkward, "RC_COPIED", "RC_FROM_FILE", "RC_EXPORTED", "RINGCOMM_FOR_EVERYONE"]
    res = ringcomm_run(
        loopback,
        "-H",
        "node1,node2",
        *args,
        str(SCRIPTS / "print_env.py"),
        *names,
        "RC_NOT_LISTED",
        tag=tag,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    expected = dict(
        awkward,
        RC_COPIED="copied $value; 'x'",
        RC_FROM_FILE="file $value; 'x' \"y\"",
        RC_EXPORTED="e",
        RINGCOMM_FOR_EVERYONE="r; $x",
        RC_NOT_LISTED=None,
    )
    rows = [json.loads(line.split("] ", 1)[1]) for line in res.stdout.splitlines()]
    assert len(rows) == 2 and all(row == expected for row in rows), res.stdout
    assert all(line.startswith("[") for line in res.stdout.splitlines())  # nothing ran


# --- fail-fast ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_rank_exiting_7_stops_all_and_sets_the_status(cluster: SshdHosts, tag: str) -> None:
    t0 = time.monotonic()
    res = ringcomm_run(
        cluster,
        "-H",
        HOSTS_3X2,
        "--grace-s",
        "2",
        str(SCRIPTS / "exit_code.py"),
        "1",
        "7",
        "3",  # long enough for every rank to start and say ready, even on a loaded host
        f"--tag={tag}",
        tag=tag,
    )
    elapsed = time.monotonic() - t0
    assert res.returncode == 7, res.stderr
    assert elapsed < 45  # the other ranks sleep 60 s: they were stopped
    assert "rank 1 on node1 exited with code 7; stopping the other ranks" in res.stderr
    # every rank had started, and none is left anywhere (remote processes carry the tag
    # on their command line and in their environment)
    assert sorted(re.findall(r"^\[(\d)\] ready$", res.stdout, re.MULTILINE)) == list("012345")
    assert not processes_with_cmdline(tag, exclude=(os.getpid(),)), "ranks left behind"
    assert not leakcheck.wait_gone(tag, 2.0, exclude=(os.getpid(),))


@pytest.mark.timeout(120)
def test_launcher_sigkill_takes_remote_ranks_within_2_s(cluster: SshdHosts, tag: str) -> None:
    proc = start_run(
        cluster, "-H", HOSTS_3X2, str(SCRIPTS / "secret_ready.py"), f"--tag={tag}", tag=tag
    )
    try:
        ready = wait_lines(proc, r"\[(\d)\] ready ([0-9a-f]{64})", 6)
        tokens = {m.group(2) for m in ready}
        assert len(tokens) == 1
        # the job token reached every rank, but no command line on any host shows it
        assert not processes_with_cmdline(tokens.pop())
        ranks = [
            (p, c)
            for p, c in processes_with_cmdline(tag)
            if c.startswith(f"{sys.executable} -u ") and "secret_ready.py" in c
        ]
        assert len(ranks) == 6, ranks
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        left = leakcheck.wait_gone(tag, 2.0, exclude=(os.getpid(),))
        left += processes_with_cmdline(tag, exclude=(os.getpid(),))
        assert not left, f"outlived the SIGKILLed launcher by {time.monotonic() - t0:.1f} s: {left}"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(120)
def test_sigterm_to_launcher_stops_remote_ranks(loopback: SshdHosts, tag: str) -> None:
    proc = start_run(loopback, "-H", "node1:2,node2:1", str(SCRIPTS / "sleep_ready.py"), tag=tag)
    try:
        wait_lines(proc, r"\[(\d)\] ready", 3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    # each watchdog saw its stdin closed and sent its rank SIGTERM
    assert sorted(re.findall(r"^\[(\d)\] got SIGTERM$", out, re.MULTILINE)) == ["0", "1", "2"]


# --- preflight ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_unreachable_host_fails_preflight(loopback: SshdHosts, tag: str) -> None:
    res = ringcomm_run(
        loopback, "-H", "node1:2,unreachable:1,node2", str(SCRIPTS / "print_env.py"), tag=tag
    )
    assert res.returncode == 1, res.stderr
    assert res.stdout == ""  # no rank started, not even on the good hosts
    assert re.search(
        r"preflight: host unreachable: unreachable over ssh: .*Connection refused", res.stderr
    ), res.stderr
    assert "node1" not in res.stderr and "node2" not in res.stderr  # only the failed host
    assert "preflight failed on 1 of 3 host(s); no rank started" in res.stderr


def _python_wrapper(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.timeout(120)
def test_preflight_checks_ringcomm_version_and_script(
    loopback: SshdHosts, tag: str, tmp_path
) -> None:
    fake = tmp_path / "fake" / "ringcomm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "0.0.0+other"\n')
    other_version = _python_wrapper(
        tmp_path / "py-other", f'PYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"'
    )
    no_ringcomm = _python_wrapper(
        tmp_path / "py-bare", f'unset PYTHONPATH; exec {sys.executable} -S "$@"'
    )
    script = str(SCRIPTS / "print_env.py")
    cases = [
        (
            ["--python", other_version, script],
            rf"imports ringcomm 0\.0\.0\+other, the launcher runs {re.escape(__version__)}",
        ),
        (["--python", no_ringcomm, script], r"cannot import ringcomm: ModuleNotFoundError"),
        ([str(tmp_path / "missing.py")], r"script not found: .*missing\.py"),
    ]
    for args, message in cases:
        res = ringcomm_run(loopback, "-H", "node1,node2", *args, tag=tag)
        assert res.returncode == 1, (args, res.stderr)
        assert res.stdout == ""
        for host in ("node1", "node2"):
            assert re.search(rf"preflight: host {host}: .*{message}", res.stderr), res.stderr
        assert "preflight failed on 2 of 2 host(s)" in res.stderr


# --- usage --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_dry_run_prints_the_exact_ssh_argv_per_rank(loopback: SshdHosts, tag: str) -> None:
    env = cli_env(tag, RINGCOMM_TOKEN="s3cr3t-" + uuid.uuid4().hex)
    res = ringcomm_run(
        loopback,
        "-H",
        "node1:2,node2",
        "--env",
        "RC_X=a b; $y",
        "--ssh-option",
        "ConnectTimeout=7",
        "--dry-run",
        str(SCRIPTS / "print_env.py"),
        "RANK",
        tag=tag,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert env["RINGCOMM_TOKEN"] not in res.stdout + res.stderr
    assert "RINGCOMM_TOKEN=" not in res.stdout
    argvs = [shlex.split(line) for line in res.stdout.splitlines() if not line.startswith("#")]
    assert len(argvs) == 3
    assert not loopback.session_processes()  # nothing was run on any host
    for rank, (argv, host) in enumerate(zip(argvs, ["node1", "node1", "node2"])):
        assert argv[0] == "ssh" and argv[-2] == host
        assert argv[argv.index("-F") + 1] == str(loopback.ssh_config)
        # the user's -o comes before ours (ssh keeps the first value)
        opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
        assert opts.index("ConnectTimeout=7") < opts.index("BatchMode=yes")
        remote = shlex.split(argv[-1])
        assert remote[:5] == ["cd", str(REPO), "&&", "exec", "env"]
        assert f"RANK={rank}" in remote and "WORLD_SIZE=3" in remote
        assert f"LOCAL_RANK={rank % 2}" in remote
        assert f"MASTER_ADDR={loopback.hosts[0].address}" in remote
        assert "RC_X=a b; $y" in remote
        watchdog = remote.index("ringcomm.launch.watchdog")
        assert remote[watchdog - 2 : watchdog - 1] == [sys.executable]
        assert "--env-stdin" in remote[watchdog:]
        tail = remote[remote.index("--", watchdog) + 1 :]
        assert tail == [sys.executable, "-u", str(SCRIPTS / "print_env.py"), "RANK"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-H", "node1:2", "-n", "3"], r"-n 3 ranks do not fit in 2 slot"),
        (["-H", "node1:x"], r"slots must be a positive integer"),
        (["--hostfile", "/no/such/hostfile"], r"cannot read hostfile"),
        (["-H", "node1", "--python", "python3"], r"give an absolute path"),
    ],
)
def test_usage_errors_exit_2(loopback: SshdHosts, tag: str, args: list[str], message) -> None:
    res = ringcomm_run(loopback, *args, str(SCRIPTS / "print_env.py"), tag=tag)
    assert res.returncode == 2
    assert re.search(message, res.stderr), res.stderr


@pytest.mark.timeout(60)
def test_loopback_master_with_remote_hosts_warns(loopback: SshdHosts, tag: str, tmp_path) -> None:
    config = tmp_path / "ssh_config"
    # node1 resolves to 127.0.0.2; "far" to 0.0.0.0, not loopback (and closed: refused).
    config.write_text(
        loopback.ssh_config.read_text()
        .replace("Host unreachable", "Host unreachable far")
        .replace("HostName 127.0.0.1", "HostName 0.0.0.0")
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringcomm",
            "run",
            "--ssh-config",
            str(config),
            "-H",
            "node1,far",
            str(SCRIPTS / "print_env.py"),
        ],
        env=cli_env(tag),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert res.returncode == 1
    assert (
        "warning: MASTER_ADDR 127.0.0.2 (host node1) is a loopback address that far cannot "
        "reach; pass --master-addr"
    ) in res.stderr
    assert "preflight: host far: unreachable over ssh" in res.stderr


@pytest.mark.timeout(120)
def test_lost_connection_stops_the_job_with_255(loopback: SshdHosts, tag: str) -> None:
    proc = start_run(loopback, "-H", "node1,node2,node3", str(SCRIPTS / "sleep_ready.py"), tag=tag)
    try:
        wait_lines(proc, r"\[(\d)\] ready", 3)
        node2 = loopback.hosts[1]
        assert node2.popen is not None
        sessions = [  # node2's sshd session processes (not the rank below them)
            pid for pid in descendants(node2.popen.pid) if _comm(pid).startswith("sshd")
        ]
        assert sessions
        for pid in sessions:
            os.kill(pid, signal.SIGKILL)  # as if node2's network or sshd went away
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 255, err
    assert "rank 1: ssh to node2 failed or lost the connection (exit 255)" in err
    # rank 1 saw its stdin close with the session; the others were stopped by the launcher
    assert sorted(re.findall(r"^\[(\d)\] got SIGTERM$", out, re.MULTILINE)) in (
        ["0", "2"],
        ["0", "1", "2"],
    )


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


# -- crash safety across hosts (the reduced set of test_exit_matrix.py's matrix) ----------
EXIT_CAUSES = ("exception", "sys_exit", "sigterm", "normal_end")
EXIT_STATUS = {"exception": 1, "sys_exit": 3, "sigterm": 143, "normal_end": 1}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failing", [0, 2])
@pytest.mark.parametrize("cause", EXIT_CAUSES)
def test_a_failing_rank_ends_the_job_across_hosts(
    cluster: SshdHosts, tag: str, tmp_path: Path, cause: str, failing: int
) -> None:
    """One rank per host; the failing one goes down without close() while its peers wait
    in an all_reduce with it: the launcher returns its status within 5 s, the peers that
    noticed say why, and nothing is left on any host (``normal_end``: the peers fail, so
    the job's status is theirs, 1)."""
    report = tmp_path / "report"
    report.mkdir()
    res = ringcomm_run(
        cluster,
        "-H",
        "node1,node2,node3",
        str(SCRIPTS / "exit_scenario.py"),
        cause,
        "collective",
        str(failing),
        str(report),
        f"--tag={tag}",
        tag=tag,
    )
    t_end = time.time()
    t_fail = json.loads((report / f"fail.{failing}").read_text())
    assert res.returncode == EXIT_STATUS[cause], res.stderr
    assert t_end - t_fail < 5.0, t_end - t_fail
    if cause != "normal_end":
        assert f"ringcomm run: rank {failing} on node{failing + 1} " in res.stderr, res.stderr
    want = {
        "exception": f"rank {failing} exited: RuntimeError: user bug on rank {failing}",
        "sys_exit": f"rank {failing} left the group",
        "sigterm": f"rank {failing} exited: killed by SIGTERM",
        "normal_end": f"rank {failing} left the group",
    }[cause]
    for peer in {0, 1, 2} - {failing}:
        path = report / f"peer.{peer}"
        if path.exists():  # else the launcher stopped it before it noticed
            got = json.loads(path.read_text())
            assert want in got["message"], got
            assert got["t"] - t_fail < 1.0, got
    assert not processes_with_cmdline(tag, exclude=(os.getpid(),)), "ranks left behind"


@pytest.mark.timeout(150)
def test_max_restarts_across_hosts_restarts_a_killed_rank_on_its_host(
    cluster: SshdHosts, tag: str, tmp_path: Path
) -> None:
    # 2 hosts x 2 slots; slot 2 (first on the second host) kills itself at step 3; the
    # launcher (serving the store) starts it again over ssh; the survivors shrink, then
    # admit it with grow(). Every step's all_reduce is checked (tests/scripts/elastic_loop.py).
    world, victim = 4, 2
    res = ringcomm_run(
        cluster,
        "-H",
        ",".join(f"{a}:2" for a in cluster.aliases[:2]),
        "--max-restarts",
        "1",
        "--master-addr",
        cluster.launcher_address,
        str(SCRIPTS / "elastic_loop.py"),
        str(victim),
        "3",
        "20",
        str(tmp_path),
        tag=tag,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"rank {victim} on" in res.stderr and "starting it again (restart 1 of 1)" in res.stderr
    for s in range(world):
        if s == victim:
            continue
        rep = json.loads((tmp_path / f"slot.{s}.0").read_text())
        assert [c[1] for c in rep["changes"]] == ["shrank", "grew"], rep
        assert rep["final"] == list(range(world)) and rep["last_step"] >= 20, rep
    back = json.loads((tmp_path / f"slot.{victim}.1").read_text())
    assert back["changes"][0][1] == "rejoined" and back["checked"] >= 5, back


def test_max_restarts_across_hosts_needs_the_launchers_address(
    loopback: SshdHosts, tag: str
) -> None:
    res = ringcomm_run(
        loopback,
        "-H",
        f"{loopback.aliases[0]}:2",
        "--max-restarts",
        "1",
        str(SCRIPTS / "elastic_loop.py"),
        tag=tag,
    )
    assert res.returncode == 2 and "--master-addr" in res.stderr, res.stderr
