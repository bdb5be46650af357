"""The ringcomm family: each benchmarked operation over a :class:`~ringcomm.ProcessGroup`.

``bench(pg, config) -> records`` runs the sweep with ringcomm alone; :func:`rank_main` is
what ``ringcomm bench`` spawns on every rank: ringcomm, plus Gloo in the same processes
with ``--compare gloo`` (one process start for both; the sizes alternate ringcomm, Gloo,
ringcomm, Gloo, ...).

sendrecv: the ranks form a ring; each posts ``isend`` to rank+1 and ``irecv`` from rank-1,
then waits for both (nccl-tests' sendrecv_perf).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .spec import BenchConfig, SizeSpec
from .sweep import Impl, Record, Step, run_sweep

if TYPE_CHECKING:
    from ringcomm.group import ProcessGroup

__all__ = ["RingcommImpl", "bench", "missing_collective", "rank_main"]

#: Point-to-point tags the benchmark uses (the user tag space of the world group).
SENDRECV_TAG = 0x5EED
SYNC_TAG = 0x5EEE


def missing_collective(op: str) -> str | None:
    """Why ``op`` cannot be benchmarked with this build of ringcomm (None: it can)."""
    from ringcomm.group import ProcessGroup

    if op == "sendrecv":
        return None
    if not hasattr(ProcessGroup, op):
        return f"this ringcomm has no ProcessGroup.{op} yet"
    return None


class RingcommImpl:
    """The operations over one ringcomm group."""

    name = "ringcomm"

    def __init__(self, pg: ProcessGroup) -> None:
        self.pg = pg

    def sync(self) -> None:
        barrier = getattr(self.pg, "barrier", None)
        if barrier is not None:
            barrier()
        else:  # before the collectives exist: gather at rank 0, then release
            _p2p_barrier(self.pg)

    def prepare(self, spec: SizeSpec, data: np.ndarray) -> Step:
        pg = self.pg
        x = data.copy()
        op = spec.op
        if op == "all_reduce":
            redop = spec.redop
            return lambda: pg.all_reduce(x, op=redop)
        if op == "reduce_scatter":
            out = np.empty(spec.out_shape, dtype=x.dtype)
            redop = spec.redop
            return lambda: pg.reduce_scatter(x, out=out, op=redop)
        if op == "all_gather":
            out = np.empty(spec.out_shape, dtype=x.dtype)
            return lambda: pg.all_gather(x, out=out)
        if op == "broadcast":
            root = spec.root

            def broadcast() -> np.ndarray:
                pg.broadcast(x, src=root)
                return x

            return broadcast
        if op == "all_to_all":
            out = np.empty(spec.out_shape, dtype=x.dtype)
            return lambda: pg.all_to_all(x, out=out)
        if op == "sendrecv":
            recv = np.empty(spec.out_shape, dtype=x.dtype)
            n, rank = pg.world_size, pg.rank

            def sendrecv() -> np.ndarray:
                s = pg.isend(x, (rank + 1) % n, SENDRECV_TAG)
                r = pg.irecv(recv, (rank - 1) % n, SENDRECV_TAG)
                s.wait()
                r.wait()
                return recv

            return sendrecv
        raise ValueError(f"unknown op {op!r}")


def _p2p_barrier(pg: ProcessGroup) -> None:
    token = np.zeros(1, dtype=np.uint8)
    if pg.rank == 0:
        for peer in range(1, pg.world_size):
            pg.recv(token, peer, SYNC_TAG)
        for peer in range(1, pg.world_size):
            pg.send(token, peer, SYNC_TAG)
    else:
        pg.send(token, 0, SYNC_TAG)
        pg.recv(token, 0, SYNC_TAG)


def bench(pg: ProcessGroup, config: BenchConfig) -> list[Record]:
    """This rank's records of the sweep with ringcomm alone."""
    return run_sweep([RingcommImpl(pg)], config, pg.rank)


def rank_main(pg: ProcessGroup, config: BenchConfig) -> list[Record]:
    """What ``ringcomm bench`` runs on each spawned rank (``rc.spawn(rank_main, n, (config,))``)."""
    pg.timeout_s = min(pg.timeout_s, config.op_timeout_s)
    impls: list[Impl] = [RingcommImpl(pg)]
    closers: list[Any] = []
    if config.compare == "gloo":
        from . import gloo  # the only bench module importing torch

        peer = gloo.GlooImpl.join(pg, config)
        impls.append(peer)
        closers.append(peer)
    try:
        return run_sweep(impls, config, pg.rank)
    finally:
        for c in closers:
            c.close()
