"""Why the caller drives: 8-byte round trip, caller-driven vs handed to a progress thread.

    python benchmarks/progress_design.py [--iters 3000]

Two processes over ipc:// PUSH/PULL (raw pyzmq, two frames like ringcomm's messages). In
"direct" the calling thread sends and receives itself; in "threaded" a progress thread owns
the sockets and the caller hands each send over (a deque plus a wake-up pipe) and waits on a
threading.Event for the reply: the design ringcomm would have with an always-on progress
thread. Prints the median round trip of each, alternating A B A B.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
import uuid

import zmq


def _echo(ep_in: str, ep_out: str, n: int) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(ep_in)
    push = ctx.socket(zmq.PUSH)
    push.connect(ep_out)
    for _ in range(n):
        push.send_multipart(pull.recv_multipart())
    ctx.destroy(linger=0)


def _direct(pull: zmq.Socket, push: zmq.Socket, iters: int) -> float:  # type: ignore[type-arg]
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        push.send_multipart([b"h" * 40, b"x" * 8])
        pull.recv_multipart()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def _threaded(pull: zmq.Socket, push: zmq.Socket, iters: int) -> float:  # type: ignore[type-arg]
    q: collections.deque[list[bytes]] = collections.deque()
    rfd, wfd = os.pipe()
    done = threading.Event()
    stop = [False]

    def progress() -> None:
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(rfd, zmq.POLLIN)
        while not stop[0]:
            ev = dict(poller.poll(50))
            if rfd in ev:
                os.read(rfd, 64)
                while q:
                    push.send_multipart(q.popleft())
            if pull in ev:
                while True:
                    try:
                        pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    done.set()

    th = threading.Thread(target=progress, daemon=True)
    th.start()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        done.clear()
        q.append([b"h" * 40, b"x" * 8])
        os.write(wfd, b"x")
        done.wait()
        ts.append(time.perf_counter() - t)
    stop[0] = True
    th.join()
    os.close(rfd)
    os.close(wfd)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    base = os.path.join(tempfile.gettempdir(), f"rc-pd-{uuid.uuid4().hex[:8]}")
    a, b = f"ipc://{base}-a", f"ipc://{base}-b"
    n = 2 * args.reps * args.iters
    p = mp.get_context("spawn").Process(target=_echo, args=(a, b, n))
    p.start()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(b)
    push = ctx.socket(zmq.PUSH)
    push.connect(a)
    res: dict[str, list[float]] = {"direct": [], "threaded": []}
    for _ in range(args.reps):
        res["direct"].append(_direct(pull, push, args.iters))
        res["threaded"].append(_threaded(pull, push, args.iters))
    p.join(30)
    ctx.destroy(linger=0)
    for k, v in res.items():
        print(f"{k:9s} 8 B round trip: median {statistics.median(v):.1f} us  (runs: "
              + ", ".join(f"{x:.1f}" for x in v) + ")")
    for s in (a, b):
        try:
            os.unlink(s[len("ipc://"):])
        except OSError:
            pass


if __name__ == "__main__":
    main()
