"""Options that several subcommands take: each spelled, typed and grouped in one place.

A subcommand adds them with its own help text (what the option means there) and, where
it has one, its own default; the flags, ``metavar``, type, choices and mutual exclusions
are the same in every subcommand that takes them, as is the code that reads them
(``--hostfile``/``-H``: :func:`ringcomm.cli.bench.hosts_from_args` and the ssh launcher;
``--consistency`` and friends: :class:`~ringcomm.ps.config.PSConfig`).
"""

from __future__ import annotations

import argparse
from typing import Any, Protocol

__all__ = [
    "add_consistency_options",
    "add_hosts_options",
    "add_nproc_option",
    "add_ssh_config_option",
]


class Options(Protocol):
    """Where options are added: a parser or one of its argument groups."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action: ...


def add_nproc_option(
    p: Options, help: str, *, default: int | None = None, mpirun_alias: bool = False
) -> None:
    """``-n``/``--nproc N``, the number of ranks (``mpirun_alias``: ``-np`` too)."""
    flags = ("-n", "-np", "--nproc") if mpirun_alias else ("-n", "--nproc")
    p.add_argument(*flags, type=int, default=default, metavar="N", help=help)


def add_hosts_options(p: argparse.ArgumentParser, *, hostfile_help: str, hosts_help: str) -> None:
    """``--hostfile FILE`` or ``-H``/``--hosts h1:2,h2:2`` (one of them): the hosts and
    their slots, for ranks over ssh."""
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("--hostfile", metavar="FILE", help=hostfile_help)
    hosts.add_argument("-H", "--hosts", metavar="h1:2,h2:2", help=hosts_help)


def add_ssh_config_option(p: Options, help: str) -> None:
    """``--ssh-config F``: the ssh config file the hosts are reached with."""
    p.add_argument("--ssh-config", default=None, metavar="F", help=help)


def add_consistency_options(
    p: Options,
    *,
    consistency: str,
    staleness: int,
    update: str,
    staleness_help: str | None = None,
    update_help: str | None = None,
) -> None:
    """A parameter-server job's ``--consistency``, ``--staleness K`` and ``--ps-update``,
    with these defaults."""
    from ringcomm.ps.config import CONSISTENCY_MODES, UPDATE_MODES

    p.add_argument("--consistency", choices=CONSISTENCY_MODES, default=consistency)
    p.add_argument("--staleness", type=int, default=staleness, metavar="K", help=staleness_help)
    p.add_argument("--ps-update", choices=UPDATE_MODES, default=update, help=update_help)
