"""Array-module dispatch: the only module that imports cupy (lazily).

``get_xp(array)`` returns ``numpy`` for NumPy arrays and ``cupy`` for CuPy arrays, so the
same code runs on both. ringcomm imports and works without CuPy installed.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["cupy_or_none", "get_xp", "is_cupy_array"]


def cupy_or_none() -> ModuleType | None:
    """The cupy module if it is already imported or importable, else None."""
    mod = sys.modules.get("cupy")
    if mod is not None:
        return mod
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA runtime failure at import
        return None
    return cupy


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
    raise TypeError(f"expected a numpy.ndarray or cupy.ndarray, got {type(x).__name__}")
