"""Server-side optimizers ("updaters"): apply an averaged gradient to a flat shard in place.

An updater is stateless itself; its per-shard state is a dict of arrays (0-d arrays for
counters) made by :meth:`Updater.new_state`, which the server checkpoints with the shard.

Invariant: the elementwise math is written operation by operation in the order of the
training engine's optimizers (``ringcomm.engine.optim``), so a worker applying the engine's
optimizer to the averaged gradient and a server applying these produce bit-identical
parameters (NumPy in-place ops on the same dtype, Python-float scalars). The SGD and Adam
formulas: docs/architecture.md, section "ps/updaters.py".
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

__all__ = ["SGD", "UPDATERS", "Adam", "Updater", "make_updater"]

State = dict[str, np.ndarray]


class Updater(Protocol):
    name: str

    def new_state(self, param: np.ndarray) -> State:
        """Fresh state for a shard shaped like ``param`` (checkpointed with it)."""

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        """``param`` (1-D) updated in place from ``grad`` (same shape and dtype)."""

    def config(self) -> dict[str, Any]:
        """Hyper-parameters, for checkpoints and messages."""


class SGD:
    name = "sgd"

    def __init__(self, lr: float = 0.01, momentum: float = 0.0) -> None:
        self.lr, self.momentum = float(lr), float(momentum)

    def new_state(self, param: np.ndarray) -> State:
        state = {"t": np.zeros((), np.int64)}
        if self.momentum:
            state["buf"] = np.zeros_like(param)
        return state

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        state["t"] += 1
        if not self.momentum:
            param -= self.lr * grad
            return
        buf = state["buf"]
        if int(state["t"]) == 1:
            buf[...] = grad
        else:
            buf *= self.momentum
            buf += grad
        param -= self.lr * buf

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "momentum": self.momentum}


class Adam:
    name = "adam"

    def __init__(
        self, lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        self.lr, self.eps = float(lr), float(eps)
        self.b1, self.b2 = (float(b) for b in betas)

    def new_state(self, param: np.ndarray) -> State:
        return {"t": np.zeros((), np.int64), "m": np.zeros_like(param), "v": np.zeros_like(param)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        state["t"] += 1
        t = int(state["t"])
        m, v = state["m"], state["v"]
        m *= self.b1
        m += (1 - self.b1) * grad
        v *= self.b2
        v += (1 - self.b2) * (grad * grad)
        c1 = 1 - self.b1**t
        c2 = 1 - self.b2**t
        param -= (self.lr / c1) * m / (np.sqrt(v / c2) + self.eps)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "betas": (self.b1, self.b2), "eps": self.eps}


UPDATERS: dict[str, type] = {"sgd": SGD, "adam": Adam}


def make_updater(name: str, **kwargs: Any) -> Updater:
    try:
        cls = UPDATERS[name]
    except KeyError:
        raise ValueError(
            f"ps: unknown optimizer {name!r}; expected one of {sorted(UPDATERS)}"
        ) from None
    return cls(**kwargs)  # type: ignore[no-any-return]
