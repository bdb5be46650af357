"""The fingerprint of a collective call in a rank's control line of the shared workspace.

A line holds two areas, used by the parity of a call's first round (as the buffers are): a
rank's next call may publish while a slower peer still checks this one. An area's words,
from its start: the sequence number, the compared words (collective and algorithm, dtype,
shape, root, op, chunk_bytes), where a symmetric window holds all_reduce's ``x``, a digest
of the compared words (a quick look compares sequence number and digest only), then the
dimensions (named in mismatch errors; scatter's root tells its shape this way). Equal
digests mean equal calls; every rank that sees a difference raises the same mismatch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.collectives.base import Call
from ringcomm.ops import ReduceOp
from ringcomm.transport.wire import SUPPORTED_DTYPES
from ringcomm.transport.workspace import FP, LINE_WORDS

__all__ = [
    "ALGO_CODES",
    "AREA_WORDS",
    "CHUNK",
    "CODE_DTYPES",
    "COLL",
    "COMPARED",
    "DIGEST",
    "DTYPE",
    "DTYPE_CODES",
    "MAX_DIMS",
    "NDIM",
    "OPCODES",
    "OP_CODES",
    "ROOT",
    "ROP",
    "SEQ",
    "SHAPE",
    "SYM",
    "SYM_OFFSET",
    "area",
    "describe_words",
    "fingerprint_row",
    "first_mismatch",
    "shape_word",
]

#: Collective codes (the low byte of the collective's word).
OPCODES = {
    "all_reduce": 1,
    "reduce_scatter": 2,
    "all_gather": 3,
    "broadcast": 4,
    "reduce": 5,
    "gather": 6,
    "scatter": 7,
    "all_to_all": 8,
    "barrier": 9,
    "all_gather_v": 10,
    "reduce_scatter_v": 11,
    "all_to_all_v": 12,
}
#: The algorithm of a call, in the collective's word (times 256): ranks whose arrays live
#: in different memories (host ``shm``, device windows ``ipc``) must not meet in one call.
ALGO_CODES = {"ipc": 1}
DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(SUPPORTED_DTYPES)}
CODE_DTYPES = {i: dt for dt, i in DTYPE_CODES.items()}
OP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}

# Word indices in an area: the sequence number, then the compared words.
SEQ, COLL, DTYPE, SHAPE, ROOT, ROP, CHUNK = range(7)
COMPARED = 7
SYM, SYM_OFFSET = 7, 8  # all_reduce: the window (index + 1, 0: none) holding x, where
DIGEST = 9  # of words COLL..COMPARED-1
NDIM = 10  # then the dims
AREA_WORDS = (LINE_WORDS - FP) // 2
MAX_DIMS = AREA_WORDS - NDIM - 1


def area(parity: int) -> int:
    """The first word (in a control line) of fingerprint area ``parity`` (0 or 1)."""
    return FP + parity * AREA_WORDS


def shape_word(shape: tuple[int, ...]) -> int:
    """A nonzero word for a tuple of ints, the same in every process (no string hashing)."""
    return (hash(shape) & 0x7FFF_FFFF_FFFF_FFFF) | 1


def fingerprint_row(call: Call, chunk_bytes: int, rank: int) -> tuple[np.ndarray, int]:
    """The area's words for ``call`` (its sequence number left 0) and their digest.

    ``rank``: the caller's group rank (a scatter root must fit its shape in the area).
    """
    row = np.zeros(AREA_WORDS, np.uint64)
    row[COLL] = OPCODES[call.name] | ALGO_CODES.get(call.algo, 0) << 8
    known = call.dtype is not None and call.shape is not None
    row[DTYPE] = DTYPE_CODES[call.dtype] if known else 0  # type: ignore[index]
    row[SHAPE] = shape_word(call.shape) if known else 0  # type: ignore[arg-type]
    row[ROOT] = 0 if call.root is None else call.root + 1
    row[ROP] = 0 if call.op is None else OP_CODES[call.op]
    row[CHUNK] = chunk_bytes  # it sets the rounds: ranks must agree
    shape = call.shape
    if known and shape:
        if len(shape) > MAX_DIMS and call.name == "scatter" and call.root == rank:
            raise ValueError(
                f"rank {rank}: scatter: at most {MAX_DIMS} dimensions on the shared workspace"
            )
        k = min(len(shape), MAX_DIMS)
        row[NDIM] = len(shape)
        row[NDIM + 1 : NDIM + 1 + k] = shape[:k]
    # The digest of the compared words (after seq): equal digests, equal calls.
    row[DIGEST] = shape_word(tuple(int(v) for v in row[COLL:COMPARED]))
    return row, int(row[DIGEST])


def first_mismatch(fps: np.ndarray, me: int) -> int | None:
    """The first rank whose fingerprint (a row of ``fps``) differs from rank ``me``'s, or
    None; an unknown dtype or shape (0: scatter onto nothing) matches any."""
    mine = fps[me, :COMPARED].tolist()
    for r in range(fps.shape[0]):
        theirs = fps[r, :COMPARED].tolist()
        for word, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if a != b and not (word in (DTYPE, SHAPE) and 0 in (a, b)):
                return r
    return None


def describe_words(fp: np.ndarray) -> str:
    """``all_reduce(float32[10], op=sum, chunk_bytes=64) #3`` from a fingerprint."""
    names = {v: k for k, v in OPCODES.items()}
    ops = {v: k for k, v in OP_CODES.items()}
    algos = {v: k for k, v in ALGO_CODES.items()}
    words: list[Any] = fp.tolist()
    parts = []
    dtype = CODE_DTYPES.get(words[DTYPE])
    if dtype is not None:
        ndim = words[NDIM]
        dims = [str(d) for d in words[NDIM + 1 : NDIM + 1 + min(ndim, MAX_DIMS)]]
        if ndim > MAX_DIMS:
            dims.append("...")
        parts.append(f"{dtype}[{'x'.join(dims)}]")
    if words[ROP]:
        parts.append(f"op={ops.get(words[ROP], '?')}")
    if words[ROOT]:
        parts.append(f"root={words[ROOT] - 1}")
    if words[COLL] >> 8:  # (shm, the workspace's own, goes unsaid)
        parts.append(f"algo={algos.get(words[COLL] >> 8, '?')}")
    parts.append(f"chunk_bytes={words[CHUNK]}")
    return f"{names.get(words[COLL] & 0xFF, '?')}({', '.join(parts)}) #{words[SEQ]}"
