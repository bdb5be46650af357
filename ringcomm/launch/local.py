"""``ringcomm run``: start N ranks of a script on this host and supervise them.

Pipeline: ``add_parser`` (argparse) -> :func:`config_from_args` (a frozen
:class:`RunConfig`) -> :func:`run`.

What :func:`run` does (local mode):

1. Host the rendezvous store on ``master_addr:master_port`` (port 0: the OS picks one)
   with a fresh random job token.
2. Start ``[python, -u, script, *args]`` (or ``-m module``) once per rank, each in its own
   session (so its whole process tree can be signalled) and, on Linux, with
   ``PR_SET_PDEATHSIG`` = SIGKILL (so it dies if the launcher is SIGKILLed). Each rank gets
   ``RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT``, the
   ``RINGCOMM_*`` equivalents, ``RINGCOMM_STORE_EXTERNAL=1`` and ``RINGCOMM_TOKEN`` in its
   environment (the token never on a command line).
3. Copy every rank's stdout/stderr to ours, whole lines, each prefixed ``[rank] ``.
4. Wait. The first rank to exit non-zero makes us stop the others (SIGTERM to their process
   groups, a grace period, SIGKILL) and exit with its code (128+N for a death by signal N).
   SIGINT/SIGTERM to the launcher are forwarded to the ranks, then it exits 130/143.

Multi-host launch (``--hostfile``, ``-H``) is dispatched to :mod:`ringcomm.launch.ssh`,
which reuses the output copying and supervision below.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import re
import secrets
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

from ringcomm.config import UsageError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "RunConfig",
    "UsageError",
    "add_parser",
    "config_from_args",
    "format_dry_run",
    "main",
    "rank_command",
    "rank_env",
    "run",
]

DEFAULT_GRACE_S = 3.0
DEFAULT_MASTER_ADDR = "127.0.0.1"
TOKEN_VAR = "RINGCOMM_TOKEN"
#: Variables the launcher sets for every rank; ``--env`` may not override them.
RESERVED_VARS = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RINGCOMM_RANK",
        "RINGCOMM_WORLD_SIZE",
        "RINGCOMM_MASTER_ADDR",
        "RINGCOMM_MASTER_PORT",
        "RINGCOMM_STORE_EXTERNAL",
        TOKEN_VAR,
    }
)
_PROG = "ringcomm run"
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Whole lines to our stdout/stderr: ranks' output copiers and the launcher's own notes.
_STDOUT_LOCK = threading.Lock()
_STDERR_LOCK = threading.Lock()


@dataclass(frozen=True)
class RunConfig:
    """Everything ``ringcomm run`` needs, parsed once."""

    nproc: int
    target: str  # a script path, or a module name when ``module`` is set
    target_args: tuple[str, ...] = ()
    module: bool = False
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = 0  # 0: the OS picks a free port at launch
    env: tuple[tuple[str, str], ...] = ()  # from --env, in order
    dry_run: bool = False
    grace_s: float = DEFAULT_GRACE_S
    python: str = sys.executable
    verbose: bool = False  # prefix output lines with the host name too


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``run`` on the CLI's subparsers (see :mod:`ringcomm.cli`)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "run",
        help="launch N ranks of a Python script",
        description="Launch N ranks of a Python script on this host, or over ssh on the "
        "hosts of --hostfile / -H. Each rank's output lines are prefixed with '[rank] '.",
    )
    p.add_argument(
        "-n",
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="number of ranks (default: 1; multi-host: every slot)",
    )
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument(
        "--hostfile",
        metavar="FILE",
        help="multi-host: one host a line, 'host slots=N' or 'host:N'",
    )
    hosts.add_argument("-H", "--hosts", metavar="h1:2,h2:2", help="multi-host: hosts and slots")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="K",
        help="multi-host: K ranks on every host (overrides the slots)",
    )
    p.add_argument("--master-addr", default=None, metavar="A", help="store address")
    p.add_argument("--master-port", type=int, default=None, metavar="P", help="store port")
    p.add_argument("--ssh-config", default=None, metavar="F", help="multi-host: ssh config")
    p.add_argument("--ssh-port", type=int, default=None, metavar="P", help="multi-host: ssh port")
    p.add_argument("--ssh-identity", default=None, metavar="F", help="multi-host: ssh key")
    p.add_argument(
        "--ssh-option",
        action="append",
        default=[],
        metavar="OPT",
        help="multi-host: an ssh -o option, e.g. 'ConnectTimeout=5'; repeatable",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        metavar="S",
        help="multi-host: seconds for the preflight of every host (default 30)",
    )
    p.add_argument(
        "--python",
        default=None,
        metavar="PATH",
        help="interpreter the ranks run (default: this one; an absolute path on every host)",
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="prefix output lines with the host too"
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="VAR[=VAL]",
        help="set VAR for every rank (VAR alone: copy the launcher's value); repeatable",
    )
    p.add_argument("--dry-run", action="store_true", help="print each rank's command; run none")
    p.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default %(default)s)",
    )
    p.add_argument(
        "-m", "--module", action="store_true", help="run TARGET as a module (python -m TARGET)"
    )
    p.add_argument("target", metavar="script.py", help="the script (or module, with -m)")
    p.add_argument("target_args", nargs=argparse.REMAINDER, metavar="args", help="its arguments")
    p.set_defaults(main=main)
    return p


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RunConfig:
    """Validate parsed arguments into a :class:`RunConfig`; raise :class:`UsageError`."""
    environ = os.environ if environ is None else environ
    if args.hostfile is not None or args.hosts is not None:
        raise UsageError(
            "--hostfile / -H: multi-host launch is configured by "
            "ringcomm.launch.ssh.config_from_args"
        )
    for flag, value in (
        ("--ssh-config", args.ssh_config),
        ("--ssh-port", args.ssh_port),
        ("--ssh-identity", args.ssh_identity),
        ("--ssh-option", args.ssh_option or None),
        ("--nproc-per-node", args.nproc_per_node),
        ("--start-timeout", args.start_timeout),
    ):
        if value is not None:
            raise UsageError(f"{flag} applies to multi-host launch only (--hostfile / -H)")
    nproc = 1 if args.nproc is None else args.nproc
    if nproc < 1:
        raise UsageError(f"-n must be >= 1, got {nproc}")
    port = 0 if args.master_port is None else args.master_port
    if not 0 <= port <= 65535:
        raise UsageError(f"--master-port must be in 0..65535, got {port}")
    if not args.grace_s >= 0:
        raise UsageError(f"--grace-s must be >= 0, got {args.grace_s}")
    target_args = list(args.target_args)
    if target_args[:1] == ["--"]:
        target_args = target_args[1:]
    if not args.module and not os.path.isfile(args.target):
        raise UsageError(f"script not found: {args.target}")
    return RunConfig(
        nproc=nproc,
        target=args.target,
        target_args=tuple(target_args),
        module=args.module,
        master_addr=args.master_addr or DEFAULT_MASTER_ADDR,
        master_port=port,
        env=parse_env_options(args.env, environ),
        dry_run=args.dry_run,
        grace_s=args.grace_s,
        python=args.python or sys.executable,
        verbose=args.verbose,
    )


def parse_env_options(
    options: Sequence[str], environ: Mapping[str, str]
) -> tuple[tuple[str, str], ...]:
    """``--env VAR=VAL`` sets VAR; ``--env VAR`` copies the launcher's VAR (must be set)."""
    out: dict[str, str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not _VAR_NAME.fullmatch(name):
            raise UsageError(f"--env {option!r}: {name!r} is not a valid variable name")
        if name in RESERVED_VARS:
            raise UsageError(f"--env {name}: set by the launcher for every rank; cannot override")
        if not sep:
            if name not in environ:
                raise UsageError(f"--env {name}: not set in the launcher's environment")
            value = environ[name]
        out[name] = value
    return tuple(out.items())


def main(args: argparse.Namespace) -> int:
    """``ringcomm run``: exit status of the job (see :func:`run`); 2 for a usage error."""
    if args.hostfile is not None or args.hosts is not None:
        from ringcomm.launch import ssh  # multi-host mode

        return ssh.main(args)
    config = config_from_args(args)  # a UsageError: ringcomm.cli prints it, exits 2
    if config.dry_run:
        sys.stdout.write(format_dry_run(config))
        sys.stdout.flush()
        return 0
    return run(config)


# --------------------------------------------------------------------------------------
# What each rank runs (pure)
# --------------------------------------------------------------------------------------


def rank_command(config: RunConfig) -> list[str]:
    """The argv every rank runs (the same for all; ranks differ by environment only)."""
    head = [config.python, "-u"]
    if config.module:
        return [*head, "-m", config.target, *config.target_args]
    return [*head, config.target, *config.target_args]


def rank_env(
    config: RunConfig, rank: int, master_port: int | str, token: str | None
) -> dict[str, str]:
    """The variables the launcher sets for ``rank`` (on top of the inherited environment).

    ``--env`` values come first, so the launcher's own variables always win.
    """
    env = dict(config.env)
    world, addr, port = str(config.nproc), config.master_addr, str(master_port)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=world,
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=world,
        MASTER_ADDR=addr,
        MASTER_PORT=port,
        RINGCOMM_RANK=str(rank),
        RINGCOMM_WORLD_SIZE=world,
        RINGCOMM_MASTER_ADDR=addr,
        RINGCOMM_MASTER_PORT=port,
        RINGCOMM_STORE_EXTERNAL="1",
        PYTHONUNBUFFERED="1",
    )
    if token is not None:
        env[TOKEN_VAR] = token
    return env


def format_dry_run(config: RunConfig, token: str | None = None) -> str:
    """What ``--dry-run`` prints: per rank, the variables set and the command. No secret."""
    port: int | str = config.master_port or "<chosen-at-launch>"
    lines = [
        f"# {config.nproc} rank(s) on this host; the store listens on {config.master_addr}:{port}",
        f"# each rank also gets {TOKEN_VAR} (a fresh secret; not shown)",
    ]
    command = " ".join(shlex.quote(a) for a in rank_command(config))
    for rank in range(config.nproc):
        env = rank_env(config, rank, port, token)
        env.pop(TOKEN_VAR, None)
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        lines.append(f"# rank {rank}")
        lines.append(f"env {assigns} {command}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


def _pdeathsig_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when the launcher dies (Linux).

    The kernel sends it when the *thread* that forked the child exits, so ranks must be
    started from a thread that outlives them: :func:`run` starts them from its caller's.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    parent = os.getpid()

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


class _LineCopier:
    """Copy a rank's output stream to ours, line by line, each line prefixed ``[label] ``
    (the label is the rank, or ``rank host`` in verbose mode).

    Whole lines are written under one lock per destination, so lines of different ranks
    never interleave mid-line; a last line without a newline gets one.
    """

    def __init__(self, source: IO[bytes], dest: IO[Any], lock: threading.Lock, label: int | str):
        self._source, self._dest, self._lock = source, dest, lock
        self._prefix = f"[{label}] ".encode()
        self.thread = threading.Thread(target=self._copy, name=f"ringcomm-out-{label}", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        binary = getattr(self._dest, "buffer", None)
        try:
            for line in iter(self._source.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self._lock:
                    try:
                        if binary is not None:
                            binary.write(self._prefix + line)
                            binary.flush()
                        else:
                            self._dest.write((self._prefix + line).decode(errors="replace"))
                            self._dest.flush()
                    except (OSError, ValueError):
                        pass  # our own output is gone (closed pipe): keep draining the rank
        finally:
            self._source.close()


@dataclass
class _RankProcess:
    rank: int
    popen: subprocess.Popen[bytes]
    copiers: tuple[_LineCopier, ...]
    _pidfd: int | None = field(default=None, init=False, repr=False)

    def signal_group(self, sig: int) -> None:
        """Signal the rank's whole process group (its session, started by us)."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    # What supervision needs; the ssh launcher's ranks override them.
    def stop(self, sig: int) -> None:
        """Ask the rank to stop (here: ``sig`` to its process group)."""
        self.signal_group(sig)

    def kill(self) -> None:
        """Stop the rank now (and sweep what it left in its process group)."""
        self.signal_group(signal.SIGKILL)

    def exit_fd(self) -> int | None:
        """A descriptor that becomes readable when the rank's process exits (a pidfd,
        closed with the Popen's ``wait``); None where the system has none."""
        if self._pidfd is None and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(self.popen.pid)
            except OSError:
                self._pidfd = -1
        return None if self._pidfd is None or self._pidfd < 0 else self._pidfd

    def close_exit_fd(self) -> None:
        if self._pidfd is not None and self._pidfd >= 0:
            os.close(self._pidfd)
        self._pidfd = -1

    def describe_exit(self, code: int) -> str:
        """``rank R exited with code C`` / ``rank R was killed by SIGNAME``."""
        if code < 0:
            return f"rank {self.rank} was killed by {_signal_name(-code)}"
        return f"rank {self.rank} exited with code {code}"


class _Signals:
    """Record SIGINT/SIGTERM to the launcher while ranks run (main thread only)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _exit_status(returncode: int) -> int:
    """A shell-style status: the code itself, or 128+N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _note(message: str) -> None:
    with _STDERR_LOCK:
        print(f"{_PROG}: {message}", file=sys.stderr, flush=True)


def run(config: RunConfig, *, poll_s: float = 0.05) -> int:
    """Run the job described by ``config``; return the launcher's exit status.

    0 when every rank exits 0; else the status of the first rank that failed (128+N for
    signal N), or 130/143 when the launcher itself got SIGINT/SIGTERM.
    Call it from a thread that lives until it returns (see ``PR_SET_PDEATHSIG``).
    """
    from ringcomm.errors import RendezvousError  # lazy: only needed to run a job
    from ringcomm.rendezvous import StoreServer

    token = secrets.token_hex(32)
    try:
        store = StoreServer(config.master_addr, config.master_port, token=token).start()
    except RendezvousError as exc:
        _note(f"error: {exc}")
        return 1
    ranks: list[_RankProcess] = []
    try:
        with _Signals() as signals:
            ranks = _start_ranks(config, int(store.port), token)
            return _supervise(ranks, signals, config.grace_s, poll_s)
    finally:
        for r in ranks:  # never leave one behind, whatever happened above
            if r.popen.poll() is None:
                r.kill()
                r.popen.wait()
        _join_copiers(ranks, timeout_s=5.0)
        store.close()


def _start_ranks(config: RunConfig, port: int, token: str) -> list[_RankProcess]:
    command = rank_command(config)
    preexec = _pdeathsig_preexec()
    host = socket.gethostname()
    ranks: list[_RankProcess] = []
    try:
        for rank in range(config.nproc):
            env = dict(os.environ)
            env.update(rank_env(config, rank, port, token))
            popen = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=preexec,  # noqa: PLW1509  (only prctl + getppid: fork-safe)
            )
            assert popen.stdout is not None and popen.stderr is not None
            label = f"{rank} {host}" if config.verbose else rank
            copiers = (
                _LineCopier(popen.stdout, sys.stdout, _STDOUT_LOCK, label),
                _LineCopier(popen.stderr, sys.stderr, _STDERR_LOCK, label),
            )
            ranks.append(_RankProcess(rank, popen, copiers))
    except BaseException:
        for r in ranks:
            r.signal_group(signal.SIGKILL)
            r.popen.wait()
        raise
    return ranks


def _supervise(ranks: list[_RankProcess], signals: _Signals, grace_s: float, poll_s: float) -> int:
    """Wait for all ranks; on the first failure or signal stop the rest. Return the status."""
    running = {r.rank: r for r in ranks}
    while running:
        if signals.received:
            sig = signals.received[0]
            _note(f"got {signal.Signals(sig).name}; stopping all ranks")
            _stop(ranks, sig, grace_s, signals)
            return 128 + sig
        for rank, r in list(running.items()):
            code = r.popen.poll()
            if code is None:
                continue
            del running[rank]
            if code != 0:
                how = r.describe_exit(code)
                if running:
                    _note(f"{how}; stopping the other ranks")
                else:
                    _note(how)
                _stop(ranks, signal.SIGTERM, grace_s, signals)
                return _exit_status(code)
        if running:
            _wait_for_exits(list(running.values()), poll_s)
    return 0


def _wait_for_exits(ranks: list[_RankProcess], timeout_s: float) -> None:
    """Sleep until one of ``ranks`` exits, at most ``timeout_s``: the first failure is
    seen as it happens (Linux pidfds), so ranks that fail moments apart keep their order."""
    fds = [fd for fd in (r.exit_fd() for r in ranks) if fd is not None]
    if len(fds) < len(ranks):
        time.sleep(timeout_s)
        return
    select.select(fds, [], [], timeout_s)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _stop(ranks: list[_RankProcess], sig: int, grace_s: float, signals: _Signals) -> None:
    """Send ``sig`` to every rank's process group; after ``grace_s`` (or a second signal to
    the launcher) SIGKILL what is left. Returns when every rank has exited."""
    seen = len(signals.received)
    for r in ranks:
        if r.popen.poll() is None:
            r.stop(sig)
    deadline = time.monotonic() + grace_s
    while any(r.popen.poll() is None for r in ranks):
        if time.monotonic() >= deadline or len(signals.received) > seen:  # impatient user
            break
        time.sleep(0.02)
    for r in ranks:  # also sweeps what exited ranks left in their sessions
        r.kill()
    for r in ranks:
        r.popen.wait()


def _join_copiers(ranks: list[_RankProcess], timeout_s: float) -> None:
    """Let the output copiers drain; a grandchild holding a pipe open must not hang us."""
    deadline = time.monotonic() + timeout_s
    for r in ranks:
        r.close_exit_fd()
        for c in r.copiers:
            c.thread.join(max(0.0, deadline - time.monotonic()))
