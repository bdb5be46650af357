"""Per-call cost of a small blocking all_reduce: the Python around the sockets.

    python benchmarks/call_overhead.py [--world 2] [--bytes 8] [--calls 20000] [--spawn]

Default (in one process, low noise): rank 0 of a group of ``--world`` whose transport is a
mirror: every frame rank 0 sends to a peer comes straight back as that peer's (same call,
same bytes), so a call runs every line of ringcomm (argument checks, the algorithm, packing,
matching, fingerprint checks, the reduction) and no socket. Prints the best of five runs of
``--calls`` calls, in microseconds of CPU per call: what ringcomm adds to the wire's own cost.

``--spawn``: real ranks on this host (``rc.spawn``), each timing ``--calls`` calls; prints
each rank's median per call and its main thread's CPU per call (which includes the zmq
calls; compare with a raw pyzmq exchange, about 10 us of CPU and 45 us of wall at W=2 on
two shared cores).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import numpy as np

import ringcomm as rc
from ringcomm.config import resolve_init_config
from ringcomm.group import ProcessGroup

try:  # the progress engine's class was called Engine before issue 16
    from ringcomm.core.progress import Progress
except ImportError:
    from ringcomm.core.progress import Engine as Progress  # type: ignore[attr-defined,no-redef]
from ringcomm.transport.wire import INLINE_MAX_BYTES

try:  # the tree measured may predate the group core / transport boundary (A/B runs)
    from ringcomm.core.group_core import GroupCore, ProcessState
    from ringcomm.transport.wire import inline_frame
except ImportError:  # before issue 16
    GroupCore = ProcessState = inline_frame = None  # type: ignore[assignment,misc]


class MirrorTransport:
    """A transport whose peers answer every message with the same message (theirs)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.queue: collections.deque[bytes] = collections.deque()
        self.sent_bytes = 0
        self.sent_messages = 0

    def send(self, peer: int, stream: Any, header: bytes, payload: Any, nbytes: int) -> None:
        """The transport boundary's one send (issue 16 on)."""
        if nbytes >= INLINE_MAX_BYTES:
            raise NotImplementedError("the mirror carries one-frame (inline) messages only")
        frame = header if payload is None else inline_frame(header, payload)  # as ZmqTransport
        self._mirror(peer, frame)

    def send_one(self, peer: int, frame: bytes, nbytes: int, lane: bool = False) -> bool:
        """The one-frame send of the trees before it."""
        self._mirror(peer, frame)
        return False

    def _mirror(self, peer: int, frame: bytes) -> None:
        # The header starts [0x9f, version, kind, src, ...]: src of a small rank is one byte.
        self.queue.append(frame[:3] + bytes((peer,)) + frame[4:])

    def poll(self, timeout_s: float, spin_s: float = 0.0) -> bool:
        return bool(self.queue)

    def recv_first(self, ready: bool = False) -> tuple[bytes, bool] | None:
        return (self.queue.popleft(), False) if self.queue else None

    def wake(self) -> None:
        pass

    def peers(self) -> list[int]:
        return list(range(self.world_size))

    def poll_events(self) -> list[tuple[int, int]]:
        return []  # no connections, so nothing ever drops

    def close(self, linger_s: float | None = None) -> None:
        pass


def mirror_group(world_size: int) -> ProcessGroup:
    """Rank 0 of a group of ``world_size`` over a MirrorTransport."""
    assert world_size < 128, "the mirror rewrites a one-byte src"
    config = resolve_init_config(0, world_size, master_addr="127.0.0.1", master_port=1, env={})
    progress = Progress(MirrorTransport(world_size), 0)  # type: ignore[arg-type]
    if GroupCore is None:
        from ringcomm.group import _Shared  # type: ignore[attr-defined]

        return ProcessGroup(_Shared(config, progress, None, None, 4 << 20), range(world_size), 0)  # type: ignore[call-arg,arg-type]
    state = ProcessState(config, progress, None, None, 4 << 20)
    return ProcessGroup(GroupCore(state, range(world_size), 0))


def in_process(world_size: int, nbytes: int, calls: int) -> float:
    pg = mirror_group(world_size)
    x = np.ones(max(1, nbytes // 4), np.float32)
    for _ in range(1000):
        x[...] = 1
        pg.all_reduce(x)
    assert x[0] == world_size, x
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            pg.all_reduce(x)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def _rank(pg: rc.ProcessGroup, nbytes: int, calls: int) -> tuple[float, float]:
    x = np.ones(max(1, nbytes // 4), np.float32)
    for _ in range(500):
        pg.all_reduce(x)
    pg.barrier()
    clock = time.perf_counter
    times = []
    cpu0 = time.thread_time()
    for _ in range(calls):
        t0 = clock()
        pg.all_reduce(x)
        times.append(clock() - t0)
    cpu = (time.thread_time() - cpu0) / calls
    return statistics.median(times) * 1e6, cpu * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--spawn", action="store_true", help="real ranks instead of a mirror")
    args = parser.parse_args()
    if not args.spawn:
        us = in_process(args.world, args.bytes, args.calls)
        print(f"all_reduce {args.bytes} B, W={args.world}, mirror: {us:.2f} us CPU per call")
        return
    results = rc.spawn(_rank, args.world, (args.bytes, args.calls), timeout_s=600)
    for rank, (median_us, cpu_us) in enumerate(results):
        print(
            f"all_reduce {args.bytes} B, W={args.world}, rank {rank}: median {median_us:.1f} us "
            f"per call, main thread CPU {cpu_us:.1f} us per call"
        )


if __name__ == "__main__":
    main()
