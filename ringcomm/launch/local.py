"""``ringcomm run``: start N ranks of a script on this host and supervise them.

Pipeline: ``ringcomm run``'s parser (:mod:`ringcomm.cli.run`) -> :func:`config_from_args`
(a frozen :class:`RunConfig`) -> :func:`run`.

What :func:`run` does (local mode):

1. Host the rendezvous store on ``master_addr:master_port`` (port 0: the OS picks one)
   with a fresh random job token.
2. Start ``[python, -u, script, *args]`` (or ``-m module``) once per rank, each in its own
   session (so its whole process tree can be signalled) and, on Linux, with
   ``PR_SET_PDEATHSIG`` = SIGKILL (so it dies if the launcher is SIGKILLed). Each rank gets
   ``RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT``, the
   ``RINGCOMM_*`` equivalents, ``RINGCOMM_STORE_EXTERNAL=1`` and ``RINGCOMM_TOKEN`` in its
   environment (the token never on a command line). ``MASTER_PORT`` is a port free at
   launch for torch's ``env://`` rank 0 to listen on; the store is at
   ``RINGCOMM_MASTER_PORT``.
3. Copy every rank's stdout/stderr to ours, whole lines, each prefixed ``[rank] ``.
4. Wait. The first rank to exit non-zero makes us stop the others (SIGTERM to their process
   groups, a grace period, SIGKILL) and exit with its code (128+N for a death by signal N).
   SIGINT/SIGTERM to the launcher are forwarded to the ranks, then it exits 130/143.

Steps 2 to 4 are :mod:`ringcomm.launch.supervise`'s, shared with the multi-host launcher
(:mod:`ringcomm.launch.ssh`), to which ``ringcomm run`` hands ``--hostfile`` / ``-H``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ringcomm.config import UsageError, env_trace_dir, environment
from ringcomm.launch.envvars import (
    RESERVED_VARS,
    TOKEN_VAR,
    master_port_option,
    parse_env_options,
    position_vars,
    script_args,
    stop_restart_options,
)
from ringcomm.launch.supervise import (
    DEFAULT_GRACE_S,
    LauncherSignals,
    RankProcess,
    copy_output,
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
    "DEFAULT_GRACE_S",
    "DEFAULT_MASTER_ADDR",
    "RESERVED_VARS",
    "TOKEN_VAR",
    "RunConfig",
    "UsageError",
    "config_from_args",
    "format_dry_run",
    "main",
    "parse_env_options",
    "rank_command",
    "rank_env",
    "run",
]

DEFAULT_MASTER_ADDR = "127.0.0.1"


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
    max_restarts: int = 0  # per rank slot: start a failed rank again this many times


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RunConfig:
    """Validate parsed arguments into a :class:`RunConfig`; raise :class:`UsageError`."""
    environ = environment() if environ is None else environ
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
        ("--start-timeout", args.start_timeout),
    ):
        if value is not None:
            raise UsageError(f"{flag} applies to multi-host launch only (--hostfile / -H)")
    nproc = 1 if args.nproc is None else args.nproc
    per_node = getattr(args, "nproc_per_node", None)
    if per_node is not None:  # torchrun's spelling, one node: the ranks of this host
        if args.nproc is not None and args.nproc != per_node:
            raise UsageError(
                f"-n {args.nproc} and --nproc-per-node {per_node} disagree on "
                "one host (without --hostfile / -H): give one of them"
            )
        nproc = per_node
    if nproc < 1:
        raise UsageError(f"-n must be >= 1, got {nproc}")
    port = master_port_option(args.master_port)
    max_restarts = stop_restart_options(args)
    if not args.module and not os.path.isfile(args.target):
        raise UsageError(f"script not found: {args.target}")
    return RunConfig(
        nproc=nproc,
        target=args.target,
        target_args=script_args(args.target_args),
        module=args.module,
        master_addr=args.master_addr or DEFAULT_MASTER_ADDR,
        master_port=port,
        env=parse_env_options(args.env, environ),
        dry_run=args.dry_run,
        grace_s=args.grace_s,
        python=args.python or sys.executable,
        verbose=args.verbose,
        max_restarts=max_restarts,
    )


def main(args: argparse.Namespace) -> int:
    """Local ``ringcomm run``: exit status of the job (see :func:`run`); 2 for a usage error."""
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
    config: RunConfig,
    rank: int,
    master_port: int | str,
    token: str | None,
    torch_port: int | str | None = None,
) -> dict[str, str]:
    """The variables the launcher sets for ``rank`` (on top of the inherited environment).

    ``--env`` values come first, so the launcher's own variables always win.
    ``MASTER_PORT`` (torch's ``env://``: where its rank 0 listens) is ``torch_port``, a
    port free at launch, not the store's (``RINGCOMM_MASTER_PORT``), which the launcher
    holds: so the torch backend runs under ``ringcomm run`` as under torchrun.
    """
    env = dict(config.env)
    env.update(
        position_vars(
            rank=rank,
            world_size=config.nproc,
            local_rank=rank,
            local_world_size=config.nproc,
            master_addr=config.master_addr,
            master_port=master_port,
            torch_port=torch_port,
        )
    )
    env.update(RINGCOMM_STORE_EXTERNAL="1", PYTHONUNBUFFERED="1")
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
        env = rank_env(config, rank, port, token, torch_port="<chosen-at-launch>")
        env.pop(TOKEN_VAR, None)
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        lines.append(f"# rank {rank}")
        lines.append(f"env {assigns} {command}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


def run(config: RunConfig, *, poll_s: float = 0.05) -> int:
    """Run the job described by ``config``; return the launcher's exit status.

    0 when every rank exits 0; else the status of the first rank that failed (128+N for
    signal N), or 130/143 when the launcher itself got SIGINT/SIGTERM.
    Call it from a thread that lives until it returns (see ``PR_SET_PDEATHSIG``).
    """
    from ringcomm.errors import RendezvousError  # lazy: only needed to run a job
    from ringcomm.rendezvous import StoreServer

    token = job_token()
    try:
        store = StoreServer(
            config.master_addr,
            config.master_port,
            token=token,
            auth=token is not None,
            world_size=config.nproc,
            world_from=f"ringcomm run -n {config.nproc} started {config.nproc} ranks",
        ).start()
    except RendezvousError as exc:
        note(f"error: {exc}")
        return 1
    ranks: list[RankProcess] = []
    try:
        with LauncherSignals() as signals:
            torch_port = _free_port(config.master_addr)
            ranks = _start_ranks(config, int(store.port), token, torch_port)
            restart = None
            if config.max_restarts > 0:
                restart = _restarter(config, store, token, ranks, torch_port)
            return supervise(
                ranks,
                signals,
                config.grace_s,
                poll_s,
                restart=restart,
                trace_dir=env_trace_dir({**environment(), **dict(config.env)}),
            )
    finally:
        reap(ranks)  # never leave one behind, whatever happened above
        store.close()


def _free_port(addr: str) -> int:
    """A port free on ``addr`` now (the OS picks it), for torch's rank 0 to listen on."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            return int(s.getsockname()[1])
    except OSError:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])


def _start_rank(
    config: RunConfig, rank: int, port: int, token: str | None, torch_port: int, restart: int = 0
) -> RankProcess:
    env = dict(environment())
    env.update(rank_env(config, rank, port, token, torch_port))
    if restart:
        env["RINGCOMM_RESTART"] = str(restart)
    popen = start_in_session(rank_command(config), pdeathsig_preexec(), env=env)
    label = f"{rank} {socket.gethostname()}" if config.verbose else rank
    return RankProcess(rank, popen, copy_output(popen, label))


def _restarter(
    config: RunConfig, store: Any, token: str | None, ranks: list[RankProcess], torch_port: int
) -> Callable[[RankProcess, int], RankProcess | None]:
    """``--max-restarts``: a failed rank's slot started again here (:func:`slot_restarter`)."""
    port = int(store.port)

    def start_again(rank: int, n: int) -> RankProcess:
        return _start_rank(config, rank, port, token, torch_port, restart=n)

    announce = store_announcer(config.master_addr, port, token)
    return slot_restarter(config.max_restarts, announce, start_again, ranks)


def _start_ranks(
    config: RunConfig, port: int, token: str | None, torch_port: int
) -> list[RankProcess]:
    return start_ranks(
        lambda rank: _start_rank(config, rank, port, token, torch_port), range(config.nproc)
    )
