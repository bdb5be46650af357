"""Wire headers (ringcomm.transport.wire) and endpoint choice (ringcomm.transport.endpoints).

Pure: no sockets. A header must round-trip exactly; anything else a peer (or a stranger)
could put in a header frame must raise WireError, never another exception, since the
receiver drops and counts exactly the frames that raise WireError.
"""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.transport.endpoints import (
    TRANSPORT_MODES,
    EndpointInfo,
    choose_endpoint,
    host_identity,
    ipc_path,
)
from ringcomm.transport.wire import (
    KIND_NAMES,
    SUPPORTED_DTYPES,
    WIRE_VERSION,
    Header,
    HeaderTemplate,
    WireError,
    dtype_from_wire,
    dtype_to_wire,
    pack_header,
    unpack_header,
)

U64 = st.integers(0, (1 << 64) - 1)
FP = st.one_of(
    st.none(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.text(max_size=20),
    st.lists(st.integers(0, 1 << 32), max_size=5),
)


@st.composite
def headers(draw: st.DrawFn) -> Header:
    npieces = draw(st.integers(1, (1 << 64) - 1))
    return Header(
        kind=draw(st.sampled_from(sorted(KIND_NAMES))),
        src=draw(U64),
        group=draw(U64),
        tag=draw(U64),
        step=draw(U64),
        piece=draw(st.integers(0, npieces - 1)),
        npieces=npieces,
        dtype=draw(st.sampled_from([dt.str for dt in SUPPORTED_DTYPES])),
        nbytes=draw(U64),
        offset=draw(U64),
        shape=draw(st.none() | st.lists(st.integers(0, 1 << 40), max_size=6).map(tuple)),
        fp=draw(FP),
        auth=draw(st.none() | st.binary(max_size=32)),
    )


@given(headers())
def test_header_round_trip(h: Header) -> None:
    raw = pack_header(h)
    assert isinstance(raw, bytes)
    got, inline = unpack_header(raw)
    assert got == h and inline is None
    assert got.key == (h.src, h.group, h.kind, h.tag)
    assert unpack_header(memoryview(raw)) == (h, None)  # frames arrive as buffers too


@given(headers(), st.binary(max_size=5000))
def test_header_with_inline_payload_round_trip(h: Header, payload: bytes) -> None:
    assert unpack_header(pack_header(h, payload)) == (h, payload)


@given(headers(), U64, st.none() | st.binary(max_size=70000))
def test_header_template_packs_the_same_bytes(h: Header, tag: int, inline: bytes | None) -> None:
    """A template packs what pack_header packs, for any tag (the one field it leaves out)."""
    template = HeaderTemplate(h._replace(tag=0))
    assert template.pack(tag, inline) == pack_header(h._replace(tag=tag), inline)
    assert template.pack(tag) == pack_header(h._replace(tag=tag))


def test_header_defaults_round_trip() -> None:
    h = Header(1, 0, 0, 0)
    assert unpack_header(pack_header(h)) == (h, None)


def _fields(**override: object) -> list[object]:
    """A valid header as the raw msgpack list, with some positions replaced."""
    names = [
        "version",
        "kind",
        "src",
        "group",
        "tag",
        "step",
        "piece",
        "npieces",
        "dtype",
        "nbytes",
        "offset",
        "shape",
        "fp",
        "auth",
        "inline",
    ]
    base = dict(
        zip(names, [WIRE_VERSION, 1, 0, 0, 7, 0, 0, 1, "<f4", 40, 0, [10], None, None, None])
    )
    base.update(override)
    return [base[n] for n in names]


def test_fields_helper_is_valid() -> None:
    assert unpack_header(msgpack.packb(_fields(), use_bin_type=True))[0].tag == 7


INT_FIELDS = ("src", "group", "tag", "step", "nbytes", "offset", "piece", "npieces")
BAD_INTS = (-1, -(1 << 63), "3", 1.0, True, None, [1], {"a": 1}, b"\x01")


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", BAD_INTS, ids=repr)
def test_bad_int_field(field: str, value: object) -> None:
    with pytest.raises(WireError):
        unpack_header(msgpack.packb(_fields(**{field: value}), use_bin_type=True))


@pytest.mark.parametrize(
    "override",
    [
        {"version": 2},
        {"version": 0},
        {"version": "1"},
        {"version": True},
        {"version": [1]},
        {"kind": 0},
        {"kind": 99},
        {"kind": "p2p"},
        {"kind": True},
        {"kind": []},  # unhashable: must still be a WireError, not a TypeError
        {"kind": {}},
        {"kind": 1.0},
        {"dtype": 4},
        {"dtype": None},
        {"dtype": b"<f4"},
        {"shape": "10"},
        {"shape": 10},
        {"shape": [-1]},
        {"shape": [1.5]},
        {"shape": [True]},
        {"shape": {"a": 1}},
        {"auth": "token"},
        {"auth": 5},
        {"piece": 1, "npieces": 1},  # piece >= npieces
        {"piece": 5, "npieces": 3},
        {"npieces": 0},
    ],
    ids=repr,
)
def test_bad_field_values(override: dict[str, object]) -> None:
    with pytest.raises(WireError):
        unpack_header(msgpack.packb(_fields(**override), use_bin_type=True))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"junk junk junk",
        b"\x00" * 64,
        msgpack.packb(_fields())[:-1],  # truncated
        msgpack.packb(_fields()) + b"\x00",  # trailing bytes
        msgpack.packb(_fields()[:-1]),  # 13 fields
        msgpack.packb([*_fields(), None]),  # 15 fields
        msgpack.packb([]),
        msgpack.packb(None),
        msgpack.packb(7),
        msgpack.packb("header"),
        msgpack.packb({"kind": 1}),
        msgpack.packb({1: 2}),  # non-str map key
        msgpack.packb(_fields())[:3],  # cut inside the list
    ],
    ids=lambda r: repr(r[:12]),
)
def test_junk_is_wire_error(raw: bytes) -> None:
    with pytest.raises(WireError):
        unpack_header(raw)


@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_else(raw: bytes) -> None:
    try:
        unpack_header(raw)
    except WireError:
        pass


ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2),
)


@given(st.dictionaries(st.integers(0, 14), ANY_VALUE, min_size=1, max_size=4))
def test_corrupted_fields_never_raise_anything_else(changes: dict[int, object]) -> None:
    """A valid header with a few positions replaced by arbitrary msgpack values."""
    fields = _fields()
    for i, v in changes.items():
        fields[i] = v
    try:
        h, _ = unpack_header(msgpack.packb(fields, use_bin_type=True))
    except WireError:
        return
    assert 0 <= h.piece < h.npieces and type(h.kind) is int and h.kind in KIND_NAMES


def test_wire_error_is_a_value_error() -> None:
    assert issubclass(WireError, ValueError)


@pytest.mark.parametrize("dt", SUPPORTED_DTYPES, ids=str)
def test_dtype_round_trip(dt: np.dtype) -> None:
    assert dtype_from_wire(dtype_to_wire(dt)) == dt


@pytest.mark.parametrize("text", ["<c8", "|O", ">f4", "float32", "", "<U3"])
def test_unsupported_wire_dtype(text: str) -> None:
    with pytest.raises(WireError):
        dtype_from_wire(text)


# --- endpoints -------------------------------------------------------------------------


def _info(rank: int, host: str, *, ipc: bool = True, tcp: bool = True) -> EndpointInfo:
    return EndpointInfo(
        rank=rank,
        host_id=host,
        ipc=f"ipc:///tmp/rc-r{rank}.sock" if ipc else None,
        tcp=f"tcp://10.0.0.{rank + 1}:5555" if tcp else None,
        pid=1000 + rank,
        version="0",
    )


def test_same_host_uses_ipc() -> None:
    assert choose_endpoint(_info(0, "a"), _info(1, "a")) == "ipc:///tmp/rc-r1.sock"
    assert choose_endpoint(_info(0, "a"), _info(1, "a"), "auto").startswith("ipc://")


def test_other_host_uses_tcp() -> None:
    assert choose_endpoint(_info(0, "a"), _info(1, "b")) == "tcp://10.0.0.2:5555"


def test_forced_tcp_on_same_host() -> None:
    assert choose_endpoint(_info(0, "a"), _info(1, "a"), "tcp") == "tcp://10.0.0.2:5555"


def test_forced_ipc() -> None:
    assert choose_endpoint(_info(0, "a"), _info(1, "a"), "ipc") == "ipc:///tmp/rc-r1.sock"
    with pytest.raises(ValueError, match="peer 1"):  # ipc cannot cross hosts
        choose_endpoint(_info(0, "a"), _info(1, "b"), "ipc")
    with pytest.raises(ValueError, match="peer 1"):
        choose_endpoint(_info(0, "a"), _info(1, "a", ipc=False), "ipc")


def test_missing_tcp_endpoint() -> None:
    with pytest.raises(ValueError, match="peer 1"):
        choose_endpoint(_info(0, "a"), _info(1, "b", tcp=False))


def test_unknown_mode() -> None:
    assert TRANSPORT_MODES == ("auto", "ipc", "tcp")
    with pytest.raises(ValueError):
        choose_endpoint(_info(0, "a"), _info(1, "a"), "udp")


def test_endpoint_info_round_trip() -> None:
    info = _info(3, "h:x", ipc=False)
    assert EndpointInfo.from_dict(info.to_dict()) == info


def test_local_facts() -> None:
    assert host_identity() == host_identity()
    paths = {ipc_path(5) for _ in range(20)}
    assert len(paths) == 20  # fresh each time
    for p in paths:
        assert len(p) <= 100 and p.endswith("-r5.sock") and not os.path.exists(p)
