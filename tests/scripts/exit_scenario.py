"""One rank goes down in one way while its peers are somewhere; everyone reports.

    python exit_scenario.py CAUSE WHERE FAILING REPORT_DIR      (under any launcher)
    exit_scenario.scenario(pg, CAUSE, WHERE, FAILING, REPORT_DIR)  (rc.spawn)

CAUSE: exception | sys_exit | os_exit | sigterm | keyboard | normal_end | sighup (each without
``close()``); WHERE the peers are when it happens: idle | collective | async | subgroup;
FAILING: a rank number, or -1 for the last rank.

Order without sleeps: after a first all_reduce every peer sends the failing rank a
message on tag 99 just before it goes where WHERE says (an idle peer before it idles),
and the failing rank goes down once it has every peer's. An idle peer is one computing
outside ringcomm (a wait of IDLE_S); then it makes its next call: ``close()`` after a
plain departure, else an all_reduce.

Reports in REPORT_DIR (JSON, one file per rank): ``pid.R`` (pid), ``fail.R`` (the failing
rank: when it went down, time.time()), ``peer.R`` (a peer: what its call raised, when, or
``"ok"``). A peer that caught an error re-raises it (it exits 1, as a user script would).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np

CAUSES = ("exception", "sys_exit", "os_exit", "sigterm", "keyboard", "normal_end")
WHERES = ("idle", "collective", "async", "subgroup")
IDLE_S = 2.5
EXIT_CODE = 3


def _write(report_dir: str, name: str, value: object) -> None:
    path = os.path.join(report_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def _go_down(cause: str, rank: int) -> None:
    if cause == "exception":
        raise RuntimeError(f"user bug on rank {rank}")
    if cause == "sys_exit":
        sys.exit(EXIT_CODE)
    if cause == "os_exit":
        os._exit(EXIT_CODE)
    if cause in ("sigterm", "sighup"):
        os.kill(os.getpid(), signal.SIGTERM if cause == "sigterm" else signal.SIGHUP)
    elif cause == "keyboard":
        os.kill(os.getpid(), signal.SIGINT)
    elif cause != "normal_end":
        raise ValueError(f"unknown cause {cause!r}")
    if cause in ("sigterm", "sighup", "keyboard"):  # the signal acts at the next bytecode
        threading.Event().wait(30)
        raise AssertionError(f"rank {rank}: still alive 30 s after {cause}")


def scenario(pg, cause: str, where: str, failing: int, report_dir: str) -> str:
    import ringcomm as rc

    rank, world = pg.rank, pg.world_size
    failing = failing % world
    _write(report_dir, f"pid.{rank}", os.getpid())
    x = np.ones(1000, np.float32)
    pg.all_reduce(x)
    token = np.zeros(1, np.int64)
    if rank == failing:
        for peer in range(world):
            if peer != rank:
                pg.recv(token, src=peer, tag=99, timeout_s=30)
        _write(report_dir, f"fail.{rank}", time.time())
        _go_down(cause, rank)
        return "left"  # normal_end: the script ends without close()
    sub = pg.new_group(list(reversed(range(world)))) if where == "subgroup" else None
    pg.send(token, dst=failing, tag=99)
    try:
        if where == "idle":
            threading.Event().wait(IDLE_S)  # computing, outside ringcomm
            if cause == "normal_end":
                pg.close()
            else:
                pg.all_reduce(x, timeout_s=30)
        elif where == "collective":
            pg.all_reduce(x, timeout_s=30)
        elif where == "async":
            pg.all_reduce(x, async_op=True).wait(timeout_s=30)
        elif where == "subgroup":
            sub.all_reduce(x, timeout_s=30)
        else:
            raise ValueError(f"unknown where {where!r}")
    except rc.RingcommError as exc:
        _write(
            report_dir,
            f"peer.{rank}",
            {
                "type": type(exc).__name__,
                "message": str(exc),
                "t": time.time(),
            },
        )
        raise
    _write(report_dir, f"peer.{rank}", {"type": "ok", "message": "", "t": time.time()})
    pg.close()
    return "ok"


if __name__ == "__main__":
    import ringcomm as rc

    cause_arg, where_arg, failing_arg, dir_arg = sys.argv[1:5]
    group = rc.init_process_group(timeout_s=60)
    scenario(group, cause_arg, where_arg, int(failing_arg), dir_arg)
