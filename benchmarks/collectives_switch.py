"""Where a collective should switch algorithms: all_reduce rd -> ring, broadcast tree -> chain.

    python benchmarks/collectives_switch.py [--op all_reduce|broadcast] [--world-sizes 2,4]
                                            [--min 8] [--max 1M] [--reps 5] [--iters 30]
                                            [--algos A,B] [--json FILE]

Local ranks (``rc.spawn``), float32 (sum), the group's default chunk_bytes. For every size
(powers of two from --min to --max bytes) and repetition, the two algorithms alternate
(A B A B, the order flipping every repetition) so machine drift hits both. Operations run back to
back; each rank takes the median of its per-iteration times; we report the maximum over
ranks (nccl-tests' convention), then the median over repetitions, and the ratio rd/ring
taken per repetition (median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import ringcomm as rc
from ringcomm.config import parse_size

PAIRS = {"all_reduce": ("ring", "rd"), "broadcast": ("chain", "tree")}


def job(pg: rc.ProcessGroup, op: str, sizes: list[int], reps: int, iters: int,
        pair: tuple[str, str] | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    run = getattr(pg, op)
    a, b = pair or PAIRS[op]
    for rep in range(reps):
        for nbytes in sizes:
            x = np.ones(max(1, nbytes // 4), np.float32)
            algos = (a, b) if rep % 2 == 0 else (b, a)
            for algo in algos:
                for _ in range(3):  # warm-up
                    run(x, algo=algo)
                times = []
                n_iter = iters if nbytes <= 64 << 10 else max(5, iters // 3)
                for _ in range(n_iter):
                    t0 = time.perf_counter()
                    run(x, algo=algo)
                    times.append(time.perf_counter() - t0)
                out[f"{nbytes}/{algo}/{rep}"] = statistics.median(times)
            pg.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", default="all_reduce", choices=sorted(PAIRS))
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--min", default="8")
    ap.add_argument("--max", default="1M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--algos", default=None, help="the two algorithms to compare, e.g. rd,direct")
    args = ap.parse_args()
    pair = tuple(args.algos.split(",")) if args.algos else PAIRS[args.op]
    sizes = []
    s = parse_size(args.min)
    while s <= parse_size(args.max):
        sizes.append(s)
        s *= 2
    rows = []
    for w in (int(v) for v in args.world_sizes.split(",")):
        per_rank = rc.spawn(
            job, w, args=(args.op, sizes, args.reps, args.iters, pair), timeout_s=1800
        )
        a, b = pair
        print(f"\nW={w}  (median over {args.reps} reps of max-over-ranks per-iteration medians)")
        print(f"{args.op}\n{'bytes':>9} {a + ' us':>10} {b + ' us':>10} {b + '/' + a:>11}")
        for nbytes in sizes:
            t = {
                algo: [
                    max(r[f"{nbytes}/{algo}/{rep}"] for r in per_rank) for rep in range(args.reps)
                ]
                for algo in (a, b)
            }
            ratio = statistics.median(tb / ta for ta, tb in zip(t[a], t[b]))
            a_us, b_us = (statistics.median(t[k]) * 1e6 for k in (a, b))
            print(f"{nbytes:>9} {a_us:>10.1f} {b_us:>10.1f} {ratio:>11.2f}")
            rows.append(
                {
                    "op": args.op,
                    "world_size": w,
                    "bytes": nbytes,
                    f"{a}_us": a_us,
                    f"{b}_us": b_us,
                    f"{b}_over_{a}": ratio,
                }
            )
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
