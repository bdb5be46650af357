"""Rank-seeded inputs and the results every implementation must produce (pure NumPy).

Every rank can build every rank's input (``rank_input(spec, r, seed)``), so each rank computes
its own expected output locally, the way mpi4py's tests do: no extra communication, and the
same oracle for ringcomm, Gloo and MPI. Inputs are small integers (floats hold them exactly,
so sums of a few ranks are exact in any order); reductions follow rank order with NumPy
ufuncs, AVG as SUM then one division (integers truncated toward zero), bool SUM/MAX as OR
and PROD/MIN as AND (``ringcomm.ops``' semantics).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.bench.spec import SizeSpec

__all__ = ["count_wrong", "expected_output", "rank_input"]

_RTOL = {"float16": 1e-3, "float32": 1e-5, "float64": 1e-12}


def rank_input(spec: SizeSpec, rank: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s input buffer for ``spec`` (shape ``spec.in_shape``), deterministic."""
    rng = np.random.default_rng([seed, rank, spec.count])
    dtype = np.dtype(spec.dtype)
    n = int(np.prod(spec.in_shape))
    if dtype.kind == "b":
        flat = rng.integers(0, 2, size=n, dtype=np.int8).astype(bool)
    elif dtype.kind == "u":
        flat = rng.integers(0, 9, size=n, dtype=np.int8).astype(dtype)
    else:
        flat = rng.integers(-4, 5, size=n, dtype=np.int8).astype(dtype)
    return flat.reshape(spec.in_shape)


def _reduce(spec: SizeSpec, seed: int) -> np.ndarray:
    """Every rank's input reduced with ``spec.redop``, in rank order."""
    redop = spec.redop or "sum"
    boolean = np.dtype(spec.dtype).kind == "b"
    ufunc: Any
    if boolean:
        if redop == "avg":
            raise TypeError("avg is not defined on bool")
        ufunc = np.logical_or if redop in ("sum", "max") else np.logical_and
    else:
        ufunc = {
            "sum": np.add,
            "avg": np.add,
            "prod": np.multiply,
            "max": np.maximum,
            "min": np.minimum,
        }[redop]
    acc = rank_input(spec, 0, seed).copy()
    with np.errstate(all="ignore"):
        for r in range(1, spec.world_size):
            ufunc(acc, rank_input(spec, r, seed), out=acc)
        if redop == "avg":
            n = spec.world_size
            if acc.dtype.kind == "f":
                acc = np.divide(acc, np.asarray(n, dtype=acc.dtype)).astype(acc.dtype)
            else:  # truncate toward zero, like C and NCCL
                acc = (np.sign(acc) * (np.abs(acc) // n)).astype(acc.dtype)
    return acc


def expected_output(spec: SizeSpec, rank: int, seed: int) -> np.ndarray:
    """What rank ``rank``'s output buffer (shape ``spec.out_shape``) must hold."""
    n = spec.world_size
    if spec.op == "all_reduce":
        return _reduce(spec, seed)
    if spec.op == "reduce_scatter":
        return np.asarray(_reduce(spec, seed)[rank])
    if spec.op == "all_gather":
        return np.stack([rank_input(spec, r, seed) for r in range(n)])
    if spec.op == "broadcast":
        return rank_input(spec, spec.root, seed)
    if spec.op == "all_to_all":
        return np.stack([rank_input(spec, r, seed)[rank] for r in range(n)])
    if spec.op == "sendrecv":
        return rank_input(spec, (rank - 1) % n, seed)
    raise ValueError(f"unknown op {spec.op!r}")


def count_wrong(got: np.ndarray, expected: np.ndarray) -> int:
    """Elements of ``got`` that differ from ``expected`` (floats: a dtype-sized tolerance,
    NaN equal to NaN); a shape mismatch counts every element wrong."""
    if not isinstance(got, np.ndarray) and hasattr(got, "get"):
        got = got.get()  # a device array (CuPy, or the host stand-in)
    elif not isinstance(got, np.ndarray) and hasattr(got, "cpu"):
        got = got.cpu().numpy()  # a torch tensor (Gloo or NCCL on CUDA tensors)
    got = np.asarray(got)
    if got.shape != expected.shape:
        return int(expected.size)
    if expected.dtype.kind == "f":
        rtol = _RTOL.get(expected.dtype.name, 1e-6)
        ok = np.isclose(got, expected, rtol=rtol, atol=0.0, equal_nan=True)
    else:
        ok = got == expected
    return int(ok.size - np.count_nonzero(ok))
