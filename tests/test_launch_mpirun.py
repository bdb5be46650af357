"""``mpirun -np N python x.py`` on one host with nothing exported (DESIGN.md §1).

The derivation itself (address 127.0.0.1, a port from Open MPI's job id) is unit-tested in
test_config.py; here: a real ``mpirun`` (marker needs_mpi), the torch backend under it through
ringcomm's resolution (needs_torch too), and the error when a derived port (mpirun's or
srun's) is taken.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from launcher_results import EXAMPLE, assert_results, clean_env

import ringcomm as rc
from ringcomm.config import mpirun_master_port, slurm_master_port
from ringcomm.errors import RendezvousError


def _mpirun(
    np_: int, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = ["mpirun"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    # -x PYTHONPATH: the ranks import this checkout; nothing else is exported.
    cmd += ["--oversubscribe", "--bind-to", "none", "-np", str(np_), "-x", "PYTHONPATH"]
    return subprocess.run(
        [*cmd, *args],
        env=clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.needs_mpi
@pytest.mark.parametrize("world", [2, 4])
def test_mpirun_on_one_host_needs_no_exports(world: int) -> None:
    proc = _mpirun(world, sys.executable, str(EXAMPLE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_results(proc.stdout, world)


@pytest.mark.needs_mpi
@pytest.mark.needs_torch
def test_torch_backend_under_mpirun_with_ringcomm_resolution() -> None:
    proc = _mpirun(2, sys.executable, str(EXAMPLE.parent / "torch_mpirun.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = sorted(re.findall(r"TORCH (\d+) (\[[^\]]*\])", proc.stdout))
    assert [rank for rank, _ in found] == ["0", "1"], proc.stdout
    for _, values in found:
        assert json.loads(values) == [0.0, 3.0, 6.0, 9.0]


@pytest.mark.parametrize("launcher", ["mpirun", "srun"])
def test_derived_port_taken_is_a_clear_error(launcher: str) -> None:
    if launcher == "mpirun":
        job = "ringcomm-test-port-taken"
        port = mpirun_master_port(job)
        env = {
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "PMIX_NAMESPACE": job,
        }
        origin = f"derived from Open MPI's job id (PMIX_NAMESPACE={job})"
        how = "mpirun -x MASTER_PORT="
    else:
        job = "987654"
        port = slurm_master_port(int(job))
        env = {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": job,
        }
        origin = f"derived from the Slurm job id (SLURM_JOB_ID={job})"
        how = "export MASTER_PORT=29500 before srun"
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", port))
    except OSError:
        holder.close()
        pytest.skip(f"port {port} is in use already")
    holder.listen()
    try:
        with pytest.raises(RendezvousError) as info:
            rc.init_process_group(env=env, timeout_s=5)
    finally:
        holder.close()
    text = str(info.value)
    assert f"Port {port} was {origin} and is taken" in text, text
    assert how in text, text
