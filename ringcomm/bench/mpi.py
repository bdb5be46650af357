"""The MPI family: the same operations through mpi4py, in ranks started by ``mpirun``.

MPI ranks cannot share processes with the ringcomm ranks (mpirun starts its own), so with
``--compare mpi`` the parent alternates whole sweeps: ringcomm round 1, MPI round 1,
ringcomm round 2, ... (:func:`run_mpi` runs one MPI sweep). Under mpirun this module is the
program: ``python -m ringcomm.bench.mpi CONFIG.json OUT.json`` runs the sweep and rank 0
writes every rank's records to ``OUT.json`` (CONFIG may be the JSON text itself; OUT ``-``:
rank 0 prints them on stdout after ``RINGCOMM-BENCH-RECORDS``).

mpirun flags (BENCHMARKING.md): ``--oversubscribe --bind-to none`` (plus
``--allow-run-as-root`` as root); across hosts see :mod:`~ringcomm.bench.multihost`;
``mpi_tcp`` adds ``--mca pml ob1 --mca btl tcp,self
--mca btl_tcp_if_include lo`` (TCP loopback, like-for-like with sockets; the default on one
host is shared memory). Operations: ``Allreduce(IN_PLACE)``, ``Reduce_scatter_block``,
``Allgather``, ``Bcast``, ``Alltoall``, sendrecv as ``Isend``/``Irecv`` then ``Waitall``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from ringcomm.bench.spec import BenchConfig, SizeSpec
from ringcomm.bench.sweep import MARK, Record, Step, returning, run_sweep

__all__ = ["MPI_TCP_ARGS", "MpiImpl", "bench", "mpi_missing", "mpirun_command", "run_mpi"]

#: mpirun options for the TCP transport (Open MPI's ob1 with the tcp and self BTLs); the
#: interfaces it may use are added apart (loopback on one host).
MPI_TCP_ARGS: tuple[str, ...] = ("--mca", "pml", "ob1", "--mca", "btl", "tcp,self")


def mpi_missing() -> str | None:
    """Why ``--compare mpi`` cannot run here (None: it can)."""
    missing = []
    if shutil.which("mpirun") is None:
        missing.append("mpirun (apt-get install -y openmpi-bin libopenmpi-dev)")
    if importlib.util.find_spec("mpi4py") is None:
        missing.append("mpi4py (pip install mpi4py)")
    if not missing:
        return None
    return "--compare mpi needs " + " and ".join(missing)


def mpirun_command(
    config: BenchConfig,
    config_path: str,
    out_path: str,
    hosts_args: Sequence[str] | None = None,
) -> list[str]:
    """The argv that runs one MPI sweep of ``config`` (pure). ``hosts_args``: options
    placing the ranks on other hosts (:func:`ringcomm.bench.multihost.mpi_hosts_args`),
    which choose the transport themselves; ``out_path`` ``-``: rank 0 prints the records."""
    cmd = [shutil.which("mpirun") or "mpirun"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--oversubscribe", "--bind-to", "none", "-np", str(config.world_size)]
    if hosts_args is not None:
        cmd += list(hosts_args)
    elif config.mpi_tcp:
        cmd += [*MPI_TCP_ARGS, "--mca", "btl_tcp_if_include", "lo"]
    cmd += [sys.executable, "-m", "ringcomm.bench.mpi", config_path, out_path]
    return cmd


def run_mpi(config: BenchConfig) -> list[list[Record]]:
    """Run one MPI sweep of ``config`` under mpirun; return each rank's records."""
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-mpi-") as tmp:
        config_path = os.path.join(tmp, "config.json")
        out_path = os.path.join(tmp, "records.json")
        with open(config_path, "w") as f:
            json.dump(dataclasses.asdict(config), f)
        cmd = mpirun_command(config, config_path, out_path)
        try:
            proc = subprocess.run(
                cmd,
                timeout=config.timeout_s,
                stdout=subprocess.PIPE,
                stderr=None,
                text=True,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"mpirun timed out after {config.timeout_s} s") from exc
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(
                f"mpirun exited with status {proc.returncode}: {' '.join(cmd)}\n{proc.stdout}"
            )
        with open(out_path) as f:
            per_rank: list[list[Record]] = json.load(f)
    return per_rank


_OPS = {"sum": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN"}


class MpiImpl:
    """The operations over an mpi4py communicator."""

    name = "mpi"

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm

    def sync(self) -> None:
        self.comm.Barrier()

    def prepare(self, spec: SizeSpec, data: np.ndarray) -> Step:
        MPI, comm = self.MPI, self.comm
        x = data.copy()
        op = spec.op
        if spec.redop is not None:
            if spec.redop not in _OPS:
                raise ValueError(f"MPI has no {spec.redop!r} reduction")
            mpi_op = getattr(MPI, _OPS[spec.redop])
            if x.dtype == np.bool_:
                mpi_op = MPI.LOR if spec.redop in ("sum", "max") else MPI.LAND
        if op == "all_reduce":
            return returning(x, comm.Allreduce, MPI.IN_PLACE, x, mpi_op)
        out = np.empty(spec.out_shape, dtype=x.dtype)
        if op == "reduce_scatter":
            return returning(out, comm.Reduce_scatter_block, x, out, mpi_op)
        if op == "all_gather":
            return returning(out, comm.Allgather, x, out)
        if op == "broadcast":
            return returning(x, comm.Bcast, x, spec.root)
        if op == "all_to_all":
            return returning(out, comm.Alltoall, x, out)
        if op == "sendrecv":
            n, rank = comm.Get_size(), comm.Get_rank()

            def sendrecv() -> np.ndarray:
                reqs = [comm.Isend(x, dest=(rank + 1) % n), comm.Irecv(out, source=(rank - 1) % n)]
                MPI.Request.Waitall(reqs)
                return out

            return sendrecv
        raise ValueError(f"unknown op {op!r}")


def bench(comm: Any, config: BenchConfig) -> list[Record]:
    """This rank's records of the sweep with MPI."""
    return run_sweep([MpiImpl(comm)], config, comm.Get_rank())


def main(argv: Sequence[str] | None = None) -> int:
    """Under mpirun: ``python -m ringcomm.bench.mpi CONFIG.json OUT.json``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(
            "usage: mpirun ... python -m ringcomm.bench.mpi CONFIG.json OUT.json", file=sys.stderr
        )
        return 2
    from mpi4py import MPI

    if args[0].lstrip().startswith("{"):  # the config itself (multi-host: no shared file)
        fields = json.loads(args[0])
    else:
        with open(args[0]) as f:
            fields = json.load(f)
    fields["devices"] = tuple(fields.get("devices", ("host",)))
    config = BenchConfig(**fields)
    comm = MPI.COMM_WORLD
    records = bench(comm, config)
    gathered = comm.gather(records, root=0)
    if comm.Get_rank() == 0:
        if args[1] == "-":
            sys.stdout.write(MARK + json.dumps(gathered) + "\n")
            sys.stdout.flush()
        else:
            with open(args[1], "w") as f:
                json.dump(gathered, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
