"""Under torchrun: the last rank goes down (CAUSE) while the others wait in an all_reduce.

    python -m torch.distributed.run --standalone --nproc-per-node 3 THIS CAUSE REPORT_DIR

CAUSE: exception | sys_exit | sigterm (none with destroy_process_group). Reports as
exit_scenario.py does: ``fail.R`` (when it went down), ``peer.R`` (what a peer's call
raised). Order without sleeps: each peer sends the last rank a tensor first.
"""

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import ringcomm.torch_backend  # noqa: F401  (registers "ringcomm")


def write(report_dir, name, value):
    path = os.path.join(report_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


cause, report_dir = sys.argv[1], sys.argv[2]
dist.init_process_group("ringcomm")
rank, world = dist.get_rank(), dist.get_world_size()
last = world - 1
t = torch.ones(1000)
dist.all_reduce(t)
token = torch.zeros(1, dtype=torch.int64)
if rank == last:
    for peer in range(world - 1):
        dist.recv(token, src=peer, tag=99)
    write(report_dir, f"fail.{rank}", time.time())
    if cause == "exception":
        raise RuntimeError(f"user bug on rank {rank}")
    if cause == "sys_exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(30)
    sys.exit("still alive 30 s after SIGTERM")
dist.send(token, dst=last, tag=99)
try:
    dist.all_reduce(t)
except Exception as exc:
    write(
        report_dir,
        f"peer.{rank}",
        {"type": type(exc).__name__, "message": str(exc), "t": time.time()},
    )
    raise
write(report_dir, f"peer.{rank}", {"type": "ok", "message": "", "t": time.time()})
