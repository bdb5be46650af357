"""``ringcomm run --hostfile FILE`` / ``-H h1:2,h2:2``: launch ranks on other hosts over ssh.

Pipeline, as in local mode: ``ringcomm run``'s parser (:mod:`ringcomm.cli.run`) ->
:func:`config_from_args` (a frozen :class:`SshRunConfig`) -> :func:`run`, which places the
ranks contiguously per host (``MASTER_ADDR``: the first host as ``ssh -G`` names it),
preflights every host in parallel (no rank starts unless all pass), starts one ssh per rank
under :mod:`ringcomm.launch.watchdog` and supervises them: the first rank to exit non-zero
stops the others (255: ssh failed or the connection was lost).

Guarantees: the job token never appears on a command line (it travels on the ssh's stdin);
every part of a remote command goes through ``shlex.quote``; closing a rank's stdin stops
it, and a SIGKILLed launcher takes its ssh clients with it. The steps, the remote command
and ``.ringcomm_env``'s precedence: docs/architecture.md, "The ssh launcher".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ringcomm._version import __version__
from ringcomm.config import UsageError, environment
from ringcomm.launch.envvars import (
    RESERVED_VARS,
    TOKEN_VAR,
    is_var_name,
    master_port_option,
    parse_env_options,
    position_vars,
    script_args,
    stop_restart_options,
)
from ringcomm.launch.hostfile import (
    HostfileError,
    HostSlots,
    Placement,
    assign_ranks,
    parse_hosts_option,
    read_hostfile,
)
from ringcomm.launch.supervise import (
    DEFAULT_GRACE_S,
    LauncherSignals,
    RankProcess,
    copy_output,
    describe_exit,
    job_token,
    note,
    pdeathsig_preexec,
    reap,
    slot_restarter,
    start_in_session,
    start_ranks,
    store_announcer,
    supervise,
)

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "ENV_FILE_NAME",
    "PreflightResult",
    "SshRunConfig",
    "config_from_args",
    "format_dry_run",
    "main",
    "preflight",
    "propagated_env",
    "rank_ssh_argv",
    "rank_vars",
    "read_env_file",
    "remote_command",
    "resolve_hostname",
    "run",
    "ssh_argv",
]

DEFAULT_START_TIMEOUT_S = 30.0
ENV_FILE_NAME = ".ringcomm_env"
#: How long past the remote grace period the launcher waits before killing ssh clients.
STOP_SLACK_S = 5.0
SSH_FAILED = 255  # ssh's own exit status for connection and authentication errors
_PREFLIGHT_MARK = "RINGCOMM-PREFLIGHT "
_PORT_PLACEHOLDER = "<chosen-at-launch>"
_PROPAGATED_NAMES = frozenset({"PYTHONPATH"})
_PROPAGATED_PREFIX = "RINGCOMM_"

# Runs on every host under the rank's interpreter and environment: argv[1] "1" asks for a
# free TCP port, argv[2] is the script to look for ("" in module mode). It imports ringcomm
# as the rank will: the script's directory first on sys.path (the working directory for -m).
_PREFLIGHT_SCRIPT = f"""\
import json, os, socket, sys
out = dict(hostname=socket.gethostname(), python=sys.executable)
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[2])) if sys.argv[2] else os.getcwd()
try:
    import ringcomm
    out["version"] = ringcomm.__version__
except Exception as exc:
    out["error"] = type(exc).__name__ + ": " + str(exc)
if sys.argv[1] == "1":
    with socket.socket() as s:
        s.bind(("", 0))
        out["port"] = s.getsockname()[1]
out["script_found"] = not sys.argv[2] or os.path.isfile(sys.argv[2])
print({_PREFLIGHT_MARK!r} + json.dumps(out), flush=True)
"""


@dataclass(frozen=True)
class SshRunConfig:
    """Everything a multi-host ``ringcomm run`` needs, parsed once."""

    placements: tuple[Placement, ...]
    target: str  # a script path (relative to cwd on every host), or a module name
    target_args: tuple[str, ...] = ()
    module: bool = False
    cwd: str = "/"
    python: str = sys.executable
    env: tuple[tuple[str, str], ...] = ()  # set on every host (no secret among them)
    master_addr: str | None = None  # None: the first host's HostName (``ssh -G``)
    master_port: int = 0  # 0: a free port reported by the first host's preflight
    ssh: str = "ssh"
    ssh_config: str | None = None
    ssh_port: int | None = None
    ssh_identity: str | None = None
    ssh_options: tuple[str, ...] = ()
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    grace_s: float = DEFAULT_GRACE_S
    dry_run: bool = False
    verbose: bool = False
    max_restarts: int = 0  # per rank slot; > 0: the launcher serves the store itself

    @property
    def world_size(self) -> int:
        return len(self.placements)

    @property
    def hosts(self) -> list[str]:
        """The hosts in use, in placement order (no repeats)."""
        return list(dict.fromkeys(p.host for p in self.placements))


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


def read_env_file(path: str) -> dict[str, str]:
    """``VAR=VALUE`` lines of ``path`` (see the module docstring); {} if it does not exist."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    out: dict[str, str] = {}
    for lineno, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        line = line.lstrip()
        line = line.removeprefix("export ")
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not is_var_name(name):
            raise UsageError(f"{path}:{lineno}: expected VAR=VALUE, got {line!r}")
        if name in RESERVED_VARS:
            raise UsageError(f"{path}:{lineno}: {name} is set by the launcher")
        out[name] = value
    return out


def propagated_env(
    environ: Mapping[str, str],
    env_file: Mapping[str, str] = {},
    env_options: Sequence[tuple[str, str]] = (),
) -> dict[str, str]:
    """The variables every host gets besides the rank variables (precedence: see module)."""
    out = dict(env_file)
    for name, value in environ.items():
        if name in RESERVED_VARS:
            continue  # the rank variables and the token are the launcher's own
        if name.startswith(_PROPAGATED_PREFIX) or name in _PROPAGATED_NAMES:
            out[name] = value
    out.update(env_options)
    return out


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None, cwd: str | None = None
) -> SshRunConfig:
    """Validate parsed ``ringcomm run`` arguments for multi-host mode; raise UsageError."""
    environ = environment() if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    try:
        hosts: list[HostSlots] = (
            read_hostfile(args.hostfile)
            if args.hostfile is not None
            else parse_hosts_option(args.hosts)
        )
        placements = assign_ranks(hosts, args.nproc, args.nproc_per_node)
    except HostfileError as exc:
        raise UsageError(str(exc)) from None
    port = master_port_option(args.master_port)
    if args.ssh_port is not None and not 1 <= args.ssh_port <= 65535:
        raise UsageError(f"--ssh-port must be in 1..65535, got {args.ssh_port}")
    max_restarts = stop_restart_options(args)
    if max_restarts and args.master_addr is None:
        raise UsageError(
            "--max-restarts across hosts: the launcher serves the job's store "
            "(it must outlive any rank), so pass --master-addr with this "
            "machine's address as the hosts reach it"
        )
    start_timeout_s = DEFAULT_START_TIMEOUT_S if args.start_timeout is None else args.start_timeout
    if not start_timeout_s > 0:
        raise UsageError(f"--start-timeout must be > 0, got {args.start_timeout}")
    for flag, path in (("--ssh-config", args.ssh_config), ("--ssh-identity", args.ssh_identity)):
        if path is not None and not os.path.isfile(path):
            raise UsageError(f"{flag}: no such file: {path}")
    python = args.python or sys.executable
    if not os.path.isabs(python):
        raise UsageError(
            f"--python {python!r}: give an absolute path (the remote PATH is the login shell's)"
        )
    env_file: dict[str, str] = {}
    for directory in (os.path.expanduser("~"), cwd):
        env_file.update(read_env_file(os.path.join(directory, ENV_FILE_NAME)))
    env_options = parse_env_options(args.env, environ)
    return SshRunConfig(
        placements=tuple(placements),
        target=args.target,
        target_args=script_args(args.target_args),
        module=args.module,
        cwd=cwd,
        python=python,
        env=tuple(propagated_env(environ, env_file, env_options).items()),
        master_addr=args.master_addr,
        master_port=port,
        ssh_config=args.ssh_config and os.path.abspath(args.ssh_config),
        ssh_port=args.ssh_port,
        ssh_identity=args.ssh_identity and os.path.abspath(args.ssh_identity),
        ssh_options=tuple(args.ssh_option),
        start_timeout_s=start_timeout_s,
        grace_s=args.grace_s,
        dry_run=args.dry_run,
        verbose=args.verbose,
        max_restarts=max_restarts,
    )


# --------------------------------------------------------------------------------------
# Commands (pure)
# --------------------------------------------------------------------------------------


def ssh_argv(config: SshRunConfig, host: str, remote: str) -> list[str]:
    """``ssh [options] host remote``. The user's ``--ssh-option`` come before ours (ssh
    keeps the first value it sees), so they can override ``ConnectTimeout`` and friends."""
    argv = [config.ssh, "-T", "-x"]
    if config.ssh_config is not None:
        argv += ["-F", config.ssh_config]
    if config.ssh_port is not None:
        argv += ["-p", str(config.ssh_port)]
    if config.ssh_identity is not None:
        argv += ["-i", config.ssh_identity]
    for option in config.ssh_options:
        argv += ["-o", option]
    argv += [
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={max(1, math.ceil(config.start_timeout_s))}",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
        host,
        remote,
    ]
    return argv


def _env_command(config: SshRunConfig, variables: Mapping[str, str], command: list[str]) -> str:
    """``cd CWD && exec env K=V... command``, every part shell-quoted."""
    assigns = [f"{k}={v}" for k, v in variables.items()]
    return f"cd {shlex.quote(config.cwd)} && exec " + shlex.join(["env", *assigns, *command])


def rank_vars(
    config: SshRunConfig,
    placement: Placement,
    master_addr: str,
    master_port: int | str,
    restart: int = 0,
) -> dict[str, str]:
    """Every variable set for ``placement``'s rank on its host (no secret); ``restart``:
    how many times this rank slot was started again (``--max-restarts``)."""
    env = dict(config.env)
    if config.max_restarts:
        env["RINGCOMM_STORE_EXTERNAL"] = "1"  # the launcher serves it
    if restart:
        env["RINGCOMM_RESTART"] = str(restart)
    env.update(
        position_vars(
            rank=placement.rank,
            world_size=config.world_size,
            local_rank=placement.local_rank,
            local_world_size=placement.local_world_size,
            master_addr=master_addr,
            master_port=master_port,
        )
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env


def remote_command(
    config: SshRunConfig,
    placement: Placement,
    master_addr: str,
    master_port: int | str,
    restart: int = 0,
) -> str:
    """The shell command line sshd runs for ``placement``'s rank (see the module docstring)."""
    rank_argv = [config.python, "-u"]
    rank_argv += ["-m", config.target] if config.module else [config.target]
    rank_argv += config.target_args
    watchdog = [
        config.python,
        "-m",
        "ringcomm.launch.watchdog",
        "--grace-s",
        repr(config.grace_s),
        "--env-stdin",
        "--",
    ]
    variables = rank_vars(config, placement, master_addr, master_port, restart)
    return _env_command(config, variables, watchdog + rank_argv)


def rank_ssh_argv(
    config: SshRunConfig,
    placement: Placement,
    master_addr: str,
    master_port: int | str,
    restart: int = 0,
) -> list[str]:
    return ssh_argv(
        config,
        placement.host,
        remote_command(config, placement, master_addr, master_port, restart),
    )


def preflight_argv(config: SshRunConfig, host: str, want_port: bool) -> list[str]:
    command = [
        config.python,
        "-c",
        _PREFLIGHT_SCRIPT,
        "1" if want_port else "0",
        "" if config.module else config.target,
    ]
    return ssh_argv(config, host, _env_command(config, dict(config.env), command))


def format_dry_run(config: SshRunConfig, master_addr: str) -> str:
    """What ``--dry-run`` prints: per rank, the exact ssh argv (shell-quoted). No secret."""
    port: int | str = config.master_port or _PORT_PLACEHOLDER
    lines = [
        (
            f"# {config.world_size} rank(s) on {len(config.hosts)} host(s); rank 0 serves "
            f"the store on {master_addr}:{port}"
        ),
        (
            f"# each rank reads {TOKEN_VAR} (a fresh secret; not shown) from the "
            "first line of its ssh's stdin"
        ),
    ]
    for p in config.placements:
        lines.append(
            f"# rank {p.rank} on {p.host} (local rank {p.local_rank} of {p.local_world_size})"
        )
        lines.append(shlex.join(rank_ssh_argv(config, p, master_addr, port)))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Talking to hosts
# --------------------------------------------------------------------------------------


def _run_captured(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end with no stdin and its output kept as text (raises as
    :func:`subprocess.run`: OSError, TimeoutExpired)."""
    return subprocess.run(
        argv,
        check=False,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def resolve_hostname(config: SshRunConfig, host: str, timeout_s: float = 10.0) -> str:
    """``host``'s HostName after ssh_config (``ssh -G``, no connection); else the host
    itself, without any ``user@``."""
    argv = ssh_argv(config, host, "true")
    argv = [argv[0], "-G", *argv[1:-1]]  # -G prints the configuration and exits
    try:
        res = _run_captured(argv, timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        res = None
    if res is not None and res.returncode == 0:
        for line in res.stdout.splitlines():
            key, _, value = line.partition(" ")
            if key.lower() == "hostname" and value.strip():
                return value.strip()
    return host.rsplit("@", 1)[-1]


def _is_loopback(addr: str) -> bool:
    return addr == "localhost" or addr.startswith("127.") or addr == "::1"


@dataclass(frozen=True)
class PreflightResult:
    host: str
    error: str | None = None  # None: the host is fit to run ranks
    hostname: str | None = None
    port: int | None = None


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept) or "(no output)"


def _preflight_one(config: SshRunConfig, host: str, want_port: bool) -> PreflightResult:
    argv = preflight_argv(config, host, want_port)
    try:
        res = _run_captured(argv, config.start_timeout_s)
    except subprocess.TimeoutExpired:
        return PreflightResult(host, f"no answer within {config.start_timeout_s:g} s")
    except OSError as exc:
        return PreflightResult(host, f"cannot run {config.ssh!r}: {exc}")
    if res.returncode == SSH_FAILED:
        return PreflightResult(host, f"unreachable over ssh: {_tail(res.stderr)}")
    info = None
    for line in res.stdout.splitlines():
        if line.startswith(_PREFLIGHT_MARK):
            try:
                info = json.loads(line[len(_PREFLIGHT_MARK) :])
            except json.JSONDecodeError:
                info = None
    if info is None:
        return PreflightResult(
            host,
            f"{config.python} did not run in {config.cwd} (exit {res.returncode}): "
            f"{_tail(res.stderr)}",
        )
    where = f"{config.python} on {info.get('hostname')}"
    if "error" in info:
        return PreflightResult(host, f"{where} cannot import ringcomm: {info['error']}")
    if info.get("version") != __version__:
        return PreflightResult(
            host,
            f"{where} imports ringcomm {info.get('version')}, the launcher runs {__version__}",
        )
    if not info.get("script_found"):
        return PreflightResult(host, f"script not found: {config.target} (in {config.cwd})")
    port = info.get("port")
    return PreflightResult(host, None, info.get("hostname"), port if want_port else None)


def preflight(config: SshRunConfig) -> list[PreflightResult]:
    """Check every host in use, in parallel; results in host order."""
    hosts = config.hosts
    results: list[PreflightResult | None] = [None] * len(hosts)
    want_port = config.master_port == 0

    def check(i: int) -> None:
        try:
            results[i] = _preflight_one(config, hosts[i], want_port and i == 0)
        except Exception as exc:  # noqa: BLE001  (reported as that host's failure)
            results[i] = PreflightResult(hosts[i], f"preflight crashed: {exc!r}")

    threads = [
        threading.Thread(target=check, args=(i,), name=f"ringcomm-preflight-{i}", daemon=True)
        for i in range(len(hosts))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r if r is not None else PreflightResult(h, "no result") for r, h in zip(results, hosts)]


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


@dataclass
class _SshRank(RankProcess):
    host: str = ""

    def stop(self, sig: int) -> None:
        """Close the ssh's stdin: the remote watchdog stops the rank (SIGTERM, grace,
        SIGKILL) and exits with its status."""
        stdin = self.popen.stdin
        if stdin is not None:
            try:
                stdin.close()
            except OSError:
                pass

    def kill(self) -> None:
        self.stop(0)  # the watchdog still sees EOF when the connection drops
        self.signal_group(signal.SIGKILL)

    def describe_exit(self, code: int) -> str:
        if code == SSH_FAILED:
            return (
                f"rank {self.rank}: ssh to {self.host} failed or lost the connection "
                f"(exit {SSH_FAILED})"
            )
        if code < 0:
            return f"rank {self.rank}: the ssh client to {self.host} was killed by signal {-code}"
        return f"rank {self.rank} on {self.host} {describe_exit(code)}"


def main(args: argparse.Namespace) -> int:
    """Multi-host ``ringcomm run``: the job's exit status; 2 for a usage error."""
    config = config_from_args(args)  # a UsageError: ringcomm.cli prints it, exits 2
    if config.dry_run:
        master_addr = config.master_addr or resolve_hostname(config, config.placements[0].host)
        sys.stdout.write(format_dry_run(config, master_addr))
        sys.stdout.flush()
        return 0
    try:
        return run(config)
    except KeyboardInterrupt:  # during preflight, before any rank started
        note("interrupted")
        return 130


def run(config: SshRunConfig, *, poll_s: float = 0.05) -> int:
    """Preflight, start and supervise the job; return the launcher's exit status.

    0 when every rank exits 0; 1 when preflight failed (nothing started); else the status
    of the first rank that failed, or 130/143 when the launcher got SIGINT/SIGTERM.
    Call it from a thread that lives until it returns (see ``PR_SET_PDEATHSIG``).
    """
    master_addr = config.master_addr or resolve_hostname(config, config.placements[0].host)
    if config.master_addr is None and _is_loopback(master_addr):
        remote = [h for h in config.hosts[1:] if not _is_loopback(resolve_hostname(config, h))]
        if remote:
            note(
                f"warning: MASTER_ADDR {master_addr} (host {config.hosts[0]}) is a loopback "
                f"address that {', '.join(remote)} cannot reach; pass --master-addr"
            )
    results = preflight(config)
    failed = [res for res in results if res.error is not None]
    for res in failed:
        note(f"preflight: host {res.host}: {res.error}")
    if failed:
        note(f"preflight failed on {len(failed)} of {len(results)} host(s); no rank started")
        return 1
    token = job_token()
    store = None
    if config.max_restarts:  # the store must outlive any rank: the launcher serves it
        store = _serve_store(master_addr, config.master_port, token)
        if store is None:
            return 1
        port: int | None = int(store.port)
    else:
        port = config.master_port or results[0].port
    if not port:
        note(f"preflight: host {results[0].host} reported no free port")
        return 1
    ranks: list[RankProcess] = []
    try:
        with LauncherSignals() as signals:
            ranks = _start_ranks(config, master_addr, int(port), token)
            restart = None
            if config.max_restarts:
                restart = _restarter(config, master_addr, int(port), token, ranks)
            return supervise(ranks, signals, config.grace_s + STOP_SLACK_S, poll_s, restart=restart)
    finally:
        reap(ranks)  # never leave one behind, whatever happened above
        if store is not None:
            store.close()


def _serve_store(master_addr: str, port: int, token: str | None) -> Any:
    """The job's store, served by the launcher on ``master_addr`` (its own address as the
    hosts reach it; every interface if that is not one of this machine's); None (said
    why) if it cannot start."""
    import socket

    from ringcomm.errors import RendezvousError  # lazy: only needed to run a job
    from ringcomm.rendezvous import StoreServer

    try:
        ip = socket.gethostbyname(master_addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((ip, 0))
        bind = ip
    except OSError:
        bind = "0.0.0.0"
    try:
        return StoreServer(bind, port, token=token, auth=token is not None).start()
    except RendezvousError as exc:
        note(f"error: --max-restarts: the launcher cannot serve the store: {exc}")
        return None


def _restarter(
    config: SshRunConfig,
    master_addr: str,
    port: int,
    token: str | None,
    ranks: list[RankProcess],
) -> Callable[[RankProcess, int], RankProcess | None]:
    """``--max-restarts``: a failed rank started again on its host, in its slot
    (:func:`slot_restarter`); a lost host (``SSH_FAILED``) is not restarted."""
    by_rank = {p.rank: p for p in config.placements}

    def start_again(rank: int, n: int) -> RankProcess:
        return _start_rank(config, by_rank[rank], master_addr, port, token, n)

    announce = store_announcer(master_addr, port, token)
    return slot_restarter(
        config.max_restarts, announce, start_again, ranks, gives_up=lambda c: c == SSH_FAILED
    )


def _start_rank(
    config: SshRunConfig,
    p: Placement,
    master_addr: str,
    port: int,
    token: str | None,
    restart: int = 0,
) -> _SshRank:
    popen = start_in_session(
        rank_ssh_argv(config, p, master_addr, port, restart),
        pdeathsig_preexec(),
        stdin=subprocess.PIPE,  # the rank's lifeline: closing it stops the rank
    )
    assert popen.stdin is not None
    try:
        popen.stdin.write((json.dumps({TOKEN_VAR: token} if token else {}) + "\n").encode())
        popen.stdin.flush()
    except OSError:
        pass  # ssh already failed: its exit status reports it
    label = f"{p.rank} {p.host}" if config.verbose else p.rank
    return _SshRank(p.rank, popen, copy_output(popen, label), host=p.host)


def _start_ranks(
    config: SshRunConfig, master_addr: str, port: int, token: str | None
) -> list[RankProcess]:
    return start_ranks(
        lambda p: _start_rank(config, p, master_addr, port, token), config.placements
    )
