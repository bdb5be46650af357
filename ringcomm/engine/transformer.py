"""A small GPT-style transformer, written once for one rank or a tensor-parallel group.

Pre-norm blocks (causal multi-head attention with a fused QKV projection, a GELU MLP
``d -> 4d -> d``), no dropout, an untied LM head; activations ``(batch, seq, d_model)``.
Every layer takes a :class:`~ringcomm.engine.tp.TPContext`: with one rank the conjugate
pairs are the identity; over T ranks the layers are Megatron-LM's (vocab-parallel
:class:`TokenEmbedding`, heads and MLP split in :class:`Block`, a column-parallel
:class:`LMHead`, :class:`VocabParallelCrossEntropy` that never gathers the full logits,
optional sequence parallelism).

Invariants: the loss is summed over tokens and divided by the *global* token count, so
partial batches' gradients add up; uneven splits are refused, not padded
(:func:`check_tp_sizes`); ``init`` draws ``single``'s master weights on every rank. Model,
tp layout, no QKV bias: docs/architecture.md, section "engine/transformer.py".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ringcomm.device.xp import get_xp
from ringcomm.engine.nn import GELU, Layer, Params, ReLU, layer_norm_backward, layer_norm_forward
from ringcomm.engine.tp import ParamSpec, TPContext, enter_tp, exit_tp, local_shape, shard

__all__ = [
    "Block",
    "FinalNorm",
    "LMHead",
    "TPLayer",
    "TokenEmbedding",
    "VocabParallelCrossEntropy",
    "check_tp_sizes",
    "transformer",
]

#: MLP hidden width = MLP_RATIO * d_model.
MLP_RATIO = 4


def check_tp_sizes(
    vocab: int, seq_len: int, d_model: int, heads: int, tp: int, sequence_parallel: bool
) -> str | None:
    """What makes these sizes unusable over ``tp`` ranks (None: usable). Refused, not
    padded: heads, vocab (and seq_len with sequence parallel) must divide by tp."""
    if min(vocab, seq_len, d_model, heads) < 1:
        return "--vocab, --seq-len, --d-model and --heads must be >= 1"
    if d_model % heads:
        return f"--d-model {d_model} does not divide into --heads {heads}"
    if heads % tp:
        return f"--heads {heads} does not split over --tp {tp} (uneven heads are refused)"
    if vocab % tp:
        return f"--vocab {vocab} does not split over --tp {tp} (uneven vocab is refused)"
    if sequence_parallel and seq_len % tp:
        return f"--sequence-parallel: --seq-len {seq_len} does not split over --tp {tp}"
    return None


class TPLayer(Layer):
    """A layer whose parameters are :class:`ParamSpec` s sliced over ``tp``."""

    tp: TPContext

    def specs(self) -> list[ParamSpec]:
        return []

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(s.name, local_shape(s, self.tp.size)) for s in self.specs()]

    def masters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """The full (unsharded) initial parameters, drawn from ``rng`` in spec order."""
        raise NotImplementedError

    def init(self, rng: np.random.Generator, p: Params) -> None:
        masters = self.masters(rng)
        for s in self.specs():
            view = p[s.name]
            view[...] = get_xp(view).asarray(
                shard(s, masters[s.name], self.tp.rank, self.tp.size), dtype=view.dtype
            )

    def seq_local(self, seq: int) -> int:
        """Sequence length of this rank's residual stream."""
        return seq // self.tp.size if self.tp.sequence_parallel else seq

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tp={self.tp.size})"


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return rng.standard_normal(shape) * std


def _flat(x: Any) -> Any:
    return x.reshape(-1, x.shape[-1])


def _scatter_rows(rows: Any, inside: Any, values: Any, n_rows: int) -> Any:
    """``(n_rows, d)``: row ``r`` the sum of the ``values`` rows whose index in ``rows``
    is ``r`` (entries where ``inside`` is False left out). A one-hot matrix product, not
    ``add.at`` (which CuPy lacks): deterministic on a GPU, no atomics, one code path."""
    xp = get_xp(values)
    hits = (rows.reshape(-1, 1) == xp.arange(n_rows).reshape(1, -1)) & inside.reshape(-1, 1)
    return hits.astype(values.dtype).T @ values


class TokenEmbedding(TPLayer):
    """Vocab-parallel token embedding plus learned positions (replicated)."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, tp: TPContext) -> None:
        self.vocab, self.seq_len, self.d = vocab, seq_len, d_model
        self.in_features, self.out_features = seq_len, d_model
        self.tp = tp

    def specs(self) -> list[ParamSpec]:
        return [
            ParamSpec("tok", (self.vocab, self.d), dim=0),
            ParamSpec("pos", (self.seq_len, self.d), sp_reduce=True),
        ]

    def masters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {
            "tok": _normal(rng, (self.vocab, self.d), 1.0),
            "pos": _normal(rng, (self.seq_len, self.d), 0.1),
        }

    def cost(self) -> float:
        return float(self.d)

    def _positions(self) -> slice:
        s = self.seq_local(self.seq_len)
        t = self.tp.rank if self.tp.sequence_parallel else 0
        return slice(t * s, (t + 1) * s)

    def forward(self, p: Params, x: Any) -> tuple[Any, Any]:
        xp = get_xp(p["tok"])
        ids = xp.asarray(x)
        v_local = p["tok"].shape[0]
        local = ids - self.tp.rank * v_local
        inside = (local >= 0) & (local < v_local)
        rows = xp.where(inside, local, 0)
        y = p["tok"][rows] * inside[..., None]  # ids outside the shard contribute zero
        y = exit_tp(self.tp).forward(self.tp, y)
        return y + p["pos"][self._positions()], (rows, inside)

    def backward(self, p: Params, g: Params, cache: Any, dy: Any) -> Any:
        rows, inside = cache
        g["pos"][self._positions()] += dy.sum(axis=0)
        dy = exit_tp(self.tp).backward(self.tp, dy)
        g["tok"] += _scatter_rows(rows, inside, _flat(dy), g["tok"].shape[0])
        return None  # token ids have no gradient


class Block(TPLayer):
    """Pre-norm transformer block: causal multi-head attention and an MLP, residuals."""

    def __init__(self, d_model: int, heads: int, tp: TPContext, act: str = "gelu") -> None:
        self.d, self.heads, self.hd = d_model, heads, d_model // heads
        self.f = MLP_RATIO * d_model
        self.in_features = self.out_features = d_model
        self.tp = tp
        self.local_heads = heads // tp.size
        self.act: Layer = GELU(self.f // tp.size) if act == "gelu" else ReLU(self.f // tp.size)

    def specs(self) -> list[ParamSpec]:
        d, h, hd, f = self.d, self.heads, self.hd, self.f
        return [
            ParamSpec("ln1.gamma", (d,), sp_reduce=True),
            ParamSpec("ln1.beta", (d,), sp_reduce=True),
            # column-parallel: rank t keeps its heads' q, k and v columns
            ParamSpec("attn.Wqkv", (d, 3 * d), dim=1, view=(d, 3, h, hd), split=2),
            # row-parallel: the rows of its heads; the bias is added after g (replicated)
            ParamSpec("attn.Wo", (d, d), dim=0),
            ParamSpec("attn.bo", (d,), sp_reduce=True),
            ParamSpec("ln2.gamma", (d,), sp_reduce=True),
            ParamSpec("ln2.beta", (d,), sp_reduce=True),
            ParamSpec("mlp.W1", (d, f), dim=1),
            ParamSpec("mlp.b1", (f,), dim=0),
            ParamSpec("mlp.W2", (f, d), dim=0),
            ParamSpec("mlp.b2", (d,), sp_reduce=True),
        ]

    def masters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        d, f = self.d, self.f
        return {
            "ln1.gamma": np.ones(d),
            "ln1.beta": np.zeros(d),
            "attn.Wqkv": _normal(rng, (d, 3 * d), 1 / math.sqrt(d)),
            "attn.Wo": _normal(rng, (d, d), 1 / math.sqrt(d)),
            "attn.bo": _normal(rng, (d,), 0.02),
            "ln2.gamma": np.ones(d),
            "ln2.beta": np.zeros(d),
            "mlp.W1": _normal(rng, (d, f), 1 / math.sqrt(d)),
            "mlp.b1": _normal(rng, (f,), 0.02),
            "mlp.W2": _normal(rng, (f, d), 1 / math.sqrt(f)),
            "mlp.b2": _normal(rng, (d,), 0.02),
        }

    def cost(self) -> float:
        return float(12 * self.d * self.d)

    # -- attention over this rank's heads -----------------------------------------------
    def _attn_forward(self, p: Params, a: Any) -> tuple[Any, Any]:
        """``a``: the full-sequence normalised input ``(b, S, d)``; returns the partial
        (pre-g) output ``(b, S, d)``."""
        xp = get_xp(a)
        b, S, _ = a.shape
        hl, hd = self.local_heads, self.hd
        qkv = a @ p["attn.Wqkv"]  # (b, S, 3*hl*hd); no bias (see the module docstring)
        q, k, v = qkv.reshape(b, S, 3, hl, hd).transpose(2, 0, 3, 1, 4)  # each (b, hl, S, hd)
        scale = 1.0 / math.sqrt(hd)
        scores = (q @ k.swapaxes(-1, -2)) * scale  # (b, hl, S, S)
        causal = xp.tril(xp.ones((S, S), dtype=bool))
        scores = xp.where(causal, scores, -xp.inf)
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = xp.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        o = (probs @ v).transpose(0, 2, 1, 3).reshape(b, S, hl * hd)
        return o @ p["attn.Wo"], (a, q, k, v, probs, o)

    def _attn_backward(self, p: Params, g: Params, cache: Any, dy: Any) -> Any:
        a, q, k, v, probs, o = cache
        b, S, _ = a.shape
        hl, hd = self.local_heads, self.hd
        g["attn.Wo"] += _flat(o).T @ _flat(dy)
        do = (dy @ p["attn.Wo"].T).reshape(b, S, hl, hd).transpose(0, 2, 1, 3)
        dv = probs.swapaxes(-1, -2) @ do
        dprobs = do @ v.swapaxes(-1, -2)
        dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
        scale = 1.0 / math.sqrt(hd)
        dq = (dscores @ k) * scale
        dk = (dscores.swapaxes(-1, -2) @ q) * scale
        dqkv = get_xp(dq).stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(b, S, 3 * hl * hd)
        g["attn.Wqkv"] += _flat(a).T @ _flat(dqkv)
        return dqkv @ p["attn.Wqkv"].T

    # -- the block ------------------------------------------------------------------------
    def forward(self, p: Params, x: Any) -> tuple[Any, Any]:
        tp, enter, exit_ = self.tp, enter_tp(self.tp), exit_tp(self.tp)
        a, ln1 = layer_norm_forward(x, p["ln1.gamma"], p["ln1.beta"])
        y, attn = self._attn_forward(p, enter.forward(tp, a))
        h = x + exit_.forward(tp, y) + p["attn.bo"]
        a2, ln2 = layer_norm_forward(h, p["ln2.gamma"], p["ln2.beta"])
        a2 = enter.forward(tp, a2)
        u, act = self.act.forward({}, a2 @ p["mlp.W1"] + p["mlp.b1"])
        z = exit_.forward(tp, u @ p["mlp.W2"])
        return h + z + p["mlp.b2"], (ln1, attn, ln2, a2, act, u)

    def backward(self, p: Params, g: Params, cache: Any, dy: Any) -> Any:
        tp, enter, exit_ = self.tp, enter_tp(self.tp), exit_tp(self.tp)
        ln1, attn, ln2, a2, act, u = cache
        lead = tuple(range(dy.ndim - 1))
        # MLP half: out = h + g(gelu(f(LN2(h)) @ W1 + b1) @ W2) + b2
        g["mlp.b2"] += dy.sum(axis=lead)
        dz = exit_.backward(tp, dy)
        g["mlp.W2"] += _flat(u).T @ _flat(dz)
        du = self.act.backward({}, {}, act, dz @ p["mlp.W2"].T)
        g["mlp.W1"] += _flat(a2).T @ _flat(du)
        g["mlp.b1"] += _flat(du).sum(axis=0)
        da2 = enter.backward(tp, du @ p["mlp.W1"].T)
        dh_ln, dg2, db2 = layer_norm_backward(p["ln2.gamma"], ln2, da2)
        g["ln2.gamma"] += dg2
        g["ln2.beta"] += db2
        dh = dy + dh_ln
        # attention half: h = x + g(Attn(f(LN1(x)))) + bo
        g["attn.bo"] += dh.sum(axis=lead)
        da = enter.backward(tp, self._attn_backward(p, g, attn, exit_.backward(tp, dh)))
        dx_ln, dg1, db1 = layer_norm_backward(p["ln1.gamma"], ln1, da)
        g["ln1.gamma"] += dg1
        g["ln1.beta"] += db1
        return dh + dx_ln


class FinalNorm(TPLayer):
    """The LayerNorm before the LM head (replicated; on sequence shards under sp)."""

    def __init__(self, d_model: int, tp: TPContext) -> None:
        self.in_features = self.out_features = d_model
        self.tp = tp

    def specs(self) -> list[ParamSpec]:
        d = self.in_features
        return [ParamSpec("gamma", (d,), sp_reduce=True), ParamSpec("beta", (d,), sp_reduce=True)]

    def masters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"gamma": np.ones(self.in_features), "beta": np.zeros(self.in_features)}

    def cost(self) -> float:
        return float(self.in_features)

    def forward(self, p: Params, x: Any) -> tuple[Any, Any]:
        return layer_norm_forward(x, p["gamma"], p["beta"])

    def backward(self, p: Params, g: Params, cache: Any, dy: Any) -> Any:
        dx, dgamma, dbeta = layer_norm_backward(p["gamma"], cache, dy)
        g["gamma"] += dgamma
        g["beta"] += dbeta
        return dx


class LMHead(TPLayer):
    """``logits = f(x) @ W``, ``W`` (d, vocab) column-parallel: each rank its vocab shard's
    logits ``(b, S, vocab/T)``. No bias."""

    def __init__(self, d_model: int, vocab: int, tp: TPContext) -> None:
        self.in_features, self.out_features = d_model, vocab
        self.tp = tp

    def specs(self) -> list[ParamSpec]:
        return [ParamSpec("W", (self.in_features, self.out_features), dim=1)]

    def masters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        d, v = self.in_features, self.out_features
        return {"W": _normal(rng, (d, v), 1 / math.sqrt(d))}

    def cost(self) -> float:
        return float(self.in_features * self.out_features)

    def forward(self, p: Params, x: Any) -> tuple[Any, Any]:
        a = enter_tp(self.tp).forward(self.tp, x)
        return a @ p["W"], a

    def backward(self, p: Params, g: Params, cache: Any, dy: Any) -> Any:
        a = cache
        g["W"] += _flat(a).T @ _flat(dy)
        return enter_tp(self.tp).backward(self.tp, dy @ p["W"].T)


class VocabParallelCrossEntropy:
    """Loss head over vocab-sharded logits ``(b, S, V/T)`` and next-token ``targets (b, S)``:
    ``forward -> (sum over tokens of -log softmax[target] / scale, cache)``; ``backward(cache)
    -> dlogits`` (no communication: each rank its shard's columns). ``scale`` is the global
    number of tokens, so gradients from batch slices add up to the full-batch mean."""

    def __init__(self, scale: float, tp: TPContext | None = None) -> None:
        self.scale = float(scale)
        self.tp = tp if tp is not None else TPContext()

    def forward(self, logits: Any, targets: Any) -> tuple[Any, Any]:
        xp, tp = get_xp(logits), self.tp
        z = _flat(logits)
        n, v_local = z.shape
        m = z.max(axis=1)
        if tp.size > 1:
            tp.group.all_reduce(m, op="max")
        z = z - m[:, None]
        e = xp.exp(z)
        local = xp.asarray(targets).reshape(-1) - tp.rank * v_local
        inside = (local >= 0) & (local < v_local)
        cols = xp.where(inside, local, 0)  # (targets in another shard: column 0, masked)
        sums = xp.stack([e.sum(axis=1), xp.where(inside, z[xp.arange(n), cols], 0)])
        if tp.size > 1:
            tp.group.all_reduce(sums)  # [sum of exp, target logit] over the vocab shards
        loss = (xp.log(sums[0]) - sums[1]).sum() / self.scale
        return loss, (e / sums[0][:, None], cols, inside, logits.shape)

    def backward(self, cache: Any) -> Any:
        probs, cols, inside, shape = cache
        xp = get_xp(probs)
        d = probs
        # one entry per row (no repeated index): minus one at the target, if in this shard
        d[xp.arange(d.shape[0]), cols] -= inside.astype(d.dtype)
        return (d / self.scale).reshape(shape)


def transformer(
    vocab: int,
    seq_len: int,
    d_model: int,
    heads: int,
    layers: int,
    tp: TPContext | None = None,
    act: str = "gelu",
) -> list[Layer]:
    """``[TokenEmbedding, Block x layers, FinalNorm, LMHead]`` over ``tp`` (None: one rank)."""
    tp = tp if tp is not None else TPContext()
    problem = check_tp_sizes(vocab, seq_len, d_model, heads, tp.size, tp.sequence_parallel)
    if problem is not None:
        raise ValueError(problem)
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if act not in ("gelu", "relu"):
        raise ValueError(f"unknown activation {act!r}; expected gelu or relu")
    out: list[Layer] = [TokenEmbedding(vocab, seq_len, d_model, tp)]
    out += [Block(d_model, heads, tp, act) for _ in range(layers)]
    out += [FinalNorm(d_model, tp), LMHead(d_model, vocab, tp)]
    return out
