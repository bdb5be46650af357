"""The ringcomm family: each benchmarked operation over a :class:`~ringcomm.ProcessGroup`.

``bench(pg, config) -> records`` runs the sweep with ringcomm alone; :func:`rank_main` is
what ``ringcomm bench`` spawns on every rank: ringcomm, plus Gloo in the same processes
with ``--compare gloo`` (one process start for both; the sizes alternate ringcomm, Gloo,
ringcomm, Gloo, ...).

``--device``: ringcomm's buffers are NumPy arrays (host), CuPy arrays (cuda), the host
stand-in for CuPy arrays (``standin``: through the algorithm a CuPy array takes, device
windows on one host; ``host-staged``: through host staging, device windows off for its
calls) or symmetric buffers (``pg.alloc``); ``copy`` is no collective but the reference of
memory bandwidth (every rank ``numpy.copyto`` of the size at once); several devices are
measured side by side, sizes alternating between them, like ``--compare``. A CuPy step ends
with a synchronize of the rank's current stream (what it left there is part of its time),
as Gloo's and NCCL's on CUDA tensors end with ``torch.cuda.synchronize()``. Each row says
which algorithm the calls took (``algo``: the group's latest call's, after the steps).

sendrecv: the ranks form a ring; each posts ``isend`` to rank+1 and ``irecv`` from rank-1,
then waits for both (nccl-tests' sendrecv_perf).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ringcomm.bench.spec import STAGED_DEVICES, BenchConfig, SizeSpec
from ringcomm.bench.sweep import Impl, Record, Step, run_sweep

if TYPE_CHECKING:
    from ringcomm.group import ProcessGroup

__all__ = [
    "RingcommImpl",
    "bench",
    "device_array_maker",
    "device_missing",
    "missing_collective",
    "rank_main",
]

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


def device_array_maker(device: str) -> Any:
    """``numpy array -> array on device`` for ``--device`` (a copy; identity for host)."""
    if device in ("host", "symmetric", "copy"):  # (RingcommImpl allocates these two)
        return lambda a: a
    if device in ("host-staged", "standin"):
        from ringcomm.device.standin import standin_array

        return standin_array
    if device in ("cuda", "cuda-staged"):
        from ringcomm.device.xp import cupy_or_none

        cp = cupy_or_none()
        if cp is None:
            raise RuntimeError("--device cuda needs CuPy")
        return cp.asarray
    raise ValueError(f"unknown device {device!r}")


def device_missing(device: str) -> str | None:
    """Why ``--device device`` cannot run here (None: it can)."""
    if device not in ("cuda", "cuda-staged"):
        return None
    from ringcomm.device.xp import cupy_or_none

    cp = cupy_or_none()
    if cp is None:
        return "--device cuda needs CuPy and an NVIDIA GPU: pip install 'ringcomm[gpu]'"
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 (no driver, no device: CuPy raises its own)
        return f"--device cuda: CuPy finds no usable GPU ({exc})"
    return None if count > 0 else "--device cuda: CuPy finds no GPU"


class RingcommImpl:
    """The operations over one ringcomm group, with buffers on ``device`` (``--device``)."""

    name = "ringcomm"

    def __init__(self, pg: ProcessGroup, device: str = "host") -> None:
        from ringcomm.bench.spec import device_impl

        self.pg = pg
        self.device = device
        self.name = device_impl(device)
        self._dev = device_array_maker(device)
        self._op = ""
        self._stream: Any = None
        if device in ("cuda", "cuda-staged"):
            from ringcomm.device.xp import cupy_or_none

            cp = cupy_or_none()
            self._stream = None if cp is None else cp.cuda.get_current_stream()
        if device == "symmetric":  # buffers from pg.alloc (every rank, in one order)

            def symmetric(a: np.ndarray) -> np.ndarray:
                buf = pg.alloc(a.shape, a.dtype)
                buf[...] = a
                return buf

            self._dev = symmetric

    def sync(self) -> None:
        barrier = getattr(self.pg, "barrier", None)
        if barrier is not None:
            barrier()
        else:  # before the collectives exist: gather at rank 0, then release
            _p2p_barrier(self.pg)

    @property
    def checked(self) -> bool:
        """Whether its output is the operation's (not for the copy reference)."""
        return self.device != "copy"

    @property
    def algo(self) -> str:
        """The algorithm the latest step's call took."""
        if self.device == "copy":
            return "copy"
        if self._op == "sendrecv":
            return "p2p"
        core = getattr(self.pg, "core", None)
        return str(getattr(core, "last_algo", "") or "")

    def prepare(self, spec: SizeSpec, data: np.ndarray) -> Step:
        self._op = spec.op
        if hasattr(self.pg, "device_windows"):  # *-staged measure host staging: no windows
            self.pg.device_windows = self.device not in STAGED_DEVICES
        step = self._prepare(spec, data)
        stream = self._stream
        if stream is None:
            return step

        def synced() -> Any:  # what the call left on the stream is part of its time
            out = step()
            stream.synchronize()
            return out

        return synced

    def _prepare(self, spec: SizeSpec, data: np.ndarray) -> Step:
        pg = self.pg
        dev = self._dev
        if self.device == "copy":  # the reference: every rank copies spec.nbytes at once
            src = np.ones(spec.nbytes, np.uint8)
            dst = np.zeros(spec.nbytes, np.uint8)

            def copy() -> np.ndarray:
                np.copyto(dst, src)
                return dst

            return copy
        x = dev(data.copy())
        op = spec.op
        if op == "all_reduce":
            redop = spec.redop
            return lambda: pg.all_reduce(x, op=redop)
        if op == "reduce_scatter":
            out = dev(np.empty(spec.out_shape, dtype=x.dtype))
            redop = spec.redop
            return lambda: pg.reduce_scatter(x, out=out, op=redop)
        if op == "all_gather":
            out = dev(np.empty(spec.out_shape, dtype=x.dtype))
            return lambda: pg.all_gather(x, out=out)
        if op == "broadcast":
            root = spec.root

            def broadcast() -> Any:
                pg.broadcast(x, src=root)
                return x

            return broadcast
        if op == "all_to_all":
            out = dev(np.empty(spec.out_shape, dtype=x.dtype))
            return lambda: pg.all_to_all(x, out=out)
        if op == "sendrecv":
            recv = dev(np.empty(spec.out_shape, dtype=x.dtype))
            n, rank = pg.world_size, pg.rank

            def sendrecv() -> Any:
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
    """This rank's records of the sweep with ringcomm alone (on each of ``config.devices``)."""
    return run_sweep([RingcommImpl(pg, d) for d in config.devices], config, pg.rank)


def rank_main(pg: ProcessGroup, config: BenchConfig) -> list[Record]:
    """What ``ringcomm bench`` runs on each spawned rank (``rc.spawn(rank_main, n, (config,))``)."""
    pg.timeout_s = min(pg.timeout_s, config.op_timeout_s)
    impls: list[Impl] = [RingcommImpl(pg, device) for device in config.devices]
    closers: list[Any] = []
    if config.compare in ("gloo", "nccl"):
        from ringcomm.bench import gloo  # the only bench module importing torch

        peer = gloo.GlooImpl.join(pg, config, backend=config.compare)
        impls.append(peer)
        closers.append(peer)
    try:
        return run_sweep(impls, config, pg.rank)
    finally:
        for c in closers:
            c.close()
