"""Small-message latency of several trees, interleaved: the lead's exact bench command.

    python benchmarks/latency_w4_ab.py --trees BEFORE_TREE AFTER_TREE -n 4 --reps 8

Runs ``PYTHONPATH=TREE python -m ringcomm bench all_reduce -n N -b 8 -e 8 --iters 1000
--warmup 100 -q --json F`` once per tree per rep, in the order A B C A B C ..., and prints
every row, then per tree the median over reps of ``time_us`` (median per rank, max over
ranks) and ``p50_us``, and each tree's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="+", required=True)
    p.add_argument("-n", "--world", type=int, default=4)
    p.add_argument("--size", default="8")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--reps", type=int, default=8)
    a = p.parse_args()
    got: dict[str, dict[str, list[float]]] = {t: {"time_us": [], "p50_us": []} for t in a.trees}
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        for rep in range(a.reps):
            for tree in a.trees:
                cmd = [
                    sys.executable,
                    "-m",
                    "ringcomm",
                    "bench",
                    "all_reduce",
                    "-n",
                    str(a.world),
                    "-b",
                    a.size,
                    "-e",
                    a.size,
                    "--iters",
                    str(a.iters),
                    "--warmup",
                    str(a.iters // 10),
                    "-q",
                    "--json",
                    path,
                ]
                env = dict(os.environ, PYTHONPATH=tree)
                subprocess.run(cmd, env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
                with open(path) as f:
                    row = json.loads(f.readline())
                for k in got[tree]:
                    got[tree][k].append(row[k])
                print(
                    f"rep {rep} {tree}: time_us={row['time_us']:.1f} p50_us={row['p50_us']:.1f}",
                    flush=True,
                )
    finally:
        os.unlink(path)
    base = statistics.median(got[a.trees[0]]["time_us"])
    print(f"\nall_reduce {a.size} B, W={a.world}, {a.iters} iters, {a.reps} reps interleaved:")
    for tree in a.trees:
        t = statistics.median(got[tree]["time_us"])
        p50 = statistics.median(got[tree]["p50_us"])
        print(
            f"{tree}: median time_us {t:.1f} (ratio {t / base:.3f}), median p50_us {p50:.1f}, "
            f"time_us min/max {min(got[tree]['time_us']):.1f}/{max(got[tree]['time_us']):.1f}"
        )


if __name__ == "__main__":
    main()
