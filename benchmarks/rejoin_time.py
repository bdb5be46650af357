"""Time to rejoin: a rank slot killed (SIGKILL) under ``ringcomm run --max-restarts 1``
is started again and admitted by the survivors' ``grow()`` at a step boundary.

    python benchmarks/rejoin_time.py [--worlds 3,4,5,6,7,8] [--trials 3] [--json FILE]

Per world size and trial: W ranks run 8 B all_reduces, calling ``grow()`` before each;
the last slot kills itself at step 3; the survivors shrink and go on. From the victim's
time.time() just before the kill: ``shrunk_s`` (the slowest survivor's ``shrink()``
returned), ``restarted_s`` (the new process's first line ran: the launcher saw the exit
and started it again), ``rejoined_s`` (its ``init_process_group()`` returned: admitted),
``grown_s`` (the slowest survivor's first all_reduce on the full group returned).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_IMPORT = time.time()


def worker(out: str) -> None:
    import numpy as np

    import ringcomm as rc

    restart = int(os.environ.get("RINGCOMM_RESTART", "0"))
    pg = rc.init_process_group(timeout_s=30)
    t_admitted = time.time()
    world = pg.core.state.slots_total
    slot = pg.slot
    victim = world - 1
    x = np.ones(2, np.float32)
    times: dict[str, float] = {}
    if pg.rejoined:
        times.update(restarted=T_IMPORT, rejoined=t_admitted)
    step, grown_at = 0, None
    skip_grow = pg.rejoined  # admitted: the survivors' grow() that admitted it is done
    while True:
        grown = pg if skip_grow else pg.grow()
        skip_grow = False
        if grown is not pg:
            pg = grown
            grown_at = step
        if slot == victim and restart == 0 and step == 3:
            Path(out, "kill").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            pg.all_reduce(x)
        except rc.PeerFailedError:
            pg = pg.shrink()
            times["shrunk"] = time.time()
            continue
        if grown_at is not None and "grown" not in times:
            times["grown"] = time.time()
        if pg.rejoined or grown_at is not None:
            stop = np.array([1 if len(pg.core.state.slots) == world else 0], np.int64)
            pg.all_reduce(stop, op="min")
            if stop[0]:
                break
        step += 1
    Path(out, f"s{slot}.{restart}").write_text(json.dumps(times))
    pg.close()


def trial(world: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "ringcomm",
            "run",
            "-n",
            str(world),
            "--max-restarts",
            "1",
            __file__,
            "--worker",
            out,
        ]
        subprocess.run(cmd, check=True, timeout=120)
        t_kill = float(Path(out, "kill").read_text())
        survivors = [json.loads(Path(out, f"s{s}.0").read_text()) for s in range(world - 1)]
        back = json.loads(Path(out, f"s{world - 1}.1").read_text())
    return {
        "shrunk_s": max(t["shrunk"] for t in survivors) - t_kill,
        "restarted_s": back["restarted"] - t_kill,
        "rejoined_s": back["rejoined"] - t_kill,
        "grown_s": max(t["grown"] for t in survivors) - t_kill,
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="3,4,5,6,7,8")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    print("| W | shrunk (s) | restarted (s) | rejoined (s) | full group's first collective (s) |")
    print("|---:|---:|---:|---:|---:|")
    for world in map(int, args.worlds.split(",")):
        got = [trial(world) for _ in range(args.trials)]
        med = {k: statistics.median(g[k] for g in got) for k in got[0]}
        rows.append({"world_size": world, **med, "trials": got})
        print(
            f"| {world} | {med['shrunk_s']:.3f} | {med['restarted_s']:.3f} | "
            f"{med['rejoined_s']:.3f} | {med['grown_s']:.3f} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
