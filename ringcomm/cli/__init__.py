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
import copy
import importlib
import re
import sys
from collections.abc import Sequence
from typing import cast

from ringcomm._version import __version__
from ringcomm.config import UsageError

__all__ = ["SUBCOMMAND_MODULES", "USAGE_EXIT", "build_parser", "main", "plain_text"]

#: Exit status of a command line that cannot run (as argparse's own errors).
USAGE_EXIT = 2

#: Modules providing ``add_parser(subparsers)`` and ``main(args)``, in help order.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "ringcomm.cli.run",
    "ringcomm.cli.bench",
    "ringcomm.cli.train",
    "ringcomm.cli.ps_server",
    "ringcomm.cli.trace",
    "ringcomm.cli.model",
    "ringcomm.cli.tune",
)


def build_parser() -> argparse.ArgumentParser:
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each subcommand's parser by name."""
    parser = argparse.ArgumentParser(
        prog="ringcomm",
        description="ringcomm: collective communication over ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"ringcomm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands: dict[str, argparse.ArgumentParser] = {}
    for name in SUBCOMMAND_MODULES:
        sub = importlib.import_module(name).add_parser(subparsers)
        _plain_help(sub)
        commands[sub.prog.rsplit(" ", 1)[-1]] = sub
    return parser, commands


# reST in docstrings made help texts: ``x`` and :role:`~a.b` read as x and b.
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str) -> str:
    """``text`` without reStructuredText markup (help is read in a terminal)."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return _LITERAL.sub(r"\1", text)


class _PlainText(argparse.HelpFormatter):
    """A formatter that writes descriptions and options' help as :func:`plain_text`."""

    def add_text(self, text: str | None) -> None:
        super().add_text(plain_text(text) if text else text)

    def add_argument(self, action: argparse.Action) -> None:
        text = action.help
        if text:
            action = copy.copy(action)
            action.help = plain_text(text)
        super().add_argument(action)


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Plain text in ``parser``'s description and its options' help (its formatter class,
    whichever it is, with :class:`_PlainText` in front)."""
    base = cast("type[argparse.HelpFormatter]", parser.formatter_class)
    name = f"Plain{getattr(base, '__name__', 'Formatter')}"
    plain: type[argparse.HelpFormatter] = type(name, (_PlainText, base), {})
    parser.formatter_class = plain


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ringcomm`` console script and of ``python -m ringcomm``."""
    parser, commands = _build()
    args, extra = parser.parse_known_args(argv)
    if extra:  # an option the subcommand does not know: said against its own usage
        sub = commands.get(getattr(args, "command", None) or "", parser)
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
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
