"""The NumPy/CuPy training engine: layers, flat buffers, optimizers, strategies.

Layers (:mod:`.nn`) define forward and backward side by side over ``xp``; a model's
parameters and gradients live in flat contiguous buffers (:mod:`.params`), so buckets and
shards are views; optimizers (:mod:`.optim`) are elementwise over flat pieces. Two models:
an MLP on a seeded synthetic classification task, and a small transformer
(:mod:`.transformer`) on a seeded next-token task (:mod:`.data`), written once for one
rank or a tensor-parallel group (the conjugate pairs and sharded master weights:
:mod:`.tp`). Strategies (``single``, ``dp``, ``zero1``/``zero2``/``zero3``, ``pipeline``,
``ps`` over :mod:`ringcomm.ps`, and ``tp``/``3d`` over a ``dp x pp x tp``
:class:`~ringcomm.engine.mesh.DeviceMesh`, :mod:`.parallel`) share one interface and
registry (:mod:`.strategy`) and talk only to a ``ProcessGroup`` (``ps`` through the
parameter-server client, a sibling layer built on the same group; ``tp``/``3d`` through the
mesh's per-axis sub-groups, passed explicitly). ``ringcomm train`` is :mod:`.cli`, which
also launches the ranks (``run_training``).
"""

from ringcomm.engine.mesh import DeviceMesh
from ringcomm.engine.strategy import STRATEGIES, Strategy, TrainConfig
from ringcomm.engine.train import summarize, train_rank

__all__ = ["STRATEGIES", "DeviceMesh", "Strategy", "TrainConfig", "summarize", "train_rank"]
