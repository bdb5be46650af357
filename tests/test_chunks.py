"""Chunk spans (ringcomm.schedule.chunks): pure, no sockets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.schedule.chunks import chunk_spans, num_chunks

ITEMSIZES = (1, 2, 4, 8)


def check_spans(spans: list[tuple[int, int]], nbytes: int, chunk_bytes: int, itemsize: int) -> None:
    """The spans cover [0, nbytes) in order, item-aligned, each <= chunk_bytes (>= 1 item)."""
    if nbytes == 0:
        assert spans == [(0, 0)]
        return
    offset = 0
    for off, length in spans:
        assert off == offset, f"gap or overlap at {off} (expected {offset})"
        assert length > 0
        assert off % itemsize == 0 and length % itemsize == 0, "piece cuts an element"
        assert length <= max(chunk_bytes, itemsize)
        assert length >= itemsize
        offset += length
    assert offset == nbytes
    # Every piece but the last is full: as few pieces as the rules allow.
    piece = max(itemsize, chunk_bytes // itemsize * itemsize)
    assert all(length == piece for _, length in spans[:-1])
    assert len(spans) == -(-nbytes // piece)


@given(
    nitems=st.integers(0, 5000),
    itemsize=st.sampled_from(ITEMSIZES),
    chunk_bytes=st.integers(1, 20_000),
)
def test_spans_cover_exactly(nitems: int, itemsize: int, chunk_bytes: int) -> None:
    nbytes = nitems * itemsize
    spans = chunk_spans(nbytes, chunk_bytes, itemsize)
    check_spans(spans, nbytes, chunk_bytes, itemsize)
    assert num_chunks(nbytes, chunk_bytes, itemsize) == len(spans)


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_empty_buffer_is_one_empty_piece(itemsize: int) -> None:
    assert chunk_spans(0, 1024, itemsize) == [(0, 0)]
    assert num_chunks(0, 1024, itemsize) == 1


def test_examples() -> None:
    assert chunk_spans(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_spans(12, 4, 4) == [(0, 4), (4, 4), (8, 4)]
    # chunk_bytes not a multiple of the item size: round down to whole items
    assert chunk_spans(24, 10, 4) == [(0, 8), (8, 8), (16, 8)]
    # chunk smaller than one item: one item per piece
    assert chunk_spans(24, 3, 8) == [(0, 8), (8, 8), (16, 8)]
    # one piece when the buffer fits
    assert chunk_spans(1001 * 8, 1 << 20, 8) == [(0, 8008)]
    # the 64 MiB transfer of test_p2p: 256 pieces of 256 KiB
    spans = chunk_spans(64 << 20, 256 << 10, 8)
    assert len(spans) == 256 and {length for _, length in spans} == {256 << 10}


@pytest.mark.parametrize(
    ("nbytes", "chunk_bytes", "itemsize"),
    [
        (8, 0, 1),  # chunk_bytes must be > 0
        (8, -4, 1),
        (8, 4, 0),  # itemsize must be > 0
        (10, 4, 4),  # nbytes not a whole number of items
        (-8, 4, 4),  # negative size
        (-1, 4, 1),
    ],
)
def test_bad_arguments(nbytes: int, chunk_bytes: int, itemsize: int) -> None:
    with pytest.raises(ValueError):
        chunk_spans(nbytes, chunk_bytes, itemsize)


def test_num_chunks_bad_arguments() -> None:
    with pytest.raises(ValueError):
        num_chunks(-1, 4)
    with pytest.raises(ValueError):
        num_chunks(8, 0)
