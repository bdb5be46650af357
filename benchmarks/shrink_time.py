"""Time to a working group after a kill -9: detection, shrink, first collective.

    python benchmarks/shrink_time.py [--worlds 3,4,5,6,7,8] [--trials 3] [--json FILE]

Per world size and trial: W local ranks (rank 0 hosts the store) run 8 B all_reduces;
the victim (rank 0 in odd trials — the store's host, so a survivor serves a new store —,
the last rank in even ones) kills itself with SIGKILL at step 3. Each survivor measures,
from the victim's time.time() just before the kill: ``detect_s`` (its all_reduce raised
PeerFailedError), ``shrink_s`` (``pg.shrink()`` returned), ``first_s`` (the first
all_reduce on the new group returned). Prints the median over trials of the slowest
survivor, per W and victim kind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(victim: int, out: str) -> None:
    import numpy as np

    import ringcomm as rc

    pg = rc.init_process_group(timeout_s=30)
    x = np.ones(2, np.float32)
    try:
        for step in range(10_000):
            if pg.rank == victim and step == 3:
                Path(out, "kill").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            pg.all_reduce(x)
    except rc.PeerFailedError:
        t_detect = time.time()
    new = pg.shrink()
    t_shrink = time.time()
    new.all_reduce(x)
    t_first = time.time()
    Path(out, f"r{pg.rank}").write_text(json.dumps([t_detect, t_shrink, t_first]))
    new.close()


def trial(world: int, victim: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for r in range(world):
            env = dict(
                os.environ,
                RINGCOMM_RANK=str(r),
                RINGCOMM_WORLD_SIZE=str(world),
                RINGCOMM_MASTER_ADDR="127.0.0.1",
                RINGCOMM_MASTER_PORT=str(port),
                RINGCOMM_TOKEN="bench",
            )
            procs.append(
                subprocess.Popen([sys.executable, __file__, "--worker", str(victim), out], env=env)
            )
        for p in procs:
            p.wait(120)
        t_kill = float(Path(out, "kill").read_text())
        times = [json.loads(Path(out, f"r{r}").read_text()) for r in range(world) if r != victim]
    return {
        k: max(t[i] for t in times) - t_kill
        for i, k in enumerate(("detect_s", "shrink_s", "first_s"))
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="3,4,5,6,7,8")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    print("| W | victim | detect (s) | shrunk (s) | first collective (s) |")
    print("|---:|---|---:|---:|---:|")
    for world in map(int, args.worlds.split(",")):
        for kind, victim in (("rank 0 (store host)", 0), ("last rank", world - 1)):
            got = [trial(world, victim) for _ in range(args.trials)]
            med = {k: statistics.median(g[k] for g in got) for k in got[0]}
            rows.append({"world_size": world, "victim": victim, **med, "trials": got})
            print(
                f"| {world} | {kind} | {med['detect_s']:.3f} | {med['shrink_s']:.3f} | "
                f"{med['first_s']:.3f} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
