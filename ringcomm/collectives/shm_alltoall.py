"""The row collectives on the shared workspace (``shm``): scatter and all_to_all, where
rank j takes row j.

scatter: the root copies its W rows in, sync, rank j copies row j of the root's buffer
out (a rank without ``out`` learns dtype and shape from the root's fingerprint).
all_to_all: every rank copies its W rows in, sync, rank j copies row j of every buffer out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.collectives.base import Call
from ringcomm.collectives.shm_base import Job, ShmEngine, row_rounds
from ringcomm.collectives.shm_fingerprint import CODE_DTYPES, DTYPE, NDIM
from ringcomm.errors import CollectiveMismatchError

__all__ = ["all_to_all", "scatter"]


def _root_rows(engine: ShmEngine, job: Job, out: np.ndarray | None, root: int) -> np.ndarray:
    """After the first sync, on a rank other than the root: ``out`` (made if None) as the
    root's fingerprint says its rows are (dtype and shape), or a mismatch."""
    words = engine.fingerprints()[root].tolist()
    dtype = CODE_DTYPES[words[DTYPE]]
    shape = tuple(words[NDIM + 1 : NDIM + 1 + words[NDIM]])
    if out is None:
        return np.empty(shape[1:], dtype)
    if out.dtype != dtype or tuple(out.shape) != shape[1:]:
        raise CollectiveMismatchError(
            f"rank {engine.ws.rank}: {job.desc}: out is {out.dtype}{list(out.shape)} but "
            f"the root scatters rows of {dtype}{list(shape[1:])}"
        )
    return out


def scatter(engine: ShmEngine, job: Job, call: Call) -> Any:
    n, me, root = engine.ws.world_size, engine.ws.rank, call.root
    assert root is not None
    engine.publish(job, call)
    x, out = call.x, call.out
    dtype: np.dtype[Any] = np.dtype(np.uint8)
    rows: np.ndarray | None = None
    m, per, rounds = 0, 1, 1
    if me == root:
        assert x is not None
        dtype, rows = x.dtype, x.reshape(n, -1)
        m = rows.shape[1]
        per, rounds = engine.rounds(m * dtype.itemsize, dtype.itemsize, n)
    res: np.ndarray | None = None
    i = 0
    while i < rounds:
        b = engine.next_buffer()
        lo = i * per
        if rows is not None:
            hi = min(lo + per, m)
            blocks = engine.view(root, b, dtype, n * (hi - lo)).reshape(n, hi - lo)
            np.copyto(blocks, rows[:, lo:hi])
        engine.sync(job, f"sync 1 of round {i + 1}/{rounds}")
        if i == 0:
            engine.check(job)
            if me != root:  # dtype and shape as the root says
                out = _root_rows(engine, job, out, root)
                dtype = out.dtype
                m = int(np.prod(out.shape, dtype=np.int64))
                per, rounds = engine.rounds(m * dtype.itemsize, dtype.itemsize, n)
            assert out is not None
            res = out.reshape(-1)
        hi = min(lo + per, m)
        if hi > lo:
            assert res is not None
            blocks = engine.view(root, b, dtype, n * (hi - lo)).reshape(n, hi - lo)
            np.copyto(res[lo:hi], blocks[me])
        i += 1
    return out


def all_to_all(engine: ShmEngine, job: Job, call: Call) -> Any:
    x, out = call.x, call.out
    assert x is not None and out is not None
    n, me = engine.ws.world_size, engine.ws.rank
    dst = out.reshape(n, -1)
    for lo, hi, blocks in row_rounds(engine, job, call, x.reshape(n, -1)):
        for r in range(n):
            np.copyto(dst[r, lo:hi], blocks[r][me])
    return out
