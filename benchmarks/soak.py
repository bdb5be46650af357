"""Soak: many small and large collectives; resident memory and open descriptors must not grow.

Every rank runs ``--small`` small collectives (8 B - 1 KiB all_reduce, broadcast,
all_gather, barrier, in a fixed mix) and ``--large`` large ones (``--large-bytes``
all_reduce, reduce_scatter, all_gather), checking every result, and samples its resident
memory and open file descriptors (``/proc/self/fd``) after a warm-up (the first
``--warmup`` fraction of each phase) and at the end. Pass: on every rank, its own resident
memory (``rss``: RssAnon + RssFile of ``/proc/self/status``) at the end is within
``--max-growth`` (5%) of that after warm-up, the resident shared memory (``shmem``: the
same-host lane's segments, transport/shm_lane.py) stays within what those segments hold,
and the descriptor count is unchanged.

The lane's segments are counted apart because they are fixed-size and their pages become
resident when first written: a slot is first touched the first time that many pieces are
in flight to one peer, which depends on timing, so it may happen after the warm-up (2 MiB
or 4 MiB more, over 5% of a 60 MB rank) without anything having leaked.

    python benchmarks/soak.py -n 2 --small 100000 --large 1000 --large-bytes 4M

Prints one JSON object per rank and a verdict line; exit status 1 if any rank failed the
check. ``tests/test_reliability_soak.py`` runs it at full size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

import ringcomm as rc
from ringcomm.config import parse_size
from ringcomm.transport import shm_lane


def _status_bytes(*fields: str) -> int:
    """The sum of ``fields`` (kB lines) of /proc/self/status, in bytes."""
    total = 0
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                total += int(value.split()[0]) * 1024
    return total


def rss_bytes() -> int:
    """This process's own resident memory: VmRSS less the shared-memory segments."""
    return _status_bytes("RssAnon", "RssFile")


def shmem_bytes() -> int:
    """Resident shared memory (the shared-memory lane's segments)."""
    return _status_bytes("RssShmem")


def shmem_capacity(world_size: int) -> int:
    """What the lane's segments of one rank can hold resident: one segment towards and
    one from every other rank, each a state page and its slots (shm_lane's defaults)."""
    segment = 4096 + shm_lane.DEFAULT_SLOTS * shm_lane.DEFAULT_SLOT_BYTES
    return 2 * (world_size - 1) * segment


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _small(pg: rc.ProcessGroup, i: int, bufs: dict[str, np.ndarray]) -> None:
    n, r = pg.world_size, pg.rank
    k = i % 4
    if k == 0:
        x = bufs["s2"]
        x[:] = r + 1
        pg.all_reduce(x)
        assert x[0] == n * (n + 1) // 2
    elif k == 1:
        x = bufs["s256"]
        x[:] = r
        pg.broadcast(x, src=i % n)
        assert x[0] == i % n
    elif k == 2:
        x = bufs["s64"]
        x[:] = r
        out = pg.all_gather(x, out=bufs["g64"])
        assert out[n - 1, 0] == n - 1
    else:
        pg.barrier()


def _large(pg: rc.ProcessGroup, i: int, bufs: dict[str, np.ndarray]) -> None:
    n, r = pg.world_size, pg.rank
    k = i % 3
    if k == 0:
        x = bufs["L"]
        x[:] = r + 1
        pg.all_reduce(x)
        assert x[0] == x[-1] == n * (n + 1) // 2
    elif k == 1:
        x = bufs["Lrows"]
        x[:] = r + 1
        out = pg.reduce_scatter(x, out=bufs["Lrow"])
        assert out[0] == out[-1] == n * (n + 1) // 2
    else:
        x = bufs["Lrow"]
        x[:] = r
        out = pg.all_gather(x, out=bufs["Lrows"])
        assert out[n - 1, -1] == n - 1


def soak_rank(
    pg: rc.ProcessGroup, n_small: int, n_large: int, large_bytes: int, warmup: float
) -> dict[str, Any]:
    """One rank's soak; returns its measurements."""
    n = pg.world_size
    count = max(n, large_bytes // 4 // n * n)
    bufs = {
        "s2": np.zeros(2, np.float32),
        "s256": np.zeros(64, np.int32),
        "s64": np.zeros(16, np.float32),
        "g64": np.zeros((n, 16), np.float32),
        "L": np.zeros(count, np.float32),
        "Lrows": np.zeros((n, count // n), np.float32),
        "Lrow": np.zeros(count // n, np.float32),
    }
    report: dict[str, Any] = {"rank": pg.rank, "world_size": n}
    t0 = time.monotonic()
    for phase, total, fn in (("small", n_small, _small), ("large", n_large, _large)):
        warm = max(1, int(total * warmup))
        t_phase = time.monotonic()
        for i in range(total):
            if i == warm:
                pg.barrier()
                report[f"{phase}_rss_warm"] = rss_bytes()
                report[f"{phase}_shmem_warm"] = shmem_bytes()
                report[f"{phase}_fds_warm"] = open_fds()
            fn(pg, i, bufs)
        pg.barrier()
        report[f"{phase}_rss_end"] = rss_bytes()
        report[f"{phase}_shmem_end"] = shmem_bytes()
        report[f"{phase}_fds_end"] = open_fds()
        report[f"{phase}_calls"] = total
        report[f"{phase}_s"] = round(time.monotonic() - t_phase, 2)
    report["seconds"] = round(time.monotonic() - t0, 2)
    report["stats"] = pg.stats()
    return report


def verdict(reports: list[dict[str, Any]], max_growth: float) -> list[str]:
    """What failed (empty: pass)."""
    problems = []
    for rep in reports:
        for phase in ("small", "large"):
            if f"{phase}_rss_warm" not in rep:
                continue
            warm, end = rep[f"{phase}_rss_warm"], rep[f"{phase}_rss_end"]
            if end > warm * (1 + max_growth):
                problems.append(
                    f"rank {rep['rank']} {phase}: RSS grew {warm} -> {end} bytes "
                    f"({100 * (end / warm - 1):.1f}% > {100 * max_growth:g}%)"
                )
            shmem, cap = rep.get(f"{phase}_shmem_end", 0), shmem_capacity(rep["world_size"])
            if shmem > cap:
                problems.append(
                    f"rank {rep['rank']} {phase}: resident shared memory {shmem} bytes > "
                    f"the lane's segments ({cap} bytes)"
                )
            if rep[f"{phase}_fds_end"] != rep[f"{phase}_fds_warm"]:
                problems.append(
                    f"rank {rep['rank']} {phase}: open fds {rep[f'{phase}_fds_warm']} -> "
                    f"{rep[f'{phase}_fds_end']}"
                )
    return problems


def run(
    world: int,
    n_small: int,
    n_large: int,
    large_bytes: int,
    warmup: float = 0.1,
    timeout_s: float = 1800,
) -> list[dict[str, Any]]:
    return rc.spawn(
        soak_rank, world, args=(n_small, n_large, large_bytes, warmup), timeout_s=timeout_s
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--world-size", type=int, default=2)
    p.add_argument("--small", type=int, default=100_000)
    p.add_argument("--large", type=int, default=1000)
    p.add_argument("--large-bytes", default="4M")
    p.add_argument("--warmup", type=float, default=0.1)
    p.add_argument("--max-growth", type=float, default=0.05)
    args = p.parse_args(argv)
    reports = run(
        args.world_size, args.small, args.large, parse_size(args.large_bytes), args.warmup
    )
    for rep in reports:
        print(json.dumps(rep))
    problems = verdict(reports, args.max_growth)
    print("FAIL: " + "; ".join(problems) if problems else "PASS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
