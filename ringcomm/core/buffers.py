"""Argument checks and byte views for user arrays (checked at the call, before any send)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.device.xp import is_device_array
from ringcomm.transport.wire import SUPPORTED_DTYPES

__all__ = ["SUPPORTED_DTYPE_NAMES", "byte_view", "check_array", "check_peer", "check_tag"]

SUPPORTED_DTYPE_NAMES = tuple(dt.name for dt in SUPPORTED_DTYPES)
_SUPPORTED = set(SUPPORTED_DTYPES)


def check_array(x: Any, what: str, *, writeable: bool = False, device: bool = False) -> np.ndarray:
    """Return ``x`` if it is a contiguous array of a supported dtype, else raise.

    TypeError for a non-array or unsupported dtype, ValueError for non-contiguous,
    non-native byte order or (with ``writeable``) a read-only buffer. ``device``: device
    arrays (``cupy.ndarray``, or the host stand-in ``ringcomm.device.standin.StandinArray``) are
    accepted too (callers that stage them, ``ringcomm.device.staging``); else TypeError.
    """
    if type(x) is np.ndarray and x.dtype in _SUPPORTED:  # the common case, in one look
        flags = x.flags
        if flags.c_contiguous and (flags.writeable or not writeable):
            return x
    if is_device_array(x):
        if not device:
            raise TypeError(f"{what}: device arrays are not supported here")
        if x.dtype not in _SUPPORTED:
            raise TypeError(
                f"{what}: unsupported dtype {x.dtype}; supported: "
                f"{', '.join(SUPPORTED_DTYPE_NAMES)}"
            )
        if not x.flags.c_contiguous:
            raise ValueError(f"{what}: array must be C-contiguous (use cupy.ascontiguousarray)")
        return x  # type: ignore[no-any-return]
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what}: expected a numpy.ndarray, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED:
        if x.dtype.newbyteorder("=") in _SUPPORTED and not x.dtype.isnative:
            raise ValueError(f"{what}: non-native byte order {x.dtype.str} is not supported")
        raise TypeError(
            f"{what}: unsupported dtype {x.dtype}; supported: {', '.join(SUPPORTED_DTYPE_NAMES)}"
        )
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous (use numpy.ascontiguousarray)")
    if writeable and not x.flags.writeable:
        raise ValueError(f"{what}: array is read-only but is written in place")
    return x


def byte_view(x: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a contiguous array (shares memory, any number of dims)."""
    return x.reshape(-1).view(np.uint8)


def check_tag(tag: Any, what: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"{what}: tag must be an int, got {type(tag).__name__}")
    value = int(tag)
    if not 0 <= value < (1 << 63):
        raise ValueError(f"{what}: tag must be in [0, 2**63), got {value}")
    return value


def check_peer(peer: Any, world_size: int, what: str, name: str = "peer") -> int:
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
        raise TypeError(f"{what}: {name} must be an int, got {type(peer).__name__}")
    value = int(peer)
    if not 0 <= value < world_size:
        raise ValueError(f"{what}: {name} {value} is out of range for world size {world_size}")
    return value
