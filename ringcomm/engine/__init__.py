"""The NumPy/CuPy training engine: layers, flat buffers, optimizers, strategies.

Layers (:mod:`.nn`) define forward and backward side by side over ``xp``; a model's
parameters and gradients live in flat contiguous buffers (:mod:`.params`), so buckets and
shards are views; optimizers (:mod:`.optim`) are elementwise over flat pieces; the data is
a seeded synthetic classification task (:mod:`.data`). Strategies (``single``, ``dp``,
``zero1``/``zero2``/``zero3``, ``pipeline``, and ``ps`` over :mod:`ringcomm.ps`) share one
interface and registry (:mod:`.strategy`) and talk only to a ``ProcessGroup`` (``ps``
through the parameter-server client, a sibling layer built on the same group). ``ringcomm train`` is :mod:`.cli`, which also launches the ranks (``run_training``).
"""

from .strategy import STRATEGIES, Strategy, TrainConfig
from .train import summarize, train_rank

__all__ = ["STRATEGIES", "Strategy", "TrainConfig", "summarize", "train_rank"]
