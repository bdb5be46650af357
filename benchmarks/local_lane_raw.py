"""The floor under the same-host lane: an 8-byte all_reduce in bare Python, no ringcomm.

    python benchmarks/local_lane_raw.py [--iters 5000] [--reps 2] [-n 2 4]

Every rank sends its 8 bytes and sums what it receives, back to back, in one of:

* ``zmq``: pyzmq PUSH/PULL over ipc:// (a blocking recv), what ringcomm used before;
* ``dgram``: AF_UNIX datagrams, blocking in poll() when nothing is waiting;
* ``dgram-spin``: datagrams, and instead of sleeping, ``sched_yield()`` and look again;
* ``star-spin``: as dgram-spin, but through rank 0 (the others send to it, it sums and
  sends the result back): 2(n-1) messages instead of n(n-1).

Prints each rank's median per-call time (µs) and the maximum over ranks, per variant.
Results: benchmarks/results/local_lane.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import select
import socket
import statistics
import tempfile
import time
from typing import Any

import numpy as np

VARIANTS = ("zmq", "dgram", "dgram-spin", "star-spin")


def _rank(rank: int, n: int, folder: str, iters: int, variant: str, q: Any) -> None:
    x = np.ones(2, np.float32)
    if variant == "zmq":
        import zmq

        ctx = zmq.Context()
        rx = ctx.socket(zmq.PULL)
        rx.bind(f"ipc://{folder}/z{rank}")
        tx = {}
        for p in range(n):
            if p != rank:
                tx[p] = ctx.socket(zmq.PUSH)
                tx[p].connect(f"ipc://{folder}/z{p}")
        time.sleep(0.5)

        def recv() -> bytes:
            return rx.recv()  # type: ignore[no-any-return]

    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(f"{folder}/r{rank}")
        sock.setblocking(False)
        time.sleep(0.3)
        tx = {}
        for p in range(n):
            if p != rank:
                tx[p] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                tx[p].connect(f"{folder}/r{p}")
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        spin = variant.endswith("spin")

        def recv() -> bytes:
            while True:
                try:
                    return sock.recv(8192)
                except BlockingIOError:
                    if spin:
                        os.sched_yield()
                    else:
                        poller.poll(1000)

    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        if variant == "star-spin" and rank == 0:
            acc = x.copy()
            for _ in range(n - 1):
                acc += np.frombuffer(recv(), np.float32)
            for s in tx.values():
                s.send(acc.tobytes())
        elif variant == "star-spin":
            tx[0].send(x.tobytes())
            acc = np.frombuffer(recv(), np.float32)
        else:
            msg = x.tobytes()
            for s in tx.values():
                s.send(msg)
            acc = x.copy()
            for _ in range(n - 1):
                acc += np.frombuffer(recv(), np.float32)
        times.append(time.perf_counter() - t0)
    q.put(statistics.median(times[iters // 5 :]) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for rep in range(args.reps):
        for n in args.n:
            for variant in VARIANTS:
                if variant == "star-spin" and n < 3:
                    continue
                with tempfile.TemporaryDirectory() as folder:
                    q = ctx.Queue()
                    procs = [
                        ctx.Process(target=_rank, args=(r, n, folder, args.iters, variant, q))
                        for r in range(n)
                    ]
                    for p in procs:
                        p.start()
                    for p in procs:
                        p.join()
                    per_rank = sorted(q.get() for _ in procs)
                print(
                    f"rep {rep} W={n} {variant:10s} max {per_rank[-1]:7.1f} us  "
                    f"ranks {[round(t, 1) for t in per_rank]}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
