"""An elastic loop under ``ringcomm run --max-restarts K``: one rank slot kills itself
(SIGKILL) at a step; the survivors shrink and go on; the launcher starts the slot again,
the survivors admit it with ``grow()`` at a step boundary, and the loop ends on the full
group. Every step's all_reduce is checked against the members of that step.

    ringcomm run -n N --max-restarts 1 elastic_loop.py VICTIM KILL_STEP STEPS REPORT_DIR

Reports ``REPORT_DIR/slot.<slot>.<restart>`` (JSON): the step and rank slots of each
membership change this process saw, and the steps it checked.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

import ringcomm as rc


def main() -> None:
    victim, kill_step, steps, report_dir = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
    )
    restart = int(os.environ.get("RINGCOMM_RESTART", "0"))
    pg = rc.init_process_group(timeout_s=30)
    slot = pg.core.state.slots[pg.rank]
    total = pg.core.state.slots_total
    changes: list[list[object]] = []
    checked = 0
    step = 0
    grew_at = 0
    tell = pg.rejoined  # admitted by the survivors' grow(): they tell where the loop is
    if tell:
        changes.append([None, "rejoined", list(pg.core.state.slots)])
    while True:
        if not tell:
            try:
                grown = pg.grow()  # a collective of the survivors (every step boundary)
            except rc.PeerFailedError:  # a rank went right after the last step's all_reduce
                pg = pg.shrink()
                changes.append([step, "shrank", list(pg.core.state.slots)])
                continue
            tell = grown is not pg
            if tell:
                pg = grown
                changes.append([step, "grew", list(pg.core.state.slots)])
        if tell:  # the group grew: the rejoined rank learns the step
            at = np.array([step], np.int64)
            pg.all_reduce(at, op="max")  # (the rejoined rank's is 0)
            step, tell = int(at[0]), False
            grew_at = step
        # The same on every rank: stop at STEPS once every slot is back, 5 steps after.
        if step >= max(steps, grew_at + 5) and len(pg.core.state.slots) == total:
            break
        if slot == victim and restart == 0 and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        x = np.full(64, slot + 1, np.int64)
        try:
            pg.all_reduce(x)
        except rc.PeerFailedError:
            pg = pg.shrink()
            changes.append([step, "shrank", list(pg.core.state.slots)])
            continue  # the same step again, on the survivors
        want = sum(s + 1 for s in pg.core.state.slots)
        assert (x == want).all(), (step, x[0], want)
        checked += 1
        step += 1
    with open(os.path.join(report_dir, f"slot.{slot}.{restart}"), "w") as f:
        json.dump(
            {
                "changes": changes,
                "checked": checked,
                "final": list(pg.core.state.slots),
                "last_step": step,
            },
            f,
        )
    pg.close()


if __name__ == "__main__":
    main()
