"""Point-to-point throughput and latency: ringcomm send/recv vs raw pyzmq, same run.

    python benchmarks/p2p.py [--sizes 1M,16M] [--iters 20] [--reps 5] [--json FILE]

Two local ranks. For each size, the implementations alternate (raw, ringcomm, raw,
ringcomm, ...) so machine drift hits both; we report the median over repetitions and the
ratio ringcomm / raw taken per repetition pair.

- Throughput: rank 0 sends ``iters`` messages (at least 256 MiB in all) back to back, rank 1 receives
  them into one buffer, then returns an 8-byte ack; GB/s = 1e9 B/s.
  * raw pyzmq: PUSH/PULL over ipc://, ``send(copy=False)`` of one message per transfer
    (untracked: the benchmark never modifies the buffer), receiver ``recv(copy=False)``
    and, in the "raw+copy" variant, a copy into the user buffer (what ringcomm's recv does).
  * ringcomm: ``pg.send`` / ``pg.recv`` (chunked into ``chunk_bytes`` pieces, zero-copy,
    each piece copied into the caller's buffer as it arrives).
  * ringcomm, isend window (OSU osu_bw style): windows of 16 ``isend``/``irecv`` in
    flight, then wait for all; the like-for-like of raw pyzmq's untracked stream, where
    libzmq always has the next message queued.
- Latency: 8-byte ping-pong, median round trip in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

import numpy as np

import ringcomm as rc
from ringcomm.config import parse_size


def _raw_sockets(pg: rc.ProcessGroup, name: str):  # type: ignore[no-untyped-def]
    import zmq

    ctx = zmq.Context()
    me, peer = pg.rank, 1 - pg.rank
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(f"ipc:///tmp/rc-bench-{name}-{me}.sock")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(f"ipc:///tmp/rc-bench-{name}-{peer}.sock")
    # handshake so both connections are up before timing
    push.send(b"hi")
    pull.recv()
    return ctx, push, pull


def _raw_throughput(push, pull, rank: int, buf: np.ndarray, iters: int, copy_in: bool) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    if rank == 0:
        for _ in range(iters):
            push.send(buf, copy=False)
        pull.recv()
    else:
        for _ in range(iters):
            frame = pull.recv(copy=False)
            if copy_in:
                buf.reshape(-1).view(np.uint8)[:] = np.frombuffer(frame.buffer, np.uint8)
        push.send(b"ack")
    return time.perf_counter() - t0


def _raw_tracked_throughput(push, pull, rank: int, buf: np.ndarray, iters: int) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    if rank == 0:
        for _ in range(iters):
            push.send(buf, copy=False, track=True).wait()
        pull.recv()
    else:
        for _ in range(iters):
            frame = pull.recv(copy=False)
            buf.reshape(-1).view(np.uint8)[:] = np.frombuffer(frame.buffer, np.uint8)
        push.send(b"ack")
    return time.perf_counter() - t0


def _rc_throughput(pg: rc.ProcessGroup, buf: np.ndarray, iters: int) -> float:
    ack = np.zeros(1, np.int64)
    t0 = time.perf_counter()
    if pg.rank == 0:
        for _ in range(iters):
            pg.send(buf, 1)
        pg.recv(ack, 1)
    else:
        for _ in range(iters):
            pg.recv(buf, 0)
        pg.send(ack, 0)
    return time.perf_counter() - t0


def _rc_window_throughput(pg: rc.ProcessGroup, buf: np.ndarray, iters: int, window: int = 16) -> float:
    """OSU-style bandwidth: windows of ``window`` isends (irecvs) in flight, then wait all."""
    ack = np.zeros(1, np.int64)
    t0 = time.perf_counter()
    done = 0
    while done < iters:
        k = min(window, iters - done)
        if pg.rank == 0:
            works = [pg.isend(buf, 1) for _ in range(k)]
        else:
            works = [pg.irecv(buf, 0) for _ in range(k)]
        for w in works:
            w.wait()
        done += k
    if pg.rank == 0:
        pg.recv(ack, 1)
    else:
        pg.send(ack, 0)
    return time.perf_counter() - t0


def _raw_latency(push, pull, rank: int, iters: int) -> float:  # type: ignore[no-untyped-def]
    msg = b"x" * 8
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        if rank == 0:
            push.send(msg)
            pull.recv()
        else:
            pull.recv()
            push.send(msg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rc_latency(pg: rc.ProcessGroup, iters: int) -> float:
    x = np.zeros(1, np.float64)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        if pg.rank == 0:
            pg.send(x, 1)
            pg.recv(x, 1)
        else:
            pg.recv(x, 0)
            pg.send(x, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chunk_sweep(pg: rc.ProcessGroup, sizes: list[int], chunks: list[int], iters: int, reps: int) -> list[dict]:  # type: ignore[type-arg]
    """ringcomm send/recv throughput per piece size, chunk sizes interleaved per repetition."""
    rows = []
    for size in sizes:
        buf = np.ones(size // 4, np.float32)
        res: dict[int, list[float]] = {c: [] for c in chunks}
        for _ in range(reps):
            for c in chunks:
                pg.chunk_bytes = c
                _rc_throughput(pg, buf, 2)
                res[c].append(size * iters / _rc_throughput(pg, buf, iters) / 1e9)
        for c in chunks:
            rows.append({"test": "chunk_sweep", "bytes": size, "chunk_bytes": c,
                         "ringcomm_GBps": statistics.median(res[c])})
    return rows if pg.rank == 0 else []


def bench(pg: rc.ProcessGroup, sizes: list[int], iters: int, reps: int, name: str) -> list[dict]:  # type: ignore[type-arg]
    ctx, push, pull = _raw_sockets(pg, name)
    rows = []
    try:
        base_iters = iters
        for size in sizes:
            # At least 256 MiB per measurement, so start-up and timer noise stay small.
            iters = max(base_iters, (256 << 20) // size)
            buf = np.ones(size // 4, np.float32)
            # warm-up both paths once
            _raw_throughput(push, pull, pg.rank, buf, 2, True)
            _rc_throughput(pg, buf, 2)
            raw, rawc, rawt, ours, oursw = [], [], [], [], []
            for _ in range(reps):
                raw.append(size * iters / _raw_throughput(push, pull, pg.rank, buf, iters, False) / 1e9)
                ours.append(size * iters / _rc_throughput(pg, buf, iters) / 1e9)
                oursw.append(size * iters / _rc_window_throughput(pg, buf, iters) / 1e9)
                rawc.append(size * iters / _raw_throughput(push, pull, pg.rank, buf, iters, True) / 1e9)
                rawt.append(size * iters / _raw_tracked_throughput(push, pull, pg.rank, buf, iters) / 1e9)
            rows.append(
                {
                    "test": "throughput",
                    "bytes": size,
                    "raw_GBps": statistics.median(raw),
                    "raw_copy_GBps": statistics.median(rawc),
                    "raw_tracked_GBps": statistics.median(rawt),
                    "ringcomm_GBps": statistics.median(ours),
                    "ringcomm_window_GBps": statistics.median(oursw),
                    "window_ratio_vs_raw": statistics.median(o / r for o, r in zip(oursw, raw)),
                    "ratio_vs_raw": statistics.median(o / r for o, r in zip(ours, raw)),
                    "ratio_vs_raw_copy": statistics.median(o / r for o, r in zip(ours, rawc)),
                    "ratio_vs_raw_tracked": statistics.median(o / r for o, r in zip(ours, rawt)),
                }
            )
        lat_raw, lat_rc = [], []
        for _ in range(reps):
            lat_raw.append(_raw_latency(push, pull, pg.rank, 500) * 1e6)
            lat_rc.append(_rc_latency(pg, 500) * 1e6)
        rows.append(
            {
                "test": "latency_8B",
                "bytes": 8,
                "raw_rtt_us": statistics.median(lat_raw),
                "ringcomm_rtt_us": statistics.median(lat_rc),
                "ratio_vs_raw": statistics.median(o / r for o, r in zip(lat_rc, lat_raw)),
            }
        )
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        for r in (0, 1):
            try:
                os.unlink(f"/tmp/rc-bench-{name}-{r}.sock")
            except OSError:
                pass
    return rows if pg.rank == 0 else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M", help="comma-separated sizes (K/M/G suffixes)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the rows as JSON lines here")
    ap.add_argument("--chunk-sweep", help="instead: ringcomm throughput for these piece sizes, e.g. 256K,1M,4M")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.chunk_sweep:
        chunks = [parse_size(c) for c in args.chunk_sweep.split(",")]
        rows = rc.spawn(chunk_sweep, 2, args=(sizes, chunks, args.iters, args.reps), timeout_s=600)[0]
    else:
        rows = rc.spawn(bench, 2, args=(sizes, args.iters, args.reps, uuid.uuid4().hex[:8]), timeout_s=600)[0]
    for row in rows:
        if row["test"] == "chunk_sweep":
            print(f"send/recv {row['bytes']:>10} B  chunk {row['chunk_bytes']:>8} B  "
                  f"ringcomm {row['ringcomm_GBps']:.2f} GB/s")
        elif row["test"] == "throughput":
            print(
                f"send/recv {row['bytes']:>10} B  raw pyzmq {row['raw_GBps']:.2f} GB/s  "
                f"raw+copy {row['raw_copy_GBps']:.2f}  raw tracked+copy {row['raw_tracked_GBps']:.2f}  "
                f"ringcomm {row['ringcomm_GBps']:.2f} GB/s  ratio {row['ratio_vs_raw']:.2f} "
                f"(vs raw+copy {row['ratio_vs_raw_copy']:.2f}, vs tracked {row['ratio_vs_raw_tracked']:.2f})  "
                f"ringcomm isend window {row['ringcomm_window_GBps']:.2f} GB/s  ratio {row['window_ratio_vs_raw']:.2f}"
            )
        else:
            print(
                f"8 B round trip  raw pyzmq {row['raw_rtt_us']:.1f} us  ringcomm "
                f"{row['ringcomm_rtt_us']:.1f} us  ratio {row['ratio_vs_raw']:.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
