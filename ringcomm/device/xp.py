"""Array-module dispatch: the only module that imports cupy (lazily).

``get_xp(array)`` returns ``numpy`` for NumPy arrays and ``cupy`` for CuPy arrays, so the
same code runs on both (and ``ringcomm.device.standin.STANDIN`` for the host stand-in of a CuPy
array, used to test the staged path without a GPU). ringcomm imports and works without CuPy
installed. ``ringcomm.device.staging`` reaches CuPy only through :func:`cupy_or_none`.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

import numpy as np

from ringcomm.device.standin import STANDIN, StandinArray

__all__ = ["cupy_or_none", "get_xp", "is_cupy_array", "is_device_array", "select_device"]


def cupy_or_none() -> ModuleType | None:
    """The cupy module if it is already imported or importable, else None."""
    mod = sys.modules.get("cupy")
    if mod is not None:
        return mod
    try:
        import cupy
    except Exception:  # noqa: BLE001 (ImportError, or a CUDA runtime failure at import)
        return None
    module: ModuleType = cupy  # cupy has no stubs: name its type, do not return Any
    return module


def select_device(local_rank: int) -> int | None:
    """Make GPU ``local_rank % device_count`` this thread's current CuPy device, unless
    the user chose one already (the current device is not 0); return the current device,
    or None without CuPy or a GPU. Called when a rank joins a group (ringcomm.group), so
    the ranks of a host spread over its GPUs, several per GPU when there are more ranks."""
    if importlib.util.find_spec("cupy") is None:
        return None
    cp = cupy_or_none()
    if cp is None:
        return None
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
        if count < 1:
            return None
        current = int(cp.cuda.runtime.getDevice())
        if current != 0 or count == 1:
            return current
        want = local_rank % count
        cp.cuda.Device(want).use()
        return want
    except Exception:  # noqa: BLE001 (no driver, no device: CPU arrays still work)
        return None


def is_cupy_array(x: Any) -> bool:
    # Only look at cupy if the caller could have made a cupy array (it is imported).
    mod = sys.modules.get("cupy")
    return mod is not None and isinstance(x, mod.ndarray)


def get_xp(x: Any) -> ModuleType:
    """Array module of ``x``: numpy or cupy."""
    if isinstance(x, np.ndarray):
        return np
    if is_cupy_array(x):
        return sys.modules["cupy"]
    if isinstance(x, StandinArray):
        return STANDIN  # type: ignore[return-value]
    raise TypeError(f"expected a numpy.ndarray or cupy.ndarray, got {type(x).__name__}")


def is_device_array(x: Any) -> bool:
    """Whether ``x`` lives in device memory: a CuPy array, or the host stand-in for one
    (``ringcomm.device.standin``). Device arrays take the staged path (``ringcomm.device.staging``)."""
    return isinstance(x, StandinArray) or is_cupy_array(x)
