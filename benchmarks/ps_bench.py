"""Parameter-server push/pull latency and throughput vs all_reduce of the same size, same run.

    python benchmarks/ps_bench.py [-w 2] [-s 1] [-b 1K] [-e 16M] [-f 4] [--iters 10] [--reps 3]
                                  [--json FILE]

One spawned job: ``s`` server ranks and ``w`` worker ranks. For each size (bytes of one
worker's float32 gradient), on the workers, repetitions alternate the implementations
(ps, all_reduce, ps, all_reduce, ...) so that machine drift hits both:

* ``push_pull``: bsp, worker update (the server only averages), one key of that size
  (split over all servers when ``s > 1``): the gradient exchange of one data-parallel step
  through the parameter server; ``push`` and ``pull`` alone as well (a push is answered by
  an acknowledgement; the pulls read the step the pushes completed);
* ``all_reduce``: ``op="avg"`` over the workers' own sub-group, the same exchange as a
  collective.

Each rank takes the median over ``iters`` back-to-back calls per repetition; a row reports
the median over repetitions of the slowest worker's median. algbw = size / time (GB/s =
1e9 B/s). Servers are extra processes: on a machine with fewer cores than ``w + s`` ranks,
they compete with the workers for cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

import ringcomm as rc
from ringcomm import ps
from ringcomm.config import parse_size

IMPLS = ("push", "pull", "push_pull", "all_reduce")


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def _job(pg: Any, workers: int, servers: int, sizes: list[int], iters: int, reps: int) -> Any:
    wgroup = pg.new_group(list(range(servers, servers + workers)))
    cfg = ps.PSConfig(num_workers=workers, update="worker", timeout_s=120)
    role = ps.start(pg, cfg, servers, slicer=ps.HashSlicer(split_min_bytes=64 << 10))
    if isinstance(role, ps.PSServer):
        return None
    kv = role
    times: dict[tuple[str, int], list[float]] = {}
    for key, nbytes in enumerate(sizes):
        n = nbytes // 4
        g = np.full(n, float(kv.index + 1), np.float32)
        out = np.empty(n, np.float32)
        x = np.empty(n, np.float32)
        kv.init(key, g).wait()
        for _ in range(2):  # warm-up: connections, first-touch of buffers
            kv.push_pull(key, g, out).wait()
            kv.advance()
            x[...] = g
            wgroup.all_reduce(x, op="avg")
        expect = np.float32(sum(range(1, workers + 1)) / workers)
        for _rep in range(reps):
            for impl in IMPLS:
                per = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    if impl == "push_pull":
                        kv.push_pull(key, g, out).wait()
                        kv.advance()
                    elif impl == "push":
                        kv.push(key, g).wait()
                        kv.advance()
                    elif impl == "pull":
                        kv.pull(key, out).wait()
                    else:
                        x[...] = g  # (outside the timing would need a second timer; 1 copy)
                        wgroup.all_reduce(x, op="avg")
                    per.append(time.perf_counter() - t0)
                if impl == "push_pull":
                    assert np.all(out == expect), f"push_pull average wrong at {nbytes} B"
                if impl == "all_reduce":
                    assert np.all(x == expect), f"all_reduce average wrong at {nbytes} B"
                times.setdefault((impl, nbytes), []).append(statistics.median(per))
    kv.close()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-w", "--workers", type=int, default=2)
    ap.add_argument("-s", "--servers", type=int, default=1)
    ap.add_argument("-b", "--minbytes", type=parse_size, default=1 << 10)
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=16 << 20)
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="FILE")
    a = ap.parse_args(argv)
    sizes = _sizes(a.minbytes, a.maxbytes, a.stepfactor)
    res = rc.spawn(
        _job,
        a.servers + a.workers,
        args=(a.workers, a.servers, sizes, a.iters, a.reps),
        timeout_s=1800,
    )
    per_worker = [r for r in res if r is not None]
    rows = []
    for nbytes in sizes:
        row: dict[str, Any] = {"bytes": nbytes, "workers": a.workers, "servers": a.servers}
        for impl in IMPLS:
            # per repetition: the slowest worker; then the median over repetitions
            slowest = [max(w[(impl, nbytes)][r] for w in per_worker) for r in range(a.reps)]
            t = statistics.median(slowest)
            row[f"{impl}_us"] = round(t * 1e6, 1)
            row[f"{impl}_GBps"] = round(nbytes / t / 1e9, 3)
        row["push_pull_vs_all_reduce"] = round(row["push_pull_us"] / row["all_reduce_us"], 2)
        rows.append(row)
    head = (
        f"{'bytes':>10} "
        + " ".join(f"{i + ' us':>14} {'GB/s':>7}" for i in IMPLS)
        + f" {'pp/ar':>6}"
    )
    print(
        f"# ps_bench: {a.workers} workers, {a.servers} server(s), float32, bsp worker update; "
        f"median of {a.reps} reps x {a.iters} iters"
    )
    print(head)
    for r in rows:
        cells = " ".join(f"{r[f'{i}_us']:>14.1f} {r[f'{i}_GBps']:>7.3f}" for i in IMPLS)
        print(f"{r['bytes']:>10} {cells} {r['push_pull_vs_all_reduce']:>6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
