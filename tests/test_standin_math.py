"""The host stand-in device array computes as NumPy does, and is as strict as CuPy about
host memory: nothing turns it into a NumPy array implicitly, and no NumPy array mixes into
its arithmetic, indexing or module functions (``ringcomm.device.standin_math``)."""

from __future__ import annotations

import numpy as np
import pytest

from ringcomm.device.standin import STANDIN, StandinArray, standin_array
from ringcomm.device.xp import get_xp

HOST_MIX = r"numpy\.ndarray mixed with stand-in"


def test_arithmetic_and_functions_match_numpy() -> None:
    rng = np.random.default_rng(0)
    a_h, b_h = rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    a, b = standin_array(a_h), standin_array(b_h)
    xp = get_xp(a)
    assert xp is STANDIN
    cases = [
        (a @ b, a_h @ b_h),
        (2.0 * a + 1 - a / 3, 2.0 * a_h + 1 - a_h / 3),
        (a**3, a_h**3),
        (-a.T, -a_h.T),
        (xp.exp(a) * xp.tanh(a), np.exp(a_h) * np.tanh(a_h)),
        (xp.where(a > 0, a, -xp.inf), np.where(a_h > 0, a_h, -np.inf)),
        (xp.stack([a, a]).transpose(1, 0, 2), np.stack([a_h, a_h]).transpose(1, 0, 2)),
        (
            xp.concatenate([a.reshape(-1), b.reshape(-1)]),
            np.concatenate([a_h.ravel(), b_h.ravel()]),
        ),
        (a.max(axis=1, keepdims=True), a_h.max(axis=1, keepdims=True)),
        (xp.tril(xp.ones((3, 3), dtype=bool)), np.tril(np.ones((3, 3), dtype=bool))),
        (a.swapaxes(0, 1).astype(np.float32), a_h.swapaxes(0, 1).astype(np.float32)),
    ]
    for got, want in cases:
        assert isinstance(got, StandinArray)
        assert got.dtype == want.dtype and np.array_equal(got.get(), want)
    # reductions are 0-d device arrays (as CuPy), read back explicitly
    total = a.sum()
    assert isinstance(total, StandinArray) and total.shape == ()
    assert float(total) == pytest.approx(a_h.sum()) and total.item() == a_h.sum()


def test_indexing_views_copies_and_in_place() -> None:
    base = standin_array(np.zeros((4, 3)))
    view = base[1:3]
    view += 1.0  # in place through a view
    view[0, 1] = 5.0
    want = np.zeros((4, 3))
    want[1:3] += 1.0
    want[1, 1] = 5.0
    assert np.array_equal(base.get(), want)
    rows, cols = STANDIN.asarray([0, 3]), STANDIN.asarray([2, 0])
    picked = base[rows, cols]  # advanced: a copy
    assert np.array_equal(picked.get(), [0.0, 0.0])
    base[rows, cols] -= STANDIN.asarray([1.0, 2.0])  # scatter, unique indices
    want[[0, 3], [2, 0]] -= [1.0, 2.0]
    assert np.array_equal(base.get(), want)
    assert np.array_equal(base[STANDIN.asarray([True, False, True, False])].get(), want[[0, 2]])


def test_never_a_numpy_array_by_accident() -> None:
    a = standin_array(np.arange(6.0))
    host = np.ones(6)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(a)
    with pytest.raises(TypeError):
        np.concatenate([a, a])  # NumPy functions refuse it (no __array__)
    with pytest.raises(TypeError):
        np.exp(a)  # NumPy ufuncs refuse it
    for mixed in (lambda: a + host, lambda: host + a, lambda: a @ host, lambda: host * a):
        with pytest.raises(TypeError, match=HOST_MIX):
            mixed()
    with pytest.raises(TypeError, match=HOST_MIX):
        a[...] = host  # a host -> device copy must be explicit (xp.asarray)
    with pytest.raises(TypeError, match=HOST_MIX):
        STANDIN.where(a > 2, host, a)
    with pytest.raises(TypeError, match=HOST_MIX):
        a[np.array([0, 1])]
    with pytest.raises(AttributeError, match="no 'einsum'"):
        STANDIN.einsum  # noqa: B018 (the attribute access is the test)
    # the explicit ways across: xp.asarray (host to device), .get()/.set()
    a[...] = STANDIN.asarray(host)
    assert np.array_equal(a.get(), host)
    a.set(np.zeros(6))
    assert not a.get().any()
    assert STANDIN.asarray(a) is a and STANDIN.asarray(a, dtype=np.float32).dtype == np.float32


def test_python_scalars_and_numpy_scalars_mix_as_in_cupy() -> None:
    a = standin_array(np.arange(3, dtype=np.float32))
    got = a * np.float32(2) + 1
    assert isinstance(got, StandinArray) and got.dtype == np.float32
    assert np.array_equal(got.get(), [1.0, 3.0, 5.0])
    assert bool(a[2] > 1) and int(a[1]) == 1
