"""What the fast-lane tests share, over sockets (test_fast_lane.py) and over the in-memory
transport (test_fast_lane_logic.py): the lane counter and the interop calls."""

from __future__ import annotations

import collections
import hashlib
from typing import Any

import numpy as np

import ringcomm as rc
from ringcomm.ops import reference_reduce

__all__ = ["CASES", "count_lane", "interop_calls", "is_blocking", "lane_input"]


def count_lane(pg: rc.ProcessGroup) -> collections.Counter[str]:
    """Wrap the engine's exchange: counts 'done', 'not taken' and 'handed over'."""
    engine = pg.core.progress
    counts: collections.Counter[str] = collections.Counter()
    original = engine.exchange

    def exchange(*args: Any, **kwargs: Any) -> Any:
        got = original(*args, **kwargs)
        counts["done" if type(got) is list else "handed over" if got else "not taken"] += 1
        return got

    engine.exchange = exchange  # type: ignore[method-assign]
    return counts


def lane_input(
    i: int, rank: int, dtype: np.dtype[Any], shape: tuple[int, ...], op: str
) -> np.ndarray:
    """Call ``i``'s operand on ``rank`` (any rank can compute every other's)."""
    rng = np.random.default_rng([i, rank])
    size = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "b":
        a = rng.random(size) < 0.5
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    elif op == "prod":
        a = rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), size)
    else:
        a = rng.integers(-8, 9, size).astype(np.float64)
    return a.astype(dtype).reshape(shape)


CASES = [
    (dtype, op, shape)
    for dtype in ("float32", "float16", "float64", "int64", "int8", "uint16", "bool")
    for op in ("sum", "avg", "max", "min", "prod")
    for shape in ((2,), (3, 2), ())
    if not (dtype == "bool" and op == "avg")
] + [  # from the inline size (4 KiB) up: header and payload frames
    ("float32", "sum", (1024,)),
    ("float64", "max", (2000,)),
    ("int32", "prod", (64, 64)),
]


def is_blocking(i: int, rank: int) -> bool:
    """Whether call ``i`` of :func:`interop_calls` is blocking (the lane) on ``rank``."""
    return bool((i + rank) % 3)


def interop_calls(pg: rc.ProcessGroup) -> tuple[list[str], list[str], dict[str, int]]:
    """Each call: some ranks blocking (the lane), others async (the regular op). Returns
    the calls whose result is wrong, a digest of each result and the lane's counts."""
    counts = count_lane(pg)
    failures, digests = [], []
    n, me = pg.world_size, pg.rank
    for i, (name, op, shape) in enumerate(CASES * 2):  # twice: the plans are cached then
        dtype = np.dtype(name)
        x = lane_input(i, me, dtype, shape, op)
        if is_blocking(i, me):
            out = pg.all_reduce(x, op=op)
        else:
            out = pg.all_reduce(x, op=op, async_op=True).wait()
        want = reference_reduce(op, [lane_input(i, r, dtype, shape, op) for r in range(n)])
        if out is not x or not np.array_equal(x, want):
            failures.append(f"{name} {op} {shape}: {x.tolist()} != {want.tolist()}")
        digests.append(hashlib.sha256(x.tobytes()).hexdigest())
    return failures, digests, dict(counts)
