"""ringcomm as a ``torch.distributed`` backend (CPU and CUDA tensors), in pure Python.

    import torch.distributed as dist
    import ringcomm.torch_backend  # registers the backend "ringcomm"
    dist.init_process_group("ringcomm")          # env:// (torchrun), tcp://, file://, store=
    model = torch.nn.parallel.DistributedDataParallel(model)   # or fully_shard(model)

The only package of ringcomm that imports torch (``pip install ringcomm[torch]``).
Importing it registers the backend, once, for "cpu" and "cuda": torch then calls
:func:`~ringcomm.torch_backend.process_group.create_process_group` for the default group and
every ``new_group`` this rank is in, each on a ringcomm group of its own. Modules:
``process_group`` (torch's ProcessGroup), ``work`` (its Work, futures), ``store`` (forming
the group), ``reductions``, ``movement``, ``p2p`` (the calls), ``tensors`` (tensors as
arrays), ``device`` (CUDA tensors, streams). How it fits torch: docs/architecture.md.
"""

from __future__ import annotations

import torch.distributed as dist

from ringcomm.torch_backend.process_group import (
    BACKEND_NAME,
    RingcommProcessGroup,
    create_process_group,
)
from ringcomm.torch_backend.work import RingcommWork

__all__ = ["BACKEND_NAME", "RingcommProcessGroup", "RingcommWork"]


def register() -> None:
    """Register the backend with torch (idempotent: importing this package does it)."""
    if not hasattr(dist.Backend, BACKEND_NAME.upper()):
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cpu", "cuda"])


register()
