"""Reduce ops: every dtype x op against the oracle, plus the documented edge semantics."""

from __future__ import annotations

import tracemalloc
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.ops import (
    SUPPORTED_DTYPES,
    ReduceOp,
    _ufunc_name,
    check_op_dtype,
    finalize,
    parse_op,
    reduce_in_order,
    reduce_into,
    reference_reduce,
)

ALL_OPS = list(ReduceOp)
INT_DTYPES = [d for d in SUPPORTED_DTYPES if d.kind in "iu"]
FLOAT_DTYPES = [d for d in SUPPORTED_DTYPES if d.kind == "f"]


@pytest.fixture(autouse=True)
def _warnings_are_errors():
    # Wraps, inf and nan must never warn: any NumPy warning fails the test.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def random_array(rng: np.random.Generator, dtype: np.dtype, size: int) -> np.ndarray:
    """Values spanning the dtype (ints: the full range, so sums and products wrap)."""
    if dtype.kind == "b":
        return rng.integers(0, 2, size).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    return (rng.standard_normal(size) * 10).astype(dtype)


def trunc_div(value: int, divisor: int) -> int:
    """Python-int division truncating toward zero."""
    q = abs(value) // divisor
    return q if value >= 0 else -q


# ----------------------------------------------------------------------------- parse_op


@pytest.mark.parametrize("op", ALL_OPS)
def test_parse_op_accepts_enum_and_any_case(op):
    assert parse_op(op) is op
    assert parse_op(op.value) is op
    assert parse_op(op.value.upper()) is op
    assert parse_op(op.value.capitalize()) is op
    assert op == op.value  # a str enum: compares equal to its name


@pytest.mark.parametrize("bad", ["mean", "", "su m", 3, None])
def test_parse_op_rejects_unknown_and_lists_valid_ops(bad):
    with pytest.raises(ValueError, match=r"'sum'.*'avg'.*'max'.*'min'.*'prod'"):
        parse_op(bad)


# ----------------------------------------------------------------------------- check_op_dtype


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", ALL_OPS)
def test_check_op_dtype_accepts_supported(op, dtype):
    if op is ReduceOp.AVG and dtype.kind == "b":
        with pytest.raises(TypeError, match="bool"):
            check_op_dtype(op, dtype)
    else:
        check_op_dtype(op, dtype)
        check_op_dtype(op.value, dtype.name)  # strings work for both


@pytest.mark.parametrize("dtype", ["complex64", "complex128", "object", "U3", "M8[s]", "V4"])
def test_check_op_dtype_rejects_unsupported(dtype):
    with pytest.raises(TypeError, match="unsupported dtype"):
        check_op_dtype("sum", dtype)


def test_check_op_dtype_unknown_op_is_value_error():
    with pytest.raises(ValueError):
        check_op_dtype("mean", np.float32)


# ----------------------------------------------------------------------------- reduce_into


VALID_COMBOS = [
    (op, dtype)
    for op in ALL_OPS
    for dtype in SUPPORTED_DTYPES
    if not (op is ReduceOp.AVG and dtype.kind == "b")  # raises, tested below
]


@pytest.mark.parametrize(("op", "dtype"), VALID_COMBOS, ids=str)
def test_reduce_then_finalize_matches_oracle(op, dtype):
    rng = np.random.default_rng(7)
    inputs = [random_array(rng, dtype, 257) for _ in range(5)]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        reduce_into(op, acc, x)
    finalize(op, acc, len(inputs))
    assert acc.dtype == dtype
    np.testing.assert_array_equal(acc, reference_reduce(op, inputs))


@pytest.mark.parametrize(("op", "dtype"), VALID_COMBOS, ids=str)
@pytest.mark.parametrize("out_is", [None, 0, 1])
def test_reduce_in_order_matches_reduce_into_bitwise(op, dtype, out_is):
    """The hot-path fold gives reduce_into's bits, also written over srcs[0] or srcs[1]."""
    rng = np.random.default_rng(11)
    inputs = [random_array(rng, dtype, 65) for _ in range(4)]
    want = inputs[0].copy()
    for x in inputs[1:]:
        reduce_into(op, want, x)
    srcs = [x.copy() for x in inputs]
    out = np.empty_like(srcs[0]) if out_is is None else srcs[out_is]
    ufunc = getattr(np, _ufunc_name(op, dtype))
    reduce_in_order(ufunc, srcs, out, silence=dtype.kind == "f")
    assert out.tobytes() == want.tobytes()


def test_reduce_in_order_keeps_float_overflow_silent():
    big = np.full(3, 6e4, np.float16)
    out = np.empty_like(big)
    reduce_in_order(np.add, [big, big, -big], out, silence=True)  # inf, then inf - 6e4
    assert np.isinf(out).all()
    inf = np.full(2, np.inf, np.float16)
    reduce_in_order(np.add, [inf, -inf], out[:2], silence=True)
    assert np.isnan(out[:2]).all()


def test_reduce_into_is_in_place_on_a_strided_view():
    base = np.zeros(10, np.int32)
    view = base[::2]
    reduce_into("sum", view, np.arange(5, dtype=np.int32))
    np.testing.assert_array_equal(base, [0, 0, 1, 0, 2, 0, 3, 0, 4, 0])


def test_reduce_into_reads_read_only_received_buffers():
    raw = np.arange(6, dtype=np.float32).tobytes()
    incoming = np.frombuffer(raw, dtype=np.float32)  # read-only, flat
    assert not incoming.flags.writeable
    acc = np.ones((2, 3), np.float32)
    reduce_into(ReduceOp.MAX, acc, incoming)  # flat incoming viewed as acc's shape
    np.testing.assert_array_equal(acc, [[1, 1, 2], [3, 4, 5]])


def test_reduce_into_rejects_dtype_and_size_mismatch():
    acc = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="dtype"):
        reduce_into("sum", acc, np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="elements"):
        reduce_into("sum", acc, np.zeros(3, np.float32))
    with pytest.raises(TypeError):
        reduce_into("sum", [0.0], np.zeros(1, np.float32))  # not an array


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "avg"])
def test_reduce_into_allocates_no_temporary(op):
    acc = np.ones(1 << 20, np.float64)  # 8 MiB
    incoming = np.ones(1 << 20, np.float64)
    tracemalloc.start()
    try:
        reduce_into(op, acc, incoming)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < acc.nbytes // 8


def test_incoming_first_fixes_operand_order_bitwise():
    # maximum(0.0, -0.0) and maximum(-0.0, 0.0) differ in sign bit: order must be choosable.
    acc, incoming = np.array([0.0]), np.array([-0.0])
    left_first = acc.copy()
    reduce_into("max", left_first, incoming)
    incoming_first = acc.copy()
    reduce_into("max", incoming_first, incoming, incoming_first=True)
    assert np.signbit(left_first) == np.signbit(np.maximum(acc, incoming))
    assert np.signbit(incoming_first) == np.signbit(np.maximum(incoming, acc))


# ----------------------------------------------------------------------------- integers


@pytest.mark.parametrize(
    ("dtype", "a", "b", "op", "expected"),
    [
        ("int8", 127, 1, "sum", -128),
        ("uint8", 255, 1, "sum", 0),
        ("int16", 300, 300, "prod", (90000 + 2**15) % 2**16 - 2**15),
        ("uint64", 2**64 - 1, 2, "sum", 1),
        ("int64", -(2**63), -1, "sum", 2**63 - 1),
        ("int32", -5, 3, "max", 3),
        ("uint32", 5, 3, "min", 3),
    ],
)
def test_integer_ops_wrap_silently(dtype, a, b, op, expected):
    acc = np.array([a], dtype=dtype)
    reduce_into(op, acc, np.array([b], dtype=dtype))
    assert acc[0] == expected


@pytest.mark.parametrize(
    ("values", "world_size", "expected"),
    [
        ([-3, 0], 2, -1),  # truncation toward zero: floor would give -2
        ([3, 0], 2, 1),
        ([-7, 0, 0], 3, -2),
        ([7, 0, 0], 3, 2),
        ([-6, 0, 0], 3, -2),
    ],
)
def test_integer_avg_truncates_toward_zero(values, world_size, expected):
    inputs = [np.array([v], np.int32) for v in values]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        reduce_into("avg", acc, x)
    finalize("avg", acc, world_size)
    assert acc[0] == expected
    assert reference_reduce("avg", inputs)[0] == expected


def test_integer_avg_divides_the_wrapped_sum():
    acc = np.array([100], np.int8)
    reduce_into("avg", acc, np.array([100], np.int8))  # 200 wraps to -56
    finalize("avg", acc, 2)
    assert acc[0] == -28


@pytest.mark.parametrize(
    ("dtype", "world_size"), [("int8", 128), ("int8", 200), ("uint8", 300), ("int16", 40000)]
)
def test_integer_avg_with_world_size_beyond_dtype_range(dtype, world_size):
    info = np.iinfo(dtype)
    values = [v for v in (info.min, info.min + 1, -1, 0, 1, info.max) if v >= info.min]
    acc = np.array(values, dtype=dtype)
    finalize("avg", acc, world_size)
    assert acc.tolist() == [trunc_div(v, world_size) for v in values]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(INT_DTYPES),
    world_size=st.integers(1, 1000),
    seed=st.integers(0, 2**32 - 1),
)
def test_integer_finalize_is_exact_truncation(dtype, world_size, seed):
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    acc = random_array(rng, dtype, 64)
    acc[:2] = [info.min, info.max]
    values = acc.tolist()
    finalize("avg", acc, world_size)
    assert acc.tolist() == [trunc_div(v, world_size) for v in values]


class _RecordingXp:
    """NumPy as an ``xp`` module that records every function the code under test takes
    from it, and fails on any argument or result that is not an integer or bool array or
    scalar (a float round trip, as CuPy's integer ``fmod`` does, would show here)."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def __getattr__(self, name: str):
        self.used.add(name)
        fn = getattr(np, name)

        def checked(*args, **kwargs):
            for a in (*args, *kwargs.values()):
                kind = getattr(getattr(a, "dtype", None), "kind", None)
                assert kind is None or kind in "iub", f"xp.{name} got a {a.dtype} operand"
                assert not isinstance(a, float), f"xp.{name} got a Python float"
            res = fn(*args, **kwargs)
            assert res.dtype.kind in "iub", f"xp.{name} made a {res.dtype} result"
            return res

        return checked


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_integer_avg_uses_integer_functions_only(dtype, monkeypatch):
    """The integer AVG path calls only :data:`ops.INTEGER_AVG_FUNCTIONS`, all on integer
    operands (what CuPy computes exactly); none of them is fmod, remainder or a true
    division. Extremes of the dtype come out exact, at world sizes small and large."""
    import ringcomm.ops as ops

    assert not ops.INTEGER_AVG_FUNCTIONS & {
        "fmod",
        "remainder",
        "mod",
        "divide",
        "true_divide",
        "trunc",
        "fix",
        "rint",
    }
    info = np.iinfo(dtype)
    values = [info.min, info.min + 1, info.min + 2, -3, -2, -1, 0, 1, 2, 3, info.max - 1, info.max]
    values = [v for v in values if info.min <= v <= info.max]
    for world_size in (2, 3, 7, 8, 127, 1000):
        rec = _RecordingXp()
        monkeypatch.setattr(ops, "get_xp", lambda a, rec=rec: rec)
        acc = np.array(values, dtype=dtype)
        finalize("avg", acc, world_size)
        assert acc.tolist() == [trunc_div(v, world_size) for v in values], world_size
        assert rec.used <= ops.INTEGER_AVG_FUNCTIONS, rec.used - ops.INTEGER_AVG_FUNCTIONS


def test_integer_avg_is_exact_beyond_two_to_the_53():
    """The issue-31 case: a float64 round trip rounds int64 values past 2**53."""
    acc = np.array([-2672802113933191955, 2**62 + 1, -(2**63), 2**63 - 1], np.int64)
    want = [trunc_div(int(v), 2) for v in acc.tolist()]
    finalize("avg", acc, 2)
    assert acc.tolist() == want
    assert want[0] == -1336401056966595977
    u = np.array([2**64 - 1, 2**63 + 3], np.uint64)
    finalize("avg", u, 3)
    assert u.tolist() == [(2**64 - 1) // 3, (2**63 + 3) // 3]


# ----------------------------------------------------------------------------- floats


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_float_avg_is_sum_then_exact_division(dtype):
    inputs = [np.array([1.5, -3.0, 0.25], dtype) for _ in range(3)]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        reduce_into("avg", acc, x)
    finalize("avg", acc, 3)
    assert acc.dtype == dtype
    np.testing.assert_array_equal(acc, inputs[0])


def test_float16_accumulates_in_float16_and_overflows_silently():
    acc = np.array([60000.0, 1.0], np.float16)
    reduce_into("sum", acc, np.array([60000.0, 2.0**-14], np.float16))
    assert acc.dtype == np.float16
    assert np.isinf(acc[0])
    assert acc[1] == np.float16(1.0)  # 1 + 2**-14 rounds back to 1 in float16


def test_float_inf_minus_inf_is_nan_without_warning():
    acc = np.array([np.inf], np.float32)
    reduce_into("sum", acc, np.array([-np.inf], np.float32))
    assert np.isnan(acc[0])


@pytest.mark.parametrize("op", ["max", "min"])
def test_float_max_min_propagate_nan(op):
    acc = np.array([1.0, np.nan], np.float64)
    reduce_into(op, acc, np.array([np.nan, 1.0], np.float64))
    assert np.isnan(acc).all()


def test_reference_reduce_folds_in_rank_order():
    # float32: (1e8 + 1) - 1e8 == 0 (the 1 is rounded away); (1e8 - 1e8) + 1 == 1.
    big, one, minus_big = (np.array([x], np.float32) for x in (1e8, 1.0, -1e8))
    assert reference_reduce("sum", [big, one, minus_big])[0] == 0.0
    assert reference_reduce("sum", [big, minus_big, one])[0] == 1.0


# ----------------------------------------------------------------------------- bool


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("sum", [True, True, True, False]),  # logical or
        ("max", [True, True, True, False]),  # logical or
        ("prod", [True, False, False, False]),  # logical and
        ("min", [True, False, False, False]),  # logical and
    ],
)
def test_bool_ops_are_logical(op, expected):
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    acc = a.copy()
    reduce_into(op, acc, b)
    assert acc.dtype == np.bool_
    assert acc.tolist() == expected
    assert reference_reduce(op, [a, b]).tolist() == expected


def test_bool_sum_of_many_stays_true():
    inputs = [np.array([True]) for _ in range(300)]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        reduce_into("sum", acc, x)
    assert acc[0]


def test_bool_avg_raises():
    acc = np.array([True])
    with pytest.raises(TypeError, match="bool"):
        reduce_into("avg", acc, np.array([False]))
    with pytest.raises(TypeError, match="bool"):
        finalize("avg", acc, 2)
    with pytest.raises(TypeError, match="bool"):
        reference_reduce("avg", [acc, acc])


# ----------------------------------------------------------------------------- finalize


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_finalize_is_a_no_op_except_for_avg(op):
    acc = np.array([6, -7], np.int32)
    finalize(op, acc, 4)
    assert acc.tolist() == [6, -7]


def test_finalize_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        finalize("avg", np.ones(2, np.float32), 0)


def test_reference_reduce_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        reference_reduce("sum", [])
    with pytest.raises(ValueError):
        reference_reduce("sum", [np.zeros(2, np.int8), np.zeros(3, np.int8)])
    with pytest.raises(ValueError):
        reference_reduce("sum", [np.zeros(2, np.int8), np.zeros(2, np.int16)])
