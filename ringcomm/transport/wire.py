"""Wire format: pure pack/unpack of message headers (no sockets).

A message is a msgpack header frame, an array with fixed positions ``[version, kind, src,
group, tag, step, piece, npieces, dtype, nbytes, offset, shape, fp, auth, inline]``, then
one raw payload frame; a payload below ``INLINE_MAX_BYTES`` travels inside the header
(``inline``) and the message is that single frame.

Invariant: messages with the same (src, group, kind, tag) are matched in the order they
were sent. Field by field: docs/architecture.md, section "transport/wire.py".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack
import numpy as np

from ringcomm.transport.base import INLINE_MAX_BYTES, ZERO_COPY_MIN_BYTES

__all__ = [
    "INLINE_MAX_BYTES",
    "KIND_COLL",
    "KIND_CTRL",
    "KIND_NAMES",
    "KIND_P2P",
    "SUPPORTED_DTYPES",
    "WIRE_VERSION",
    "ZERO_COPY_MIN_BYTES",
    "Header",
    "HeaderTemplate",
    "WireError",
    "dtype_from_wire",
    "dtype_to_wire",
    "inline_frame",
    "pack_header",
    "unpack_header",
]

WIRE_VERSION = 1

KIND_P2P = 1
KIND_COLL = 2
KIND_CTRL = 3
KIND_NAMES = {KIND_P2P: "p2p", KIND_COLL: "collective", KIND_CTRL: "control"}

#: The dtypes the Python API promises (docs/contracts.md), in native byte order.
SUPPORTED_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(t)
    for t in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
)
_WIRE_DTYPES = {dt.str: dt for dt in SUPPORTED_DTYPES}

_NFIELDS = 15

# The path thresholds live with the transport boundary (re-exported here, where the
# framing is described).
_MAX_U64 = (1 << 64) - 1


class WireError(ValueError):
    """A frame that is not a valid ringcomm header (dropped and counted by the receiver)."""


class Header(NamedTuple):
    kind: int
    src: int
    group: int
    tag: int
    step: int = 0
    piece: int = 0
    npieces: int = 1
    dtype: str = "|u1"
    nbytes: int = 0
    offset: int = 0
    shape: tuple[int, ...] | None = None
    fp: Any = None
    auth: bytes | None = None

    @property
    def key(self) -> tuple[int, int, int, int]:
        """Matching key: messages with equal keys are delivered in the order sent."""
        return (self.src, self.group, self.kind, self.tag)


def dtype_to_wire(dtype: np.dtype[Any]) -> str:
    return np.dtype(dtype).str


def dtype_from_wire(text: str) -> np.dtype[Any]:
    try:
        return _WIRE_DTYPES[text]
    except KeyError:
        raise WireError(f"unsupported dtype on the wire: {text!r}") from None


def pack_header(h: Header, inline: bytes | None = None) -> bytes:
    """Encode a header; ``inline`` carries a small payload inside it (one-frame message)."""
    return _packb(
        [
            WIRE_VERSION,
            h.kind,
            h.src,
            h.group,
            h.tag,
            h.step,
            h.piece,
            h.npieces,
            h.dtype,
            h.nbytes,
            h.offset,
            None if h.shape is None else list(h.shape),
            h.fp,
            h.auth,
            inline,
        ]
    )


# One packer for the module (``msgpack.packb`` builds a Packer per call: half its cost).
# Safe to share between threads: packing None, ints, str, bytes and lists of them runs
# entirely in C under the GIL (no Python callback), and autoreset hands back a new bytes.
_packb: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True, autoreset=True).pack


_NIL_BYTE = _packb(None)[0]


def inline_frame(header: bytes, payload: Any) -> bytes:
    """The one-frame message of ``header`` (packed without an inline payload: its last
    element is nil) carrying ``payload`` inline: the same bytes as packing the header
    with ``inline=bytes(payload)``."""
    if header[-1] != _NIL_BYTE:
        raise WireError("inline_frame: the header already carries a payload")
    return header[:-1] + _packb(payload if type(payload) is bytes else bytes(payload))


class HeaderTemplate:
    """The header ``h`` packed ahead of time but for its ``tag`` and inline payload.

    ``pack(tag, inline)`` gives the same bytes as ``pack_header(h._replace(tag=tag),
    inline)`` (a msgpack array is its elements' encodings in a row), for a fraction of the
    cost: an algorithm that sends the same messages call after call (same fingerprint,
    step and piece layout; only the collective's sequence number differs) builds its
    templates once per call shape.
    """

    __slots__ = ("_head", "_tail")

    def __init__(self, h: Header) -> None:
        shape = None if h.shape is None else list(h.shape)
        self._head = b"\x9f" + b"".join(map(_packb, (WIRE_VERSION, h.kind, h.src, h.group)))
        self._tail = b"".join(
            map(
                _packb,
                (h.step, h.piece, h.npieces, h.dtype, h.nbytes, h.offset, shape, h.fp, h.auth),
            )
        )

    def pack(self, tag: int, inline: bytes | None = None) -> bytes:
        """The header frame with ``tag`` (and ``inline`` as its payload, if given)."""
        return self._head + _packb(tag) + self._tail + _packb(inline)


def _bad(name: str, value: Any) -> WireError:
    return WireError(f"bad header field {name}: {value!r}")


_tuple_new = tuple.__new__  # builds a Header from its fields without the keyword handling


def unpack_header(data: bytes | memoryview) -> tuple[Header, bytes | None]:
    """Parse and validate a header frame: ``(header, inline payload or None)``.

    Raises :class:`WireError` on anything malformed (the receiver drops and counts it).
    """
    try:
        fields = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types on junk
        raise WireError(f"header is not msgpack: {exc}") from exc
    if type(fields) is not list or len(fields) != _NFIELDS:
        raise WireError("header is not a list of the expected length")
    (
        ver,
        kind,
        src,
        group,
        tag,
        step,
        piece,
        npieces,
        dtype,
        nbytes,
        offset,
        shape,
        fp,
        auth,
        inline,
    ) = fields
    # The common header in one test (every message of a collective, and p2p pieces after
    # the first): integers that are ints (msgpack never gives one above 2**64 - 1, the
    # upper bound; bools are not ints here), no shape, no auth. Anything else takes the
    # field-by-field checks, which also name what is wrong.
    if (
        type(ver) is int
        and ver == WIRE_VERSION
        and type(kind) is int
        and type(src) is int
        and type(group) is int
        and type(tag) is int
        and type(step) is int
        and type(piece) is int
        and type(npieces) is int
        and type(nbytes) is int
        and type(offset) is int
        and kind in KIND_NAMES
        and src >= 0
        and group >= 0
        and tag >= 0
        and step >= 0
        and nbytes >= 0
        and offset >= 0
        and 0 <= piece < npieces
        and type(dtype) is str
        and shape is None
        and auth is None
        and (inline is None or type(inline) is bytes)
    ):
        header = _tuple_new(
            Header,
            (kind, src, group, tag, step, piece, npieces, dtype, nbytes, offset, None, fp, None),
        )
        return header, inline
    if type(ver) is not int or ver != WIRE_VERSION:
        raise WireError(f"wire version {ver!r} != {WIRE_VERSION}")
    if type(kind) is not int or kind not in KIND_NAMES:
        raise WireError(f"unknown message kind {kind!r}")
    # One pass over the integer fields (msgpack gives Python ints; bools are rejected).
    for name, v in (
        ("src", src),
        ("group", group),
        ("tag", tag),
        ("step", step),
        ("nbytes", nbytes),
        ("offset", offset),
    ):
        if type(v) is not int or not 0 <= v <= _MAX_U64:
            raise _bad(name, v)
    if type(npieces) is not int or not 1 <= npieces <= _MAX_U64:
        raise _bad("npieces", npieces)
    if type(piece) is not int or not 0 <= piece < npieces:
        raise _bad("piece", piece)
    if type(dtype) is not str:
        raise _bad("dtype", dtype)
    if shape is not None:
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise _bad("shape", shape)
        shape = tuple(shape)
    if auth is not None and type(auth) is not bytes:
        raise _bad("auth", auth)
    if inline is not None and type(inline) is not bytes:
        raise _bad("inline", inline)
    header = Header(
        kind, src, group, tag, step, piece, npieces, dtype, nbytes, offset, shape, fp, auth
    )
    return header, inline
