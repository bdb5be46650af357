"""The ringcomm torch backend under mpirun or srun, where torch's ``env://`` finds no
variables: ringcomm's resolution (the same as ``rc.init_process_group``'s) gives rank, world
size and a store address, and torch's TCPStore meets there.

    mpirun -np 2 python torch_mpirun.py      # one host: nothing to export
    srun -n 2 python torch_mpirun.py

Prints ``TORCH <rank> <all_reduce result as JSON>``.
"""

import json

import torch
import torch.distributed as dist

import ringcomm.torch_backend  # noqa: F401  (registers the backend "ringcomm")
from ringcomm.config import resolve_init_config

cfg = resolve_init_config()  # RINGCOMM_*, torchrun, OMPI_COMM_WORLD_*, PMI_*, SLURM_* names
dist.init_process_group(
    "ringcomm",
    init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
    rank=cfg.rank,
    world_size=cfg.world_size,
)
t = torch.arange(4, dtype=torch.float32) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"TORCH {dist.get_rank()} {json.dumps(t.tolist())}", flush=True)
dist.destroy_process_group()
