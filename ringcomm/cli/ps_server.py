"""``ringcomm ps-server``: run one parameter server as its own process.

The server meets the job's workers through a coordinator store (``--coordinator
HOST:PORT``, e.g. the job's ``MASTER_ADDR:MASTER_PORT``), serves until every worker closed its
client, writes a final checkpoint and exits 0. Started again with the same ``--index`` and
``--checkpoint-dir`` after a crash, it restores its latest checkpoint and the job re-forms
around it (:mod:`ringcomm.ps.membership`). Exit status: 0 done, 1 failed, 2 usage error
(:class:`~ringcomm.config.UsageError`, printed by :mod:`ringcomm.cli`). Settings from the
environment (parsed in :mod:`ringcomm.config`): ``RINGCOMM_PS_LOG`` (log level, default
WARNING), ``RINGCOMM_TOKEN`` (else the token the coordinator hands out, if it hands one
out: a store given a token does not, and the server then exits 1 saying so),
``RINGCOMM_SECURITY``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from ringcomm.cli.options import add_consistency_options
from ringcomm.config import UsageError, check_output_path, default_of, env_token, ps_log_level

__all__ = ["add_parser", "config_from_args", "main"]

_PROG = "ringcomm ps-server"


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ps-server`` on the CLI's subparsers (see :mod:`ringcomm.cli`)."""
    from ringcomm.ps.config import PSConfig
    from ringcomm.ps.updaters import UPDATERS

    p: argparse.ArgumentParser = subparsers.add_parser(
        "ps-server",
        help="run one parameter server as its own process",
        description="Serve shards of a parameter-server job's keys to its workers; restarts "
        "from --checkpoint-dir re-join the running job.",
    )
    p.add_argument(
        "--coordinator",
        type=_address,
        required=True,
        metavar="HOST:PORT",
        help="the store where servers and workers meet",
    )
    p.add_argument("--index", type=int, required=True, help="this server's index, 0..S-1")
    p.add_argument(
        "--ps-servers", type=int, default=1, metavar="S", help="number of servers (default 1)"
    )
    p.add_argument("--num-workers", type=int, required=True, metavar="W", help="number of workers")
    add_consistency_options(
        p,
        consistency=PSConfig.consistency,
        staleness=PSConfig.staleness,
        update=PSConfig.update,
        staleness_help="ssp bound (default %(default)s)",
        update_help="server: apply the optimizer here; worker: only average",
    )
    p.add_argument(
        "--reduce",
        choices=("avg", "sum"),
        default=PSConfig.reduce,
        help="combine a step's gradients by mean (default) or sum",
    )
    p.add_argument("--optimizer", choices=sorted(UPDATERS), default=PSConfig.optimizer)
    p.add_argument("--lr", type=float, default=default_of(PSConfig, "optimizer_args")["lr"])
    p.add_argument("--momentum", type=float, default=0.0, help="sgd momentum (default 0)")
    p.add_argument("--checkpoint-dir", default=PSConfig.checkpoint_dir, metavar="DIR")
    p.add_argument(
        "--checkpoint-interval",
        "--checkpoint-every",
        dest="checkpoint_every",
        type=int,
        default=PSConfig.checkpoint_every_steps,
        metavar="STEPS",
        help="checkpoint each time the slowest worker passes another STEPS steps (as train's; "
        "--checkpoint-every: the old name)",
    )
    p.add_argument(
        "--timeout-s",
        "--timeout",
        dest="timeout",
        type=float,
        default=PSConfig.timeout_s,
        metavar="S",
        help="deadline of every wait (--timeout: the old name)",
    )
    p.add_argument(
        "--join-timeout-s",
        "--join-timeout",
        dest="join_timeout",
        type=float,
        default=20.0,
        metavar="S",
        help="joining a group of the job gives up after this (then it re-forms)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--stats-json",
        default=None,
        metavar="FILE",
        help="write the server's statistics here at exit",
    )
    p.set_defaults(main=main)
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    """Validate parsed arguments into a :class:`~ringcomm.ps.config.PSConfig`; raise
    :class:`UsageError` (for a bad ``--index`` too)."""
    from ringcomm.ps.config import PSConfig

    check_output_path(args.checkpoint_dir, "--checkpoint-dir", directory=True)
    opt: dict[str, Any] = {"lr": args.lr}
    if args.optimizer == "sgd":
        opt["momentum"] = args.momentum
    try:
        config = PSConfig(
            num_workers=args.num_workers,
            consistency=args.consistency,
            staleness=args.staleness,
            update=args.ps_update,
            optimizer=args.optimizer,
            optimizer_args=opt,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every_steps=args.checkpoint_every,
            timeout_s=args.timeout,
            reduce=args.reduce,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not 0 <= args.index < args.ps_servers:
        raise UsageError(f"--index must be in [0, {args.ps_servers}), got {args.index}")
    return config


def main(args: argparse.Namespace) -> int:
    """``ringcomm ps-server``: 0 done, 1 failed; :class:`UsageError` for what cannot run."""
    config = config_from_args(args)
    try:
        level = ps_log_level()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    logging.basicConfig(level=level, format=f"[ps-server {args.index}] %(message)s")
    from ringcomm.errors import RingcommError
    from ringcomm.ps.membership import run_server

    try:
        server = run_server(
            args.coordinator,
            args.index,
            args.ps_servers,
            config,
            token=env_token(),
            join_timeout_s=args.join_timeout,
            host=args.host,
        )
    except (RingcommError, OSError, ValueError) as exc:
        print(f"{_PROG} {args.index}: {exc}", file=sys.stderr)
        return 1
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump(server.state.stats(), f)
    return 0
