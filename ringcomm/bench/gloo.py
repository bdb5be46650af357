"""The Gloo family: the same operations through torch.distributed's Gloo (or NCCL) backend.

The only module of ``ringcomm.bench`` that imports torch. Set-up (BENCHMARKING.md): each
rank ``torch.set_num_threads(1)``, ``GLOO_SOCKET_IFNAME=lo``, a Gloo group over a TCP store
on 127.0.0.1 (across hosts: the store at ``MASTER_ADDR``, ``GLOO_SOCKET_IFNAME`` per host,
see :mod:`~ringcomm.bench.multihost`). The Gloo ranks live in the same processes as the
ringcomm ranks (one process start for both): rank 0 opens torch's ``TCPStore`` on a port the OS picks (what
``init_method="tcp://127.0.0.1:PORT"`` does, minus the race of choosing a free port first)
and hands the port to the other ranks over the ringcomm group.

Operations: ``all_reduce``; ``reduce_scatter_tensor``; ``all_gather_into_tensor``;
``broadcast``; ``all_to_all_single``; sendrecv as ``isend``/``irecv`` then wait. Tensors
are ``torch.from_numpy`` views of NumPy buffers (no copies), or, with ``device="cuda"``
(``ringcomm bench --device cuda --compare gloo``: Gloo on CUDA tensors; ``--compare
nccl``: NCCL, one rank per GPU), tensors on the rank's GPU (``LOCAL_RANK`` modulo the GPUs,
as ringcomm's ranks), each step ending with ``torch.cuda.synchronize()`` so its time is
the operation's, as ringcomm's CuPy steps end with a stream synchronize.
"""

from __future__ import annotations

import datetime
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ringcomm.bench.spec import GLOO_DTYPES, BenchConfig, SizeSpec
from ringcomm.bench.sweep import Record, Step, returning, run_sweep
from ringcomm.config import environment

if TYPE_CHECKING:
    from ringcomm.group import ProcessGroup

__all__ = ["GLOO_DTYPES", "NCCL_DTYPES", "GlooImpl", "bench", "nccl_missing"]

#: NumPy dtypes NCCL reduces (no bool, int16 or uint16-64).
NCCL_DTYPES = frozenset({"int8", "uint8", "int32", "int64", "float16", "float32", "float64"})

_PORT_TAG = 0x600
_HOST = "127.0.0.1"


def _redop(name: str | None) -> Any:
    table = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.AVG,
        "prod": dist.ReduceOp.PRODUCT,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }
    return table[name or "sum"]


def nccl_missing(world_size: int) -> str | None:
    """Why ``--compare nccl`` cannot run ``world_size`` ranks here (None: it can)."""
    if not torch.cuda.is_available():
        return "--compare nccl needs torch with CUDA and a GPU"
    if not dist.is_nccl_available():
        return "--compare nccl: this torch has no NCCL"
    gpus = torch.cuda.device_count()
    if gpus < world_size:
        return (
            f"--compare nccl runs one rank per GPU (NCCL refuses two ranks on one): "
            f"{world_size} ranks, {gpus} GPU(s)"
        )
    return None


class GlooImpl:
    """The operations over torch.distributed's default group (Gloo, or NCCL), on CPU
    tensors or on the rank's GPU (``device="cuda"``)."""

    name = "gloo"
    algo = "gloo"

    def __init__(
        self, rank: int, world_size: int, device: str = "cpu", backend: str = "gloo"
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.cuda = device != "cpu"
        self.name = self.algo = backend if backend != "gloo" or not self.cuda else "gloo-cuda"

    @classmethod
    def join(cls, pg: ProcessGroup, config: BenchConfig, backend: str = "gloo") -> GlooImpl:
        """Form the Gloo (or NCCL) group of ``pg``'s ranks (rank 0 serves the store); CUDA
        tensors with ``--device cuda`` (always for NCCL)."""
        device = "cpu"
        if backend == "nccl" or {"cuda", "cuda-staged"} & set(config.devices):
            index = pg.config.local_rank % max(1, torch.cuda.device_count())
            torch.cuda.set_device(index)
            device = f"cuda:{index}"
        host = _HOST
        if config.multihost:  # GLOO_SOCKET_IFNAME: set by ringcomm.bench.multihost per host
            from ringcomm.config import env_master_addr

            host = env_master_addr()
        else:
            environment()["GLOO_SOCKET_IFNAME"] = "lo"
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", module=r"torch\.distributed")
        rank, n = pg.rank, pg.world_size
        timeout = datetime.timedelta(seconds=config.op_timeout_s)
        port = np.zeros(1, dtype=np.int64)
        if rank == 0:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, 0, n, is_master=True, timeout=timeout, wait_for_workers=False
            )
            port[0] = store.port
            for peer in range(1, n):
                pg.send(port, peer, _PORT_TAG)
        else:
            pg.recv(port, 0, _PORT_TAG)
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, int(port[0]), n, is_master=False, timeout=timeout
            )
        dist.init_process_group(backend, store=store, rank=rank, world_size=n, timeout=timeout)
        return cls(rank, n, device, backend)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def sync(self) -> None:
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()

    def prepare(self, spec: SizeSpec, data: np.ndarray) -> Step:
        step = self._prepare(spec, data)
        if not self.cuda:
            return step

        def synced() -> Any:
            out = step()
            torch.cuda.synchronize()
            return out

        return synced

    def _prepare(self, spec: SizeSpec, data: np.ndarray) -> Step:
        x: Any = data.copy()
        t = torch.from_numpy(x)
        if self.cuda:  # the outputs go back as tensors (the check reads them with .cpu())
            t = x = t.to(self.device)
        op = spec.op
        if op == "all_reduce":
            return returning(x, dist.all_reduce, t, _redop(spec.redop))
        out: Any = np.empty(spec.out_shape, dtype=data.dtype)
        o = torch.from_numpy(out)
        if self.cuda:
            o = out = o.to(self.device)
        if op == "reduce_scatter":
            return returning(out, dist.reduce_scatter_tensor, o, t.view(-1), _redop(spec.redop))
        if op == "all_gather":
            return returning(out, dist.all_gather_into_tensor, o.view(-1), t)
        if op == "broadcast":
            return returning(x, dist.broadcast, t, spec.root)
        if op == "all_to_all":
            return returning(out, dist.all_to_all_single, o.view(-1), t.view(-1))
        if op == "sendrecv":
            n, rank = self.world_size, self.rank

            def sendrecv() -> np.ndarray:
                reqs = [dist.isend(t, (rank + 1) % n), dist.irecv(o, (rank - 1) % n)]
                for req in reqs:
                    if req is not None:
                        req.wait()
                return out

            return sendrecv
        raise ValueError(f"unknown op {op!r}")


def bench(pg: ProcessGroup, config: BenchConfig) -> list[Record]:
    """This rank's records of the sweep with Gloo alone (``pg`` only forms the group)."""
    impl = GlooImpl.join(pg, config)
    try:
        return run_sweep([impl], config, pg.rank)
    finally:
        impl.close()
