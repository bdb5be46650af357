"""CPU, context switches and threads per small blocking all_reduce, two trees interleaved.

    python benchmarks/latency_cpu_ab.py --trees BEFORE_TREE AFTER_TREE -n 4 \\
        --calls 3000 --reps 4

A tree may carry environment settings for its runs: ``TREE:VAR=VALUE,VAR2=VALUE2``.

Each rep runs one ``rc.spawn`` job per tree (A B A B ...; the same script, ``PYTHONPATH``
pointing at the tree). Every rank times ``--calls`` 8 B all_reduces after a warm-up and
reports: median wall per call, its main thread's CPU per call (``thread_time``; and the
system part of it, ``getrusage(RUSAGE_THREAD)``), the whole
process's CPU per call (``process_time``: every thread, pyzmq's authenticator and libzmq's
I/O threads included), voluntary and involuntary context switches per call
(``getrusage``), and how many threads the process runs. Prints per-tree medians over reps
of the max over ranks (wall) and of the mean over ranks (CPU, switches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def _rank(pg, nbytes, calls):  # type: ignore[no-untyped-def]
    import resource
    import threading
    import time

    import numpy as np

    x = np.ones(max(1, nbytes // 4), np.float32)
    for _ in range(300):
        pg.all_reduce(x)
    pg.barrier()
    clock = time.perf_counter
    times = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0_thread = resource.getrusage(resource.RUSAGE_THREAD)
    cpu0, pcpu0 = time.thread_time(), time.process_time()
    for _ in range(calls):
        t0 = clock()
        pg.all_reduce(x)
        times.append(clock() - t0)
    cpu, pcpu = time.thread_time() - cpu0, time.process_time() - pcpu0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    t1_thread = resource.getrusage(resource.RUSAGE_THREAD)
    return {
        "wall_us": statistics.median(times) * 1e6,
        "main_cpu_us": cpu / calls * 1e6,
        "main_sys_us": (t1_thread.ru_stime - t0_thread.ru_stime) / calls * 1e6,
        "proc_cpu_us": pcpu / calls * 1e6,
        "vcsw": (r1.ru_nvcsw - r0.ru_nvcsw) / calls,
        "ivcsw": (r1.ru_nivcsw - r0.ru_nivcsw) / calls,
        "py_threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
    }


def _child(world: int, nbytes: int, calls: int) -> None:
    import ringcomm as rc

    rows = rc.spawn(_rank, world, (nbytes, calls), timeout_s=600)
    print(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="+", required=True)
    p.add_argument("-n", "--world", type=int, default=4)
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        _child(a.world, a.bytes, a.calls)
        return
    keys = ["wall_us", "main_cpu_us", "main_sys_us", "proc_cpu_us", "vcsw", "ivcsw"]
    agg: dict[str, dict[str, list[float]]] = {t: {k: [] for k in keys} for t in a.trees}
    threads: dict[str, tuple[int, int]] = {}
    for rep in range(a.reps):
        for tree in a.trees:
            path, _, extra = tree.partition(":")
            env = dict(os.environ, PYTHONPATH=path)
            env.update(kv.split("=", 1) for kv in extra.split(",") if kv)
            out = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--child",
                    "-n",
                    str(a.world),
                    "--bytes",
                    str(a.bytes),
                    "--calls",
                    str(a.calls),
                    "--trees",
                    path,
                ],
                env=env,
                check=True,
                capture_output=True,
                text=True,
                cwd=path,
            ).stdout
            rows = json.loads(out.strip().splitlines()[-1])
            agg[tree]["wall_us"].append(max(r["wall_us"] for r in rows))
            for k in keys[1:]:
                agg[tree][k].append(statistics.mean(r[k] for r in rows))
            threads[tree] = (rows[0]["py_threads"], rows[0]["os_threads"])
            line = " ".join(f"{k}={agg[tree][k][-1]:.2f}" for k in keys)
            print(f"rep {rep} {tree}: {line} threads(py,os)={threads[tree]}", flush=True)
    print(f"\nW={a.world}, {a.bytes} B, {a.calls} calls x {a.reps} reps; medians over reps:")
    for tree in a.trees:
        line = " ".join(f"{k}={statistics.median(agg[tree][k]):.2f}" for k in keys)
        print(f"{tree}: {line} threads(py,os)={threads[tree]}")


if __name__ == "__main__":
    main()
