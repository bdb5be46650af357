"""A NumPy array posing as device memory: the host stand-in for ``cupy.ndarray``.

:class:`StandinArray` wraps a NumPy array and exposes the small part of CuPy's
ndarray surface ringcomm uses (shape, dtype, sizes, views by ``reshape``/``view``/basic
slicing, ``get()``/``set()``) and, through :mod:`~ringcomm.device.standin_math`, the
arithmetic the training engine computes with (:data:`STANDIN` is its ``xp``; it never turns
into a NumPy array implicitly). ringcomm treats it exactly like a CuPy array: every
collective and p2p call on it takes the *staged* path (``ringcomm.device.staging``: pinned staging
buffers, a stream, events), with NumPy copies and ufuncs standing in for CUDA copies and
kernels. So a machine without a GPU exercises the staging bookkeeping; what it cannot
exercise is CUDA itself (``scripts/gpu_check.sh`` does, on a GPU machine).

Honesty: the stand-in's stream (``staging.HostStandinBackend``) runs queued copies and
reductions *lazily*, only when an event after them is waited on or polled, so code that
sends a staging buffer before waiting for its copy, or reads device memory before the
stream finished, sees stale bytes and fails its test, as it would race on a GPU.

Users and tests make one with :func:`standin_array` (a copy) and read it back with
``a.get()``, as with CuPy's ``cupy.asarray``/``ndarray.get``; like CuPy's (a copy on the
current stream, then a wait for it), ``get()`` first lets the stand-in's stream run what is
queued on it (:func:`set_read_barrier`).
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
