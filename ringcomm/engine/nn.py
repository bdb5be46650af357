"""Layers with forward and backward side by side, over ``xp`` (NumPy or CuPy).

Layers are stateless about parameters: ``forward(p, x)`` takes the layer's parameter views
``p`` (a dict name -> array) and returns ``(y, cache)``; ``backward(p, g, cache, dy)``
*adds* the parameter gradients into the views ``g`` and returns ``dx``. Where parameters
and gradients live (a full flat buffer, a just-gathered ZeRO-3 segment, a stage's buffer) is
the strategy's business; the layer only sees views. Accumulating (``+=``) lets pipeline
micro-batches sum into one gradient buffer; strategies zero gradients before each step.

:class:`SoftmaxCrossEntropy` returns the *sum* of per-sample losses divided by ``scale``
(the global batch size), so gradients from batch slices add up to the full-batch mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringcomm.device.xp import get_xp

__all__ = [
    "GELU",
    "Layer",
    "LayerNorm",
    "Linear",
    "ReLU",
    "SoftmaxCrossEntropy",
    "backward_layers",
    "forward_layers",
    "layer_norm_backward",
    "layer_norm_forward",
    "mlp",
]

Params = dict[str, Any]


class Layer:
    """Base: no parameters. Subclasses define ``forward`` and ``backward``."""

    in_features: int
    out_features: int

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return []

    def init(self, rng: np.random.Generator, p: Params) -> None:
        """Fill the parameter views ``p`` from ``rng`` (host NumPy generator)."""

    def cost(self) -> float:
        """Relative compute per sample (for balancing pipeline stages)."""
        return float(self.out_features)

    def forward(self, p: Params, x: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def backward(self, p: Params, g: Params, cache: Any, dy: Any) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_features}, {self.out_features})"


def _fill(view: Any, host: np.ndarray) -> None:
    """Copy a host array into ``view`` (NumPy or CuPy)."""
    xp = get_xp(view)
    view[...] = xp.asarray(host, dtype=view.dtype)


class Linear(Layer):
    """``y = x @ W + b``; W is ``(in, out)``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        self.in_features, self.out_features = in_features, out_features

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("W", (self.in_features, self.out_features)), ("b", (self.out_features,))]

    def init(self, rng: np.random.Generator, p: Params) -> None:
        bound = 1.0 / math.sqrt(self.in_features)  # torch.nn.Linear's default range
        _fill(p["W"], rng.uniform(-bound, bound, size=p["W"].shape))
        _fill(p["b"], rng.uniform(-bound, bound, size=p["b"].shape))

    def cost(self) -> float:
        return float(self.in_features * self.out_features)

    def forward(self, p: Params, x: Any) -> tuple[Any, Any]:
        return x @ p["W"] + p["b"], x

    def backward(self, p: Params, g: Params, cache: Any, dy: Any) -> Any:
        x = cache
        g["W"] += x.T @ dy
        g["b"] += dy.sum(axis=0)
        return dy @ p["W"].T


class ReLU(Layer):
    def __init__(self, features: int) -> None:
        self.in_features = self.out_features = features

    def forward(self, p: Params, x: Any) -> tuple[Any, Any]:
        mask = x > 0
        return x * mask, mask

    def backward(self, p: Params, g: Params, cache: Any, dy: Any) -> Any:
        return dy * cache


_GELU_C = math.sqrt(2.0 / math.pi)


class GELU(Layer):
    """The tanh approximation: ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``."""

    def __init__(self, features: int) -> None:
        self.in_features = self.out_features = features

    def forward(self, p: Params, x: Any) -> tuple[Any, Any]:
        xp = get_xp(x)
        t = xp.tanh(_GELU_C * (x + 0.044715 * x**3))
        return 0.5 * x * (1.0 + t), (x, t)

    def backward(self, p: Params, g: Params, cache: Any, dy: Any) -> Any:
        x, t = cache
        dt = (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x * x)
        return dy * (0.5 * (1.0 + t) + 0.5 * x * dt)


class LayerNorm(Layer):
    """Per-sample normalisation over features, then ``* gamma + beta``."""

    def __init__(self, features: int, eps: float = 1e-5) -> None:
        self.in_features = self.out_features = features
        self.eps = eps

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("gamma", (self.in_features,)), ("beta", (self.in_features,))]

    def init(self, rng: np.random.Generator, p: Params) -> None:
        p["gamma"][...] = 1
        p["beta"][...] = 0

    def forward(self, p: Params, x: Any) -> tuple[Any, Any]:
        return layer_norm_forward(x, p["gamma"], p["beta"], self.eps)

    def backward(self, p: Params, g: Params, cache: Any, dy: Any) -> Any:
        dx, dgamma, dbeta = layer_norm_backward(p["gamma"], cache, dy)
        g["gamma"] += dgamma
        g["beta"] += dbeta
        return dx


def layer_norm_forward(x: Any, gamma: Any, beta: Any, eps: float = 1e-5) -> tuple[Any, Any]:
    """Normalise over the last axis (features), then ``* gamma + beta``."""
    xp = get_xp(x)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    xhat = xc * rstd
    return xhat * gamma + beta, (xhat, rstd)


def layer_norm_backward(gamma: Any, cache: Any, dy: Any) -> tuple[Any, Any, Any]:
    """``(dx, dgamma, dbeta)``; the parameter gradients summed over every leading axis."""
    xhat, rstd = cache
    lead = tuple(range(dy.ndim - 1))
    dxhat = dy * gamma
    dx = rstd * (
        dxhat
        - dxhat.mean(axis=-1, keepdims=True)
        - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    )
    return dx, (dy * xhat).sum(axis=lead), dy.sum(axis=lead)


class SoftmaxCrossEntropy:
    """Loss head: ``forward(logits, labels) -> (sum of -log softmax[label] / scale, cache)``;
    ``backward(cache) -> dlogits``."""

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    def forward(self, logits: Any, labels: Any) -> tuple[Any, Any]:
        xp = get_xp(logits)
        z = logits - logits.max(axis=1, keepdims=True)
        e = xp.exp(z)
        s = e.sum(axis=1, keepdims=True)
        rows = xp.arange(logits.shape[0])
        loss = (xp.log(s[:, 0]) - z[rows, labels]).sum() / self.scale
        return loss, (e / s, labels)

    def backward(self, cache: Any) -> Any:
        probs, labels = cache
        xp = get_xp(probs)
        d = probs.copy()
        d[xp.arange(d.shape[0]), labels] -= 1.0
        return d / self.scale


def mlp(in_features: int, hidden: int, depth: int, classes: int, act: str = "gelu") -> list[Layer]:
    """``depth`` blocks ``Linear -> act -> LayerNorm`` (the first from ``in_features``),
    then ``Linear(hidden, classes)``."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    acts: dict[str, Callable[[int], Layer]] = {"gelu": GELU, "relu": ReLU}
    if act not in acts:
        raise ValueError(f"unknown activation {act!r}; expected one of {sorted(acts)}")
    layers: list[Layer] = []
    d = in_features
    for _ in range(depth):
        layers += [Linear(d, hidden), acts[act](hidden), LayerNorm(hidden)]
        d = hidden
    layers.append(Linear(d, classes))
    return layers


def forward_layers(
    layers: Sequence[Layer],
    indices: Sequence[int],
    x: Any,
    params_of: Callable[[int], Params],
    done: Callable[[int], None] | None = None,
) -> tuple[Any, list[Any]]:
    """Run ``layers[i]`` for ``i`` in ``indices``; ``params_of(i)`` gives its parameter views
    (a ZeRO-3 strategy gathers there), ``done(i)`` runs right after (it drops them)."""
    caches = []
    for i in indices:
        x, cache = layers[i].forward(params_of(i), x)
        caches.append(cache)
        if done is not None:
            done(i)
    return x, caches


def backward_layers(
    layers: Sequence[Layer],
    indices: Sequence[int],
    caches: list[Any],
    dy: Any,
    params_of: Callable[[int], Params],
    grads_of: Callable[[int], Params],
    done: Callable[[int], None] | None = None,
) -> Any:
    """Backward through ``indices`` (given in forward order) last to first; ``done(i)`` runs
    once layer ``i``'s gradients are complete (a bucket may then be launched)."""
    for pos in range(len(indices) - 1, -1, -1):
        i = indices[pos]
        dy = layers[i].backward(params_of(i), grads_of(i), caches[pos], dy)
        caches[pos] = None  # free the activation as soon as it is used
        if done is not None:
            done(i)
    return dy
