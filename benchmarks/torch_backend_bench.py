"""dist.all_reduce through the ringcomm torch backend vs Gloo, in the same run.

    python benchmarks/torch_backend_bench.py [-n 2] [-b 8] [-e 64M] [-f 4] [--iters 10]
        [--warmup 2] [--rounds 2] [--native] [--invocations K] [--json FILE] [--md FILE]

Each rank: ``torch.set_num_threads(1)``, ``GLOO_SOCKET_IFNAME=lo``; the default group is
``dist.init_process_group("ringcomm")`` (a FileStore), Gloo is ``dist.new_group(backend=
"gloo")`` over the same ranks. For every size the implementations alternate, ``--rounds``
times (A B A B, BENCHMARKING.md), each block ``--warmup`` untimed calls then ``--iters``
timed ``dist.all_reduce(t, group=...)`` calls back to back; every call's result is checked
first (one checked call per block). Per block each rank takes its median per-call time; a
size's time is the median over blocks of the maximum over ranks. busbw uses nccl-tests'
2(n-1)/n. ``--native`` adds ringcomm's own ``pg.all_reduce`` on the group underneath the
backend (what torch's dispatch and the Work/Future wrapping cost).

``--invocations K`` repeats the whole job K times (fresh processes); the table shows each
size's median over invocations. Output: a table with ratios (stdout, and ``--md``), JSON
lines as ``ringcomm bench`` writes them (``--json``; ``impl`` is ``ringcomm-torch``,
``gloo`` or ``ringcomm``; plus ``invocation``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

IMPLS = ("gloo", "ringcomm-torch")


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text)


def sizes(begin: int, end: int, factor: int) -> list[int]:
    out, s = [], begin
    while s < end:
        out.append(s)
        s *= factor
    out.append(end)
    return out


def _iters_for(nbytes: int, iters: int) -> int:
    """Fewer timed calls for the largest sizes (each takes ~0.1 s or more here)."""
    if nbytes >= 32 << 20:
        return max(3, iters // 3)
    if nbytes >= 4 << 20:
        return max(5, iters // 2)
    return iters


def rank_main(
    rank: int, world_size: int, store_path: str, args: argparse.Namespace, results: Any
) -> None:
    try:
        results.put((rank, "ok", _measure(rank, world_size, store_path, args)))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        results.put((rank, "err", traceback.format_exc()))


def _measure(
    rank: int, world_size: int, store_path: str, args: argparse.Namespace
) -> dict[str, Any]:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import ringcomm.torch_backend  # noqa: F401  (registers "ringcomm")

    torch.set_num_threads(1)
    dist.init_process_group(
        "ringcomm",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    rc_torch = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    native = rc_torch.ringcomm_group
    impls = list(IMPLS) + (["ringcomm"] if args.native else [])
    times: dict[str, dict[int, list[float]]] = {i: {} for i in impls}
    for nbytes in sizes(args.begin, args.end, args.factor):
        count = max(1, nbytes // 4)
        t = torch.empty(count, dtype=torch.float32)
        expected = float(world_size * (world_size + 1) // 2)
        iters = _iters_for(nbytes, args.iters)
        for _ in range(args.rounds):
            for impl in impls:

                def call(impl: str = impl, t: Any = t) -> None:
                    if impl == "ringcomm":
                        native.all_reduce(t.numpy())
                    else:
                        dist.all_reduce(t, group=gloo if impl == "gloo" else rc_torch)

                t.fill_(rank + 1)
                call()
                bad = int((t != expected).sum())
                if bad:
                    raise AssertionError(f"{impl} {nbytes} B: {bad} wrong elements")
                for _ in range(args.warmup):
                    call()
                per = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    call()
                    per.append(time.perf_counter() - t0)
                times[impl].setdefault(nbytes, []).append(statistics.median(per))
    dist.destroy_process_group()
    return times


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=rank_main, args=(r, args.n, path, args, results), daemon=True)
            for r in range(args.n)
        ]
        for p in procs:
            p.start()
        per_rank: dict[int, Any] = {}
        try:
            while len(per_rank) < args.n:
                rank, status, value = results.get(timeout=args.timeout_s)
                if status != "ok":
                    raise SystemExit(f"rank {rank} failed:\n{value}")
                per_rank[rank] = value
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    rows = []
    n = args.n
    for impl in per_rank[0]:
        for nbytes in per_rank[0][impl]:
            blocks = zip(*(per_rank[r][impl][nbytes] for r in range(n)), strict=True)
            t = statistics.median(max(b) for b in blocks)
            algbw = nbytes / t / 1e9
            rows.append(
                {
                    "impl": impl,
                    "op": "all_reduce",
                    "world_size": n,
                    "bytes": nbytes,
                    "count": max(1, nbytes // 4),
                    "dtype": "float32",
                    "time_us": t * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * 2 * (n - 1) / n,
                    "errors": 0,
                }
            )
    return rows


def _median_rows(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (impl, size): the row of the median time over invocations."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["impl"], r["bytes"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["time_us"])[len(v) // 2] for k, v in groups.items()}


def table(rows: list[dict[str, Any]]) -> str:
    by = _median_rows(rows)
    runs = len({r.get("invocation", 0) for r in rows})
    impls = [i for i in ("gloo", "ringcomm-torch", "ringcomm") if any(r["impl"] == i for r in rows)]
    n = rows[0]["world_size"]
    head = ["size"] + [f"{i} µs" for i in impls] + [f"{i} busbw GB/s" for i in impls]
    head += ["time ratio rc-torch/gloo", "busbw ratio rc-torch/gloo"]
    lines = [
        f"all_reduce float32, W={n}, median of {runs} invocation(s)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---:|" * len(head),
    ]
    for nbytes in sorted({r["bytes"] for r in rows}):
        rs = [by[i, nbytes] for i in impls]
        g, c = by["gloo", nbytes], by["ringcomm-torch", nbytes]
        cells = [_fmt_size(nbytes)] + [f"{r['time_us']:.0f}" for r in rs]
        cells += [f"{r['busbw_GBps']:.3f}" for r in rs]
        cells += [f"{c['time_us'] / g['time_us']:.2f}", f"{c['busbw_GBps'] / g['busbw_GBps']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt_size(n: int) -> str:
    for unit, s in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s and n % s == 0:
            return f"{n // s} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("-b", "--begin", type=parse_size, default=8)
    ap.add_argument("-e", "--end", type=parse_size, default=64 << 20)
    ap.add_argument("-f", "--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--invocations", type=int, default=1, help="fresh jobs; medians reported")
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for k in range(args.invocations):
        rows.extend({**r, "invocation": k} for r in run(args))
    text = table(rows)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if args.md:
        with open(args.md, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
