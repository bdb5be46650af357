"""The ``ringcomm`` command line: ``ringcomm [--version] COMMAND ...``.

Each subcommand lives in its own module, which provides a pair:

* ``add_parser(subparsers) -> argparse.ArgumentParser``: registers the subcommand and its
  options, and sets ``main=<its main>`` as the parser's default;
* ``main(args: argparse.Namespace) -> int``: runs it and returns the exit status.

To add a subcommand, add its module to :data:`SUBCOMMAND_MODULES`.

One error path for command lines that cannot run: argparse's own errors (unknown options,
bad ``type=`` values) print the usage and ``ringcomm <command>: error: ...`` and exit 2; a
subcommand raises :class:`~ringcomm.config.UsageError` for the rest (checks across
options, missing optional dependencies, bad environment settings), which :func:`main`
prints as ``ringcomm <command>: error: <message>`` and turns into exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ringcomm._version import __version__
from ringcomm.config import UsageError

__all__ = ["SUBCOMMAND_MODULES", "USAGE_EXIT", "build_parser", "main"]

#: Exit status of a command line that cannot run (as argparse's own errors).
USAGE_EXIT = 2

#: Modules providing ``add_parser(subparsers)`` and ``main(args)``, in help order.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "ringcomm.launch.cli",
    "ringcomm.bench.cli",
    "ringcomm.engine.cli",
    "ringcomm.ps.cli",
    "ringcomm.trace_cli",
    "ringcomm.model_cli",
    "ringcomm.tune_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringcomm",
        description="ringcomm: collective communication over ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"ringcomm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ringcomm`` console script and of ``python -m ringcomm``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command_main = getattr(args, "main", None)
    if command_main is None:
        parser.print_help(sys.stderr)
        return USAGE_EXIT
    try:
        return int(command_main(args))
    except (UsageError, argparse.ArgumentError) as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT


if __name__ == "__main__":
    sys.exit(main())
