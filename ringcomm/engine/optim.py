"""Optimizers over flat buffers: SGD with momentum and Adam.

An optimizer owns its state as flat arrays of ``size`` elements (``size`` = the whole model
for dp, one rank's shard for ZeRO). ``step(pieces)`` updates a list of ``(param, grad,
state_offset)`` pieces, each a 1-D view; the update is elementwise, so updating a shard
piece by piece gives bit-identical results to updating the whole buffer at once (what makes
ZeRO reproduce the single-process run exactly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["OPTIMIZERS", "SGD", "Adam", "Optimizer", "make_optimizer"]

Piece = tuple[Any, Any, int]


class Optimizer:
    def __init__(self, xp: Any, size: int, dtype: Any, lr: float) -> None:
        self.xp, self.size, self.dtype, self.lr = xp, size, dtype, lr
        self.t = 0

    def state_arrays(self) -> list[Any]:
        raise NotImplementedError

    def state_nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state_arrays())

    def step(self, pieces: Sequence[Piece]) -> None:
        self.t += 1
        for p, g, off in pieces:
            if p.size:
                self._update(p, g, off)

    def _update(self, p: Any, g: Any, off: int) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """``buf = momentum * buf + g; p -= lr * buf`` (torch's form; ``buf = g`` at step 1)."""

    def __init__(self, xp: Any, size: int, dtype: Any, lr: float, momentum: float = 0.9) -> None:
        super().__init__(xp, size, dtype, lr)
        self.momentum = momentum
        self.buf = xp.zeros(size, dtype) if momentum else None

    def state_arrays(self) -> list[Any]:
        return [] if self.buf is None else [self.buf]

    def _update(self, p: Any, g: Any, off: int) -> None:
        if self.buf is None:
            p -= self.lr * g
            return
        b = self.buf[off : off + p.size]
        if self.t == 1:
            b[...] = g
        else:
            b *= self.momentum
            b += g
        p -= self.lr * b


class Adam(Optimizer):
    """Adam with bias correction (Kingma & Ba), state ``m`` and ``v`` per parameter."""

    def __init__(
        self,
        xp: Any,
        size: int,
        dtype: Any,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        super().__init__(xp, size, dtype, lr)
        self.b1, self.b2 = betas
        self.eps = eps
        self.m = xp.zeros(size, dtype)
        self.v = xp.zeros(size, dtype)

    def state_arrays(self) -> list[Any]:
        return [self.m, self.v]

    def _update(self, p: Any, g: Any, off: int) -> None:
        xp = self.xp
        m = self.m[off : off + p.size]
        v = self.v[off : off + p.size]
        m *= self.b1
        m += (1 - self.b1) * g
        v *= self.b2
        v += (1 - self.b2) * (g * g)
        c1 = 1 - self.b1**self.t
        c2 = 1 - self.b2**self.t
        p -= (self.lr / c1) * m / (xp.sqrt(v / c2) + self.eps)


OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam}


def make_optimizer(name: str, xp: Any, size: int, dtype: Any, lr: float) -> Optimizer:
    try:
        cls: type[Optimizer] = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}"
        ) from None
    return cls(xp, size, dtype, lr)
