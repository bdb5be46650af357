"""Run under torchrun: `python -m torch.distributed.run --standalone --nproc-per-node 2 THIS`.

Joins with torch's environment names only (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT via
env://), trains DDP on the ringcomm world group and on a Gloo group from the same seeds, and
prints one OK line per rank if both end bitwise equal.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm.torch_backend  # noqa: F401  (registers "ringcomm")


def train(group, rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        loss = ddp(torch.randn(8, 8, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main():
    torch.set_num_threads(1)
    dist.init_process_group("ringcomm")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (rank, world) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    assert dist.get_backend() == "ringcomm"
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world * (world + 1) // 2))), t
    ours = train(dist.group.WORLD, rank)
    theirs = train(dist.new_group(backend="gloo"), rank)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    dist.destroy_process_group()
    print(f"RINGCOMM_TORCHRUN_OK rank {rank}/{world}", flush=True)


if __name__ == "__main__":
    main()
