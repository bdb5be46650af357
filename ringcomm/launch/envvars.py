"""The variables ``ringcomm run`` sets for every rank, ``--env VAR[=VAL]``, and the other
options both launchers read alike (pure).

Shared by the local (:mod:`.local`) and multi-host (:mod:`.ssh`) launchers.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence

from ringcomm.config import UsageError

__all__ = [
    "RESERVED_VARS",
    "TOKEN_VAR",
    "is_var_name",
    "master_port_option",
    "parse_env_options",
    "position_vars",
    "script_args",
    "stop_restart_options",
]

#: The job token's variable: never on a command line (``--dry-run`` does not show it).
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
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_var_name(name: str) -> bool:
    """Whether ``name`` can be an environment variable's name (``[A-Za-z_][A-Za-z0-9_]*``)."""
    return _VAR_NAME.fullmatch(name) is not None


def parse_env_options(
    options: Sequence[str], environ: Mapping[str, str]
) -> tuple[tuple[str, str], ...]:
    """``--env VAR=VAL`` sets VAR; ``--env VAR`` copies the launcher's VAR (must be set)."""
    out: dict[str, str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not is_var_name(name):
            raise UsageError(f"--env {option!r}: {name!r} is not a valid variable name")
        if name in RESERVED_VARS:
            raise UsageError(f"--env {name}: set by the launcher for every rank; cannot override")
        if not sep:
            copied = environ.get(name)
            if copied is None:
                raise UsageError(f"--env {name}: not set in the launcher's environment")
            value = copied
        out[name] = value
    return tuple(out.items())


def master_port_option(port: int | None) -> int:
    """``--master-port``, the store's: 0 (the OS picks one at launch) when not given."""
    port = 0 if port is None else port
    if not 0 <= port <= 65535:
        raise UsageError(f"--master-port must be in 0..65535, got {port}")
    return port


def stop_restart_options(args: argparse.Namespace) -> int:
    """Check ``--grace-s``; return ``--max-restarts`` (0 where the parser has none)."""
    if not args.grace_s >= 0:
        raise UsageError(f"--grace-s must be >= 0, got {args.grace_s}")
    max_restarts: int = getattr(args, "max_restarts", 0) or 0
    if max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {max_restarts}")
    return max_restarts


def script_args(target_args: Sequence[str]) -> tuple[str, ...]:
    """The script's arguments: what follows it on the command line, less a leading ``--``."""
    args = list(target_args)
    return tuple(args[1:] if args[:1] == ["--"] else args)


def position_vars(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    master_addr: str,
    master_port: int | str,
    torch_port: int | str | None = None,
) -> dict[str, str]:
    """Where a rank stands in its job, under torchrun's names and ringcomm's own.

    ``MASTER_PORT`` (torch's ``env://``) is ``torch_port`` where given, else the store's
    ``master_port`` (``RINGCOMM_MASTER_PORT``)."""
    rank_s, world, port = str(rank), str(world_size), str(master_port)
    return {
        "RANK": rank_s,
        "WORLD_SIZE": world,
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": port if torch_port is None else str(torch_port),
        "RINGCOMM_RANK": rank_s,
        "RINGCOMM_WORLD_SIZE": world,
        "RINGCOMM_MASTER_ADDR": master_addr,
        "RINGCOMM_MASTER_PORT": port,
    }
