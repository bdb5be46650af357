"""The transformer without sockets: every layer's and the whole model's gradients against
central finite differences (float64), the vocab-parallel loss against the plain formula,
sharding master weights and back, the next-token data, the mesh's group order, and that
`single` learns the task."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ringcomm.cli.train import run_training
from ringcomm.engine.data import SyntheticNextToken
from ringcomm.engine.mesh import DeviceMesh, mesh_groups
from ringcomm.engine.nn import backward_layers, forward_layers
from ringcomm.engine.parallel import stage_span
from ringcomm.engine.params import init_layer, layer_views, param_shapes
from ringcomm.engine.strategy import TrainConfig
from ringcomm.engine.tp import ParamSpec, TPContext, local_shape, shard, unshard
from ringcomm.engine.transformer import (
    Block,
    FinalNorm,
    LMHead,
    TokenEmbedding,
    VocabParallelCrossEntropy,
    check_tp_sizes,
    transformer,
)
from ringcomm.schedule.partition import flat_layout


def _numeric_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(x)
    flat = x.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        g.reshape(-1)[i] = (fp - fm) / (2 * eps)
    return g


def _random_params(layer, rng):
    return {n: rng.standard_normal(s) for n, s in layer.param_shapes()}


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_block_gradients_match_finite_differences(act: str) -> None:
    rng = np.random.default_rng(0)
    layer = Block(8, 2, TPContext(), act=act)
    p = _random_params(layer, rng)
    x = rng.standard_normal((2, 5, 8))
    y, _ = layer.forward(p, x)
    w = rng.standard_normal(y.shape)

    def f() -> float:
        return float((layer.forward(p, x)[0] * w).sum())

    g = {n: np.zeros_like(v) for n, v in p.items()}
    dx = layer.backward(p, g, layer.forward(p, x)[1], w)
    np.testing.assert_allclose(dx, _numeric_grad(f, x), rtol=1e-6, atol=1e-7)
    for n, value in p.items():
        np.testing.assert_allclose(g[n], _numeric_grad(f, value), rtol=1e-6, atol=1e-7, err_msg=n)


@pytest.mark.parametrize("layer", [FinalNorm(6, TPContext()), LMHead(6, 5, TPContext())])
def test_norm_and_head_gradients(layer) -> None:
    rng = np.random.default_rng(1)
    p = _random_params(layer, rng)
    x = rng.standard_normal((3, 4, 6))
    w = rng.standard_normal(layer.forward(p, x)[0].shape)

    def f() -> float:
        return float((layer.forward(p, x)[0] * w).sum())

    g = {n: np.zeros_like(v) for n, v in p.items()}
    dx = layer.backward(p, g, layer.forward(p, x)[1], w)
    np.testing.assert_allclose(dx, _numeric_grad(f, x), rtol=1e-6, atol=1e-8)
    for n, value in p.items():
        np.testing.assert_allclose(g[n], _numeric_grad(f, value), rtol=1e-6, atol=1e-8)


def test_embedding_gradient_counts_repeated_ids() -> None:
    rng = np.random.default_rng(2)
    layer = TokenEmbedding(6, 4, 3, TPContext())
    p = _random_params(layer, rng)
    ids = np.array([[1, 1, 5, 0], [5, 2, 1, 1]])
    y, cache = layer.forward(p, ids)
    np.testing.assert_array_equal(y, p["tok"][ids] + p["pos"])
    w = rng.standard_normal(y.shape)
    g = {n: np.zeros_like(v) for n, v in p.items()}
    assert layer.backward(p, g, cache, w) is None
    f = lambda: float((layer.forward(p, ids)[0] * w).sum())  # noqa: E731
    for n in p:
        np.testing.assert_allclose(g[n], _numeric_grad(f, p[n]), rtol=1e-6, atol=1e-8)


def test_cross_entropy_is_the_plain_formula() -> None:
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 3, 7))
    targets = rng.integers(0, 7, (2, 3))
    ce = VocabParallelCrossEntropy(scale=6)
    loss, cache = ce.forward(logits, targets)
    p = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    want = -np.log(np.take_along_axis(p, targets[..., None], -1)).sum() / 6
    assert float(loss) == pytest.approx(want, rel=1e-12)
    d = ce.backward(cache)
    num = _numeric_grad(lambda: float(ce.forward(logits, targets)[0]), logits)
    np.testing.assert_allclose(d, num, rtol=1e-6, atol=1e-9)
    assert np.isfinite(float(ce.forward(logits * 1e4, targets)[0]))  # stable


def test_whole_transformer_gradient_through_flat_buffers() -> None:
    """Every parameter of a 2-block model (~1.9k) against central differences."""
    layers = transformer(7, 5, 8, 2, 2)
    L = len(layers)
    lay = flat_layout(param_shapes(layers), [(0, L)], 1)
    params, grads = np.zeros(lay.total), np.zeros(lay.total)
    pv = [layer_views(lay, params, i) for i in range(L)]
    gv = [layer_views(lay, grads, i) for i in range(L)]
    for i in range(L):
        init_layer(layers, i, pv[i], seed=4)
    params += np.random.default_rng(0).standard_normal(lay.total) * 0.1  # off LN's 1/0
    ids, targets = SyntheticNextToken(7, 5, 3, seed=1).batch(0)
    ce = VocabParallelCrossEntropy(15)

    def loss() -> float:
        out, _ = forward_layers(layers, range(L), ids, pv.__getitem__)
        return float(ce.forward(out, targets)[0])

    out, caches = forward_layers(layers, range(L), ids, pv.__getitem__)
    _, c = ce.forward(out, targets)
    backward_layers(layers, range(L), caches, ce.backward(c), pv.__getitem__, gv.__getitem__)
    np.testing.assert_allclose(grads, _numeric_grad(loss, params), rtol=1e-5, atol=1e-8)
    assert np.abs(grads).max() > 1e-2


def test_attention_is_causal() -> None:
    rng = np.random.default_rng(5)
    layer = Block(8, 2, TPContext())
    p = _random_params(layer, rng)
    x = rng.standard_normal((1, 6, 8))
    y, _ = layer.forward(p, x)
    x2 = x.copy()
    x2[0, 4:] += 1.0  # change the future
    y2, _ = layer.forward(p, x2)
    np.testing.assert_allclose(y2[0, :4], y[0, :4], rtol=0, atol=1e-14)
    assert not np.allclose(y2[0, 4:], y[0, 4:])


def test_shard_and_unshard_invert_each_other() -> None:
    rng = np.random.default_rng(6)
    d, h, hd = 8, 4, 2
    specs = [
        ParamSpec("Wqkv", (d, 3 * d), dim=1, view=(d, 3, h, hd), split=2),
        ParamSpec("bqkv", (3 * d,), dim=0, view=(3, h, hd), split=1),
        ParamSpec("Wo", (d, d), dim=0),
        ParamSpec("b", (d,)),
    ]
    for spec in specs:
        master = rng.standard_normal(spec.shape)
        for T in (1, 2, 4):
            pieces = [shard(spec, master, t, T) for t in range(T)]
            assert all(pc.shape == local_shape(spec, T) for pc in pieces)
            np.testing.assert_array_equal(unshard(spec, pieces), master)
    # the fused QKV's shard t holds q, k and v columns of heads [2t, 2t+2)
    master = np.arange(d * 3 * d, dtype=float).reshape(d, 3 * d)
    piece = shard(specs[0], master, 1, 2).reshape(d, 3, 2, hd)
    np.testing.assert_array_equal(piece, master.reshape(d, 3, h, hd)[:, :, 2:4])


def test_uneven_sizes_are_refused() -> None:
    assert check_tp_sizes(8, 4, 8, 2, 2, False) is None
    assert "heads" in check_tp_sizes(8, 4, 12, 3, 2, False)
    assert "vocab" in check_tp_sizes(9, 4, 8, 2, 2, False)
    assert "seq-len" in check_tp_sizes(8, 5, 8, 2, 2, True)
    assert check_tp_sizes(8, 5, 8, 2, 2, False) is None  # sequence only matters under sp
    with pytest.raises(ValueError, match="heads"):
        transformer(8, 4, 12, 3, 1, TPContext(object(), 0, 2))


def test_next_token_data_is_seeded_and_learnable() -> None:
    d = SyntheticNextToken(11, 6, 20, seed=3)
    ids, targets = d.batch(2)
    ids2, targets2 = SyntheticNextToken(11, 6, 20, seed=3).batch(2)
    assert np.array_equal(ids, ids2) and np.array_equal(targets, targets2)
    assert np.array_equal(ids[:, 1:], targets[:, :-1])  # targets are the next tokens
    sub = d.batch(2, rows=(5, 9))
    assert np.array_equal(sub[0], ids[5:9]) and np.array_equal(sub[1], targets[5:9])
    follows = (targets == d.successor[ids]).mean()
    assert 0.7 < follows < 0.95


def test_mesh_groups_order_and_coordinates() -> None:
    groups = mesh_groups(2, 2, 2)
    assert groups[:2] == [("dp", (0, 4)), ("dp", (1, 5))]
    assert [g for a, g in groups if a == "pp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert [g for a, g in groups if a == "tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [a for a, _ in mesh_groups(1, 2, 4)] == ["pp"] * 4 + ["tp"] * 2
    for dp, pp, tp in [(2, 1, 4), (1, 4, 2), (4, 2, 1)]:
        seen = sorted(r for _, g in mesh_groups(dp, pp, tp) for r in g)
        assert len(seen) == (dp > 1) * 8 + (pp > 1) * 8 + (tp > 1) * 8
    mesh = DeviceMesh(None)
    assert mesh.coords == {"dp": 0, "pp": 0, "tp": 0} and mesh.tp.size == 1
    with pytest.raises(ValueError, match="does not match"):
        DeviceMesh(None, dp=2)


def test_stage_spans_cover_the_model_once() -> None:
    for blocks, stages in [(2, 2), (3, 2), (4, 4), (5, 3)]:
        spans = [stage_span(blocks, stages, s) for s in range(stages)]
        assert spans[0][0] == 0 and spans[-1][1] == blocks + 3
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert all(b - a >= 1 for a, b in spans)


def test_single_learns_the_next_token_task() -> None:
    cfg = TrainConfig(
        model="transformer",
        steps=30,
        vocab=16,
        seq_len=8,
        d_model=16,
        heads=2,
        depth=1,
        batch_size=16,
        lr=1e-2,
        verbose=False,
    )
    losses = run_training(cfg)[0]["losses"]
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
