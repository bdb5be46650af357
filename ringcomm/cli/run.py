"""``ringcomm run``: its command line, and which launcher runs the job.

``add_parser`` (argparse, for :mod:`ringcomm.cli`) -> :func:`main`, which hands the parsed
arguments to the multi-host launcher (:mod:`.ssh`) when ``--hostfile`` or ``-H`` is given,
else to the local one (:mod:`.local`). Each turns them into its own frozen config
(``config_from_args``) and runs it; neither knows of the other.
"""

from __future__ import annotations

import argparse
from typing import Any

from ringcomm.cli.options import add_hosts_options, add_nproc_option, add_ssh_config_option
from ringcomm.launch import local, ssh
from ringcomm.launch.supervise import DEFAULT_GRACE_S

__all__ = ["add_parser", "main"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``run`` on the CLI's subparsers (see :mod:`ringcomm.cli`)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "run",
        help="launch N ranks of a Python script",
        description="Launch N ranks of a Python script on this host, or over ssh on the "
        "hosts of --hostfile / -H. Each rank's output lines are prefixed with '[rank] '. "
        "Options end at the script (or at --): what follows is the script's.",
        allow_abbrev=False,
    )
    add_nproc_option(
        p,
        "number of ranks (default: 1; multi-host: every slot); -np as mpirun's",
        mpirun_alias=True,
    )
    add_hosts_options(
        p,
        hostfile_help="multi-host: one host a line, 'host slots=N' or 'host:N'",
        hosts_help="multi-host: hosts and slots",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="K",
        help="K ranks on every host (overrides the slots); without hosts, as torchrun's: "
        "K ranks on this host",
    )
    p.add_argument("--master-addr", default=None, metavar="A", help="store address")
    p.add_argument("--master-port", type=int, default=None, metavar="P", help="store port")
    add_ssh_config_option(p, "multi-host: ssh config")
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
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="start a failed rank again (its rank slot, RINGCOMM_RESTART=n) up to K times "
        "instead of stopping the job; survivors shrink, and admit it with pg.grow()",
    )
    p.add_argument(
        "-m", "--module", action="store_true", help="run TARGET as a module (python -m TARGET)"
    )
    p.add_argument("target", metavar="script.py", help="the script (or module, with -m)")
    p.add_argument("target_args", nargs=argparse.REMAINDER, metavar="args", help="its arguments")
    p.set_defaults(main=main)
    return p


def main(args: argparse.Namespace) -> int:
    """``ringcomm run``: exit status of the job; 2 for a usage error."""
    if args.hostfile is not None or args.hosts is not None:
        return ssh.main(args)
    return local.main(args)
