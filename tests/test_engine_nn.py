"""Engine building blocks without sockets: gradients against finite differences, flat
buffers as views, optimizers piecewise = whole, the seeded data, and that `single` learns."""

from __future__ import annotations

import numpy as np
import pytest

from ringcomm.cli.train import run_training
from ringcomm.engine.data import SyntheticClassification
from ringcomm.engine.nn import (
    GELU,
    LayerNorm,
    Linear,
    ReLU,
    SoftmaxCrossEntropy,
    backward_layers,
    forward_layers,
    mlp,
)
from ringcomm.engine.optim import SGD, Adam
from ringcomm.engine.params import init_layer, layer_views, param_shapes
from ringcomm.engine.strategy import StrategyUnavailable, TrainConfig, array_module, strategy_class
from ringcomm.schedule.partition import flat_layout


def _numeric_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


def _check_layer(layer, x: np.ndarray, seed: int = 0) -> None:
    """Analytic input and parameter gradients of sum(y * w) match central differences."""
    rng = np.random.default_rng(seed)
    p = {n: rng.standard_normal(s) for n, s in layer.param_shapes()}
    y, _ = layer.forward(p, x)
    w = rng.standard_normal(y.shape)

    def f() -> float:
        return float((layer.forward(p, x)[0] * w).sum())

    g = {n: np.zeros(s) for n, s in layer.param_shapes()}
    _, cache = layer.forward(p, x)
    dx = layer.backward(p, g, cache, w)
    np.testing.assert_allclose(dx, _numeric_grad(f, x), rtol=1e-6, atol=1e-8)
    for n, value in p.items():
        np.testing.assert_allclose(g[n], _numeric_grad(f, value), rtol=1e-6, atol=1e-8)
    # backward accumulates into the gradient views
    g2 = {n: v.copy() for n, v in g.items()}
    layer.backward(p, g2, layer.forward(p, x)[1], w)
    for n, value in g.items():
        np.testing.assert_allclose(g2[n], 2 * value, rtol=1e-12)


@pytest.mark.parametrize(
    "layer", [Linear(4, 3), GELU(4), LayerNorm(4)], ids=lambda layer: type(layer).__name__
)
def test_layer_gradients_match_finite_differences(layer) -> None:
    x = np.random.default_rng(1).standard_normal((5, 4))
    _check_layer(layer, x)


def test_relu_gradient_away_from_the_kink() -> None:
    x = np.random.default_rng(2).standard_normal((6, 4))
    x[np.abs(x) < 1e-3] = 0.5  # finite differences are wrong at 0
    _check_layer(ReLU(4), x)


def test_cross_entropy_value_and_gradient() -> None:
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((7, 4))
    labels = rng.integers(0, 4, 7)
    ce = SoftmaxCrossEntropy(scale=10)
    loss, cache = ce.forward(logits, labels)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert float(loss) == pytest.approx(-np.log(p[np.arange(7), labels]).sum() / 10, rel=1e-12)
    d = ce.backward(cache)
    np.testing.assert_allclose(
        d, _numeric_grad(lambda: float(ce.forward(logits, labels)[0]), logits), rtol=1e-6, atol=1e-9
    )
    # stable for huge logits
    big, _ = ce.forward(logits * 1e4, labels)
    assert np.isfinite(big)


def test_whole_mlp_gradient_through_flat_buffer_views() -> None:
    layers = mlp(5, 6, 2, 3)
    L = len(layers)
    lay = flat_layout(param_shapes(layers), [(0, L)], 1)
    params, grads = np.zeros(lay.total), np.zeros(lay.total)
    pv = [layer_views(lay, params, i) for i in range(L)]
    gv = [layer_views(lay, grads, i) for i in range(L)]
    for i in range(L):
        init_layer(layers, i, pv[i], seed=4)
        for v in pv[i].values():
            assert np.shares_memory(v, params)  # views, not copies
    data = SyntheticClassification(5, 3, 8, seed=4)
    x, labels = data.batch(0)
    ce = SoftmaxCrossEntropy(scale=8)

    def loss() -> float:
        out, _ = forward_layers(layers, range(L), x, pv.__getitem__)
        return float(ce.forward(out, labels)[0])

    out, caches = forward_layers(layers, range(L), x, pv.__getitem__)
    _, c = ce.forward(out, labels)
    backward_layers(layers, range(L), caches, ce.backward(c), pv.__getitem__, gv.__getitem__)
    assert all(c is None for c in caches)  # activations freed during backward
    np.testing.assert_allclose(grads, _numeric_grad(loss, params), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("cls", [SGD, Adam])
def test_optimizer_update_piecewise_equals_whole(cls) -> None:
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal(37)
    whole = cls(np, 37, np.float64, 0.01)
    parts = cls(np, 37, np.float64, 0.01)
    pw, pp = p0.copy(), p0.copy()
    cuts = [(0, 10), (10, 11), (11, 30), (30, 37)]
    for _ in range(4):
        g = rng.standard_normal(37)
        whole.step([(pw, g, 0)])
        parts.step([(pp[a:b], g[a:b], a) for a, b in cuts[::-1]])  # any order
    assert np.array_equal(pw, pp)  # elementwise: bit-identical
    assert not np.array_equal(pw, p0)


def test_adam_first_step_moves_each_parameter_by_lr() -> None:
    opt = Adam(np, 4, np.float64, 0.1)
    p = np.zeros(4)
    opt.step([(p, np.array([1.0, -2.0, 3.0, -4.0]), 0)])
    np.testing.assert_allclose(p, [-0.1, 0.1, -0.1, 0.1], rtol=1e-6)
    assert opt.state_nbytes() == 2 * 4 * 8


def test_sgd_momentum_matches_the_formula() -> None:
    opt = SGD(np, 1, np.float64, 0.5, momentum=0.9)
    p = np.zeros(1)
    opt.step([(p, np.array([1.0]), 0)])  # buf = 1, p = -0.5
    opt.step([(p, np.array([1.0]), 0)])  # buf = 1.9, p = -1.45
    assert p[0] == pytest.approx(-1.45)


def test_synthetic_data_is_seeded_and_sliceable() -> None:
    d = SyntheticClassification(8, 4, 30, seed=7)
    x, y = d.batch(3)
    x2, y2 = SyntheticClassification(8, 4, 30, seed=7).batch(3)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    xs, ys = d.batch(3, rows=(10, 20))
    assert np.array_equal(xs, x[10:20]) and np.array_equal(ys, y[10:20])
    assert not np.array_equal(d.batch(4)[0], x)
    assert len(set(y.tolist())) > 1  # not a constant label
    assert (
        SyntheticClassification(8, 4, 30, seed=7, dtype=np.float32).batch(0)[0].dtype == np.float32
    )


def test_single_learns_the_task() -> None:
    cfg = TrainConfig(
        steps=40, batch_size=64, hidden=64, depth=2, in_features=16, classes=4, lr=3e-3
    )
    losses = run_training(cfg)[0]["losses"]
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])


def test_registry_and_devices() -> None:
    assert strategy_class("zero3").name == "zero3"
    assert strategy_class("ps").name == "ps"
    with pytest.raises(StrategyUnavailable):
        strategy_class("nope")
    assert array_module("cpu") is np
    with pytest.raises(StrategyUnavailable):
        array_module("tpu")
