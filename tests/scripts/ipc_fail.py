"""Ranks on one host in collectives of stand-in device arrays over device windows
(``algo="ipc"``); one is killed (SIGKILL) in the middle of a call. Every survivor writes
what its call raised.

    python ipc_fail.py VICTIM MODE REPORT_DIR        (rank and world from RINGCOMM_*)

MODE: ``copy`` (the victim dies inside a copy its stream runs), ``sync`` (at a host sync
between two rounds), ``shrink`` (it dies between calls; the survivors shrink the group and
run collectives on the new one, whose windows they exchange afresh).
Reports (JSON, in REPORT_DIR): ``kill.R`` (the victim: time.time() just before the kill),
``peer.R`` (a survivor: {"error", "text", "t_error", ...}).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

import ringcomm as rc
import ringcomm.collectives.workspace as ws_coll
import ringcomm.device.ipc as dipc
from ringcomm.device.standin import standin_array


def _write(report_dir: str, name: str, value: object) -> None:
    path = os.path.join(report_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def _die(report_dir: str, rank: int) -> None:
    _write(report_dir, f"kill.{rank}", time.time())
    os.kill(os.getpid(), signal.SIGKILL)


def _all_reduce(pg: rc.ProcessGroup, count: int = 5000) -> bool:
    n = pg.world_size
    x = standin_array(np.full(count, pg.rank + 1, np.int64))
    pg.all_reduce(x)
    return bool(np.all(x.get() == n * (n + 1) // 2))


def main() -> None:
    victim, mode, report_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    pg = rc.init_process_group(timeout_s=20)
    me = pg.rank
    assert _all_reduce(pg)  # every rank is in and the windows are open
    ext: Any = pg.core.workspace_calls.extensions["ipc"]
    dev = ext.device
    dead_handle = ext.handles[victim] if me != victim else None
    if me == victim:
        if mode == "copy":  # the 40th copy the stream runs from now on kills it
            real = dipc.StandinIpcDevice.copy
            count = [0]

            def copy(self: Any, stream: Any, dst: Any, src: Any) -> None:
                def maybe_die() -> None:
                    count[0] += 1
                    if count[0] == 40:
                        _die(report_dir, me)

                stream.enqueue(maybe_die)
                real(self, stream, dst, src)

            dipc.StandinIpcDevice.copy = copy  # type: ignore[method-assign]
        elif mode == "sync":  # the 5th host sync from now on kills it
            real_sync = ws_coll.WorkspaceCollectives.sync
            seen = [0]

            def sync(self: Any, job: Any, where: str) -> None:
                seen[0] += 1
                if seen[0] == 5:
                    _die(report_dir, me)
                real_sync(self, job, where)

            ws_coll.WorkspaceCollectives.sync = sync  # type: ignore[method-assign]
        else:
            _die(report_dir, me)
    report: dict[str, Any] = {}
    try:
        for _ in range(3):
            _all_reduce(pg, 20_000)
        report.update(error="ok", text="", t_error=time.time())
    except rc.RingcommError as exc:
        report.update(error=type(exc).__name__, text=str(exc), t_error=time.time())
    if mode != "shrink":
        _write(report_dir, f"peer.{me}", report)
        os._exit(1 if report["error"] != "ok" else 0)
    new = pg.shrink()
    report["ok"] = all(_all_reduce(new) for _ in range(5))
    cache = dev.cache
    report.update(
        opens=cache.opens,
        closes=cache.closes,
        open_now=len(cache),
        dead_dropped=dead_handle not in cache,
    )
    _write(report_dir, f"peer.{me}", report)
    new.close()
    os._exit(0)


if __name__ == "__main__":
    main()
