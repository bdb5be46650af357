"""A NumPy array posing as device memory: the host stand-in for ``cupy.ndarray``.

:class:`StandinArray` wraps a NumPy array (:attr:`StandinArray.host`) behind the part of
CuPy's ndarray surface ringcomm uses and, through :mod:`~ringcomm.device.standin_math`, the
arithmetic the training engine computes with (:data:`STANDIN` is its ``xp``). ringcomm
treats it exactly like a CuPy array: every collective and p2p call takes the staged path
(``ringcomm.device.staging``), NumPy standing in for CUDA copies and kernels, so a machine
without a GPU exercises the staging bookkeeping (``scripts/gpu_check.sh`` checks CUDA).

Invariants: it never becomes a NumPy array implicitly; its stream runs queued work lazily,
so reading before a wait sees stale bytes, as it would race on a GPU; ``get()`` first runs
what is queued (:func:`set_read_barrier`), as CuPy's does. Users make one with
:func:`standin_array` (a copy). Details: docs/architecture.md, section "device/standin.py".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.device.standin_math import ArrayMath, ModuleMath, host_operand

__all__ = ["STANDIN", "StandinArray", "StandinModule", "set_read_barrier", "standin_array"]

#: What ``get()`` runs before it reads (the stand-in stream's synchronize; empty: nothing).
_READ_BARRIER: list[Callable[[], None]] = []


def set_read_barrier(fn: Callable[[], None]) -> None:
    """``fn()`` runs at every ``StandinArray.get()`` before the read (the stand-in's stream,
    ``ringcomm.device.staging``, sets its synchronize here: work queued on the device
    finishes before the host reads it, as CuPy's ``get()`` waits for its stream)."""
    _READ_BARRIER[:] = [fn]


class StandinArray(ArrayMath):
    """Stand-in device array over the NumPy array :attr:`host` (its "device memory").

    Only the stand-in's own methods and the stand-in device backends (``staging``'s and
    ``ipc``'s, which play CUDA's copies and kernels) read :attr:`host` directly: it skips
    the stream, so other code reads the array with ``get()``.
    """

    __slots__ = ("__weakref__", "host")

    def __init__(self, host: np.ndarray) -> None:
        if not isinstance(host, np.ndarray):
            raise TypeError(f"StandinArray wraps a numpy.ndarray, got {type(host).__name__}")
        self.host = host

    # -- the ndarray surface ringcomm uses ------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.host.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.host.dtype

    @property
    def size(self) -> int:
        return self.host.size

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    @property
    def itemsize(self) -> int:
        return self.host.itemsize

    @property
    def ndim(self) -> int:
        return self.host.ndim

    @property
    def flags(self) -> Any:
        return self.host.flags

    def __len__(self) -> int:
        return len(self.host)

    def reshape(self, *shape: Any) -> StandinArray:
        return StandinArray(self.host.reshape(*shape))

    def view(self, dtype: Any) -> StandinArray:
        return StandinArray(self.host.view(dtype))

    def __getitem__(self, index: Any) -> StandinArray:
        """Basic indexing gives a view, advanced indexing (stand-in index arrays, lists) a
        copy, one element a 0-d array: CuPy's semantics. NumPy index arrays are refused."""
        got = self.host[host_operand(index, "stand-in __getitem__")]
        return StandinArray(got if isinstance(got, np.ndarray) else np.asarray(got))

    def copy(self) -> StandinArray:
        return StandinArray(self.host.copy())

    def get(self) -> np.ndarray:
        """A NumPy copy (like ``cupy.ndarray.get``: queued device work finishes first)."""
        for fn in _READ_BARRIER:
            fn()
        return self.host.copy()

    def set(self, arr: Any) -> None:
        """Overwrite with ``arr`` (like ``cupy.ndarray.set``)."""
        self.host[...] = arr

    def __repr__(self) -> str:
        return f"StandinArray({self.host!r})"


class StandinModule(ModuleMath):
    """What ``get_xp`` returns for stand-in arrays: allocation and overlap helpers, and
    (:class:`~ringcomm.device.standin_math.ModuleMath`) NumPy's functions over stand-in
    arrays."""

    __name__ = "ringcomm.device.standin"
    _array_type = StandinArray
    ndarray = StandinArray

    @staticmethod
    def empty(shape: Any, dtype: Any = float) -> StandinArray:
        return StandinArray(np.empty(shape, dtype))

    @staticmethod
    def zeros(shape: Any, dtype: Any = float) -> StandinArray:
        return StandinArray(np.zeros(shape, dtype))

    @staticmethod
    def empty_like(a: StandinArray, dtype: Any = None) -> StandinArray:
        return StandinArray(np.empty_like(a.host, dtype))

    @staticmethod
    def zeros_like(a: StandinArray, dtype: Any = None) -> StandinArray:
        return StandinArray(np.zeros_like(a.host, dtype))

    @staticmethod
    def asarray(a: Any, dtype: Any = None) -> StandinArray:
        """``a`` on the device: a stand-in array as it is (or cast to ``dtype``), anything
        else (a NumPy array, a list, a scalar) copied over, like ``cupy.asarray``."""
        if isinstance(a, StandinArray):
            return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
        return StandinArray(np.array(a, dtype=dtype, copy=True))

    @staticmethod
    def may_share_memory(a: StandinArray, b: StandinArray) -> bool:
        return bool(np.may_share_memory(a.host, b.host))


STANDIN = StandinModule()


def standin_array(a: Any) -> StandinArray:
    """A stand-in device array holding a copy of ``a`` (like ``cupy.asarray``)."""
    return StandinArray(np.ascontiguousarray(np.array(a, copy=True)))
