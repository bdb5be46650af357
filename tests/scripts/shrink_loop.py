"""A loop of collectives in which one rank is killed (SIGKILL); the survivors shrink the
group and check 10 collectives on the new one. Every survivor writes what happened.

    python shrink_loop.py VICTIM KILL_STEP REPORT_DIR [SECOND_VICTIM]
                                        (rank, world and master from RINGCOMM_*)

The victim kills itself at step KILL_STEP of the loop (before its all_reduce of that step).
SECOND_VICTIM (optional) kills itself during the shrink: inside ``shrink()``, as soon as
its own view is in the store (``shrink/1/<rank>``).
Reports (JSON, in REPORT_DIR): ``kill.R`` (time.time() just before the kill) and
``peer.R`` for a survivor: {"error", "text", "t_error", "t_shrunk", "members", "rank",
"world_size", "ok"}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import ringcomm as rc
from ringcomm.rendezvous import Store


def _write(report_dir: str, name: str, value: object) -> None:
    path = os.path.join(report_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def _die(report_dir: str, rank: int) -> None:
    _write(report_dir, f"kill.{rank}", time.time())
    os.kill(os.getpid(), signal.SIGKILL)


def _die_in_shrink(me: int, report_dir: str) -> None:
    """Make this process die inside ``shrink()``, right after it published its view (so the
    others have seen it join): every Store's ``set`` of ``shrink/1/<me>`` kills it once the
    value is stored, whichever store the shrink uses (rank 0's, or the failover one)."""
    key = f"shrink/1/{me}"
    original = Store.set

    def set_then_die(self: Store, k: str, value: bytes) -> None:
        original(self, k, value)
        if k == key:
            _die(report_dir, me)

    Store.set = set_then_die  # type: ignore[method-assign]


def main() -> None:
    victim, kill_step, report_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    second = int(sys.argv[4]) if len(sys.argv) > 4 else None
    pg = rc.init_process_group(timeout_s=20)
    me, n = pg.rank, pg.world_size
    report: dict[str, object] = {"old_rank": me}
    try:
        for step in range(1000):
            if me == victim and step == kill_step:
                _die(report_dir, me)
            x = np.full(1000, me + 1, np.int64)
            pg.all_reduce(x)
            assert (x == n * (n + 1) // 2).all()
        raise AssertionError("the victim never failed")
    except rc.PeerFailedError as exc:
        report.update(error=type(exc).__name__, text=str(exc), t_error=time.time())
    if me == second:
        _die_in_shrink(me, report_dir)
    try:
        new = pg.shrink()
    except rc.RingcommError as exc:
        report.update(shrink_error=type(exc).__name__, shrink_text=str(exc), t_shrunk=time.time())
        _write(report_dir, f"peer.{me}", report)
        os._exit(3)
    report.update(
        t_shrunk=time.time(),
        members=list(new.core.state.peers),
        rank=new.rank,
        world_size=new.world_size,
    )
    ok = True
    for i in range(10):  # the next 10 collectives on the new group, checked
        y = np.full(257, float(me * 10 + i), np.float64)  # values from the old rank
        new.all_reduce(y)
        survivors = [r for r in range(n) if r != victim and r != second]
        ok &= bool((y == sum(r * 10 + i for r in survivors)).all())
        z = new.all_gather(np.array([me], np.int32))
        ok &= z.ravel().tolist() == survivors
    report["ok"] = ok
    new.close()
    _write(report_dir, f"peer.{me}", report)


if __name__ == "__main__":
    main()
