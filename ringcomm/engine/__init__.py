"""The NumPy/CuPy training engine: layers, flat buffers, optimizers, strategies.

Layers (:mod:`.nn`) define forward and backward side by side over ``xp``; a model's
parameters and gradients live in flat contiguous buffers (:mod:`.params`), so buckets and
shards are views; optimizers (:mod:`.optim`) are elementwise over flat pieces. Two models:
an MLP on a seeded classification task, and a small transformer (:mod:`.transformer`) on a
seeded next-token task (:mod:`.data`), written once for one rank or a tensor-parallel group
(:mod:`.tp`). Strategies (``single``, ``dp``, ``zero1``/``zero2``/``zero3``, ``pipeline``,
``ps`` over :mod:`ringcomm.ps`, ``tp``/``3d`` over a ``dp x pp x tp``
:class:`~ringcomm.engine.mesh.DeviceMesh`) share one interface and registry
(:mod:`.strategy`) and talk only to a ``ProcessGroup`` (or sub-groups of it, passed
explicitly). ``ringcomm train`` is :mod:`ringcomm.cli.train`, which also launches the ranks.
"""

from ringcomm.engine.mesh import DeviceMesh
from ringcomm.engine.strategy import STRATEGIES, Strategy, TrainConfig
from ringcomm.engine.train import summarize, train_rank

__all__ = ["STRATEGIES", "DeviceMesh", "Strategy", "TrainConfig", "summarize", "train_rank"]
