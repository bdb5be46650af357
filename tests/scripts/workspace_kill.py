"""Ranks on one host in an all_reduce on the shared workspace; one is killed (SIGKILL)
while the others wait in a sync. Every survivor writes what its call raised.

    python workspace_kill.py VICTIM NBYTES REPORT_DIR        (rank and world from RINGCOMM_*)

Reports (JSON, in REPORT_DIR): ``kill.R`` (the victim: time.time() just before the kill),
``peer.R`` (a survivor: error type, text, time.time() when it was raised, whether the
group had a workspace).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import ringcomm as rc


def _write(report_dir: str, name: str, value: object) -> None:
    path = os.path.join(report_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    victim, nbytes, report_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    pg = rc.init_process_group(timeout_s=30)
    x = np.ones(max(1, nbytes // 4), np.float32)
    pg.all_reduce(x)  # every rank is in and the workspace works
    if pg.rank == victim:
        _write(report_dir, f"kill.{pg.rank}", time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        pg.all_reduce(x)  # waits for the victim at sync 1
        outcome = ["ok", "", time.time()]
    except rc.RingcommError as exc:
        outcome = [type(exc).__name__, str(exc), time.time()]
    _write(report_dir, f"peer.{pg.rank}", [*outcome, pg.core.workspace is not None])
    os._exit(1 if outcome[0] != "ok" else 0)


if __name__ == "__main__":
    main()
