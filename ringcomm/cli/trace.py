"""``ringcomm trace DIR [--chrome FILE] [--json]``: read the ranks' flight records.

``DIR`` holds the ``rank<N>.json`` files the ranks wrote (``RINGCOMM_TRACE_DIR``; see
:mod:`ringcomm.core.flight`). Prints the desync report: first the answer (the rank that is
behind or missing, and the op the others waited in; or a mismatch), then per group every
rank's latest operation. ``--chrome FILE``
also writes a Chrome/Perfetto trace (open it in ui.perfetto.dev or chrome://tracing).
Exit status: 0; 1 if ``DIR`` holds no trace file or an unreadable one.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ringcomm.config import UsageError, check_output_path
from ringcomm.core.flight import chrome_trace, desync_report, load_dir

__all__ = ["add_parser", "main"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "trace",
        help="read the ranks' flight records: who is behind, and a Chrome trace",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("dir", help="the RINGCOMM_TRACE_DIR the ranks wrote to")
    p.add_argument("--chrome", metavar="FILE", help="write a Chrome/Perfetto trace (JSON)")
    p.add_argument(
        "--world-size", type=int, default=None, help="ranks expected (to name those without a file)"
    )
    p.set_defaults(main=main)
    return p


def main(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size < 1:
        raise UsageError("--world-size must be >= 1")
    check_output_path(args.chrome, "--chrome")
    try:
        files = load_dir(args.dir)
    except ValueError as exc:
        print(f"ringcomm trace: {exc}", file=sys.stderr)
        return 1
    if not files:
        print(f"ringcomm trace: no trace files (rank*.json) in {args.dir}", file=sys.stderr)
        return 1
    print(desync_report(files, args.world_size))
    if args.chrome:
        with open(args.chrome, "w") as f:
            json.dump(chrome_trace(files), f)
        print(f"wrote {args.chrome} (Chrome/Perfetto trace, one track per rank)")
    return 0
