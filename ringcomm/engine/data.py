"""A deterministic, seeded synthetic classification task a small MLP can learn.

Inputs are standard normal; the label of ``x`` is the arg-max of a fixed random two-layer
"teacher" ``tanh(x @ T1) @ T2`` drawn from the seed. Step ``s``'s global batch is drawn
from ``default_rng([seed, 1, s])`` on the host, identical on every rank and for every
strategy; each rank then takes its rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["SyntheticClassification", "SyntheticNextToken"]


class SyntheticClassification:
    def __init__(
        self, in_features: int, classes: int, batch_size: int, seed: int, dtype: Any = np.float64
    ) -> None:
        if in_features <= 0 or classes <= 1 or batch_size <= 0:
            raise ValueError(
                f"need in_features > 0, classes > 1, batch_size > 0; got {in_features}, "
                f"{classes}, {batch_size}"
            )
        self.in_features, self.classes, self.batch_size = in_features, classes, batch_size
        self.seed, self.dtype = seed, np.dtype(dtype)
        rng = np.random.default_rng([seed, 0])
        width = max(2 * classes, 16)
        self.t1 = rng.standard_normal((in_features, width)) / np.sqrt(in_features)
        self.t2 = rng.standard_normal((width, classes))

    def batch(
        self, step: int, rows: tuple[int, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host arrays ``(x, labels)`` of step ``step``'s global batch, rows ``[a, b)``."""
        rng = np.random.default_rng([self.seed, 1, step])
        x = rng.standard_normal((self.batch_size, self.in_features))
        # Labels from the whole batch, then sliced: a matrix product over a row subset may
        # round differently, which could flip a near-tie.
        labels = np.argmax(np.tanh(x @ self.t1) @ self.t2, axis=1).astype(np.int64)
        if rows is not None:
            x, labels = x[rows[0] : rows[1]], labels[rows[0] : rows[1]]
        return np.ascontiguousarray(x, dtype=self.dtype), np.ascontiguousarray(labels)


class SyntheticNextToken:
    """A seeded next-token task a small transformer can learn: sequences of a fixed random
    Markov chain over ``vocab`` tokens (each token has a preferred successor, drawn with
    probability 0.8, else the successor is uniform), ``seq_len + 1`` tokens per sample;
    inputs are tokens ``[0, S)``, targets ``[1, S]``. Step ``s``'s global batch is drawn
    from ``default_rng([seed, 1, s])``, identical on every rank; each rank takes its rows."""

    def __init__(self, vocab: int, seq_len: int, batch_size: int, seed: int) -> None:
        if vocab < 2 or seq_len < 1 or batch_size < 1:
            raise ValueError(
                f"need vocab > 1, seq_len > 0, batch_size > 0; got {vocab}, {seq_len}, {batch_size}"
            )
        self.vocab, self.seq_len, self.batch_size, self.seed = vocab, seq_len, batch_size, seed
        self.successor = np.random.default_rng([seed, 0]).permutation(vocab)

    def batch(
        self, step: int, rows: tuple[int, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host int64 arrays ``(ids, targets)``, each ``(rows, seq_len)``."""
        rng = np.random.default_rng([self.seed, 1, step])
        b, s = self.batch_size, self.seq_len
        tokens = np.empty((b, s + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, self.vocab, b)
        follow = rng.random((b, s)) < 0.8
        noise = rng.integers(0, self.vocab, (b, s))
        for t in range(s):
            tokens[:, t + 1] = np.where(follow[:, t], self.successor[tokens[:, t]], noise[:, t])
        if rows is not None:
            tokens = tokens[rows[0] : rows[1]]
        return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
