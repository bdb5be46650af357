"""The parameter server's key slicing: pure, no sockets."""

from __future__ import annotations

import pytest

from ringcomm.ps.slicer import HashSlicer, Piece, RangeSlicer, split_even


def _check_cover(pieces: list[Piece], nelem: int) -> None:
    pos = 0
    for p in pieces:
        assert p.start == pos and p.stop > p.start
        pos = p.stop
    assert pos == nelem
    assert len({p.server for p in pieces}) == len(pieces)


@pytest.mark.parametrize("nelem", [1, 2, 3, 7, 100, 1001])
@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_split_even_covers_and_balances(nelem: int, servers: int) -> None:
    pieces = split_even(nelem, servers)
    _check_cover(pieces, nelem)
    sizes = [p.nelem for p in pieces]
    assert max(sizes) - min(sizes) <= 1
    assert len(pieces) == min(nelem, servers)


def test_split_even_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        split_even(10, 0)
    with pytest.raises(ValueError):
        split_even(-1, 2)
    assert split_even(0, 3) == []


@pytest.mark.parametrize("cls", [HashSlicer, RangeSlicer])
def test_large_arrays_split_over_all_servers(cls: type) -> None:
    s = cls(split_min_bytes=1024)
    pieces = s.slice(5, 1000, 4, 3)  # 4000 bytes
    _check_cover(pieces, 1000)
    assert [p.server for p in pieces] == [0, 1, 2]
    # just below the threshold: whole on one server
    small = s.slice(5, 255, 4, 3)
    assert len(small) == 1 and small[0] == Piece(small[0].server, 0, 255)


def test_hash_slicer_is_stable_and_spreads() -> None:
    s = HashSlicer()
    homes = [s.slice(k, 10, 4, 4)[0].server for k in range(400)]
    assert homes == [HashSlicer().slice(k, 10, 4, 4)[0].server for k in range(400)]
    counts = [homes.count(i) for i in range(4)]
    assert min(counts) > 60, counts  # roughly even (100 each expected)
    # a known value, so that a change of hash (which would strand checkpoints) is noticed
    assert [s.home(k, 3) for k in range(8)] == [0, 1, 2, 0, 1, 0, 1, 0]


def test_range_slicer_keeps_neighbours_together() -> None:
    s = RangeSlicer(key_space=100)
    assert [s.slice(k, 1, 8, 4)[0].server for k in (0, 24, 25, 49, 50, 99)] == [0, 0, 1, 1, 2, 3]
    with pytest.raises(ValueError, match="outside"):
        s.slice(100, 1, 8, 4)


def test_one_server_never_splits() -> None:
    assert HashSlicer(split_min_bytes=1).slice(3, 1000, 8, 1) == [Piece(0, 0, 1000)]


@pytest.mark.parametrize("key", [-1, 1 << 62, 1.5, "w", True])
def test_bad_keys_refused(key: object) -> None:
    with pytest.raises(ValueError, match="key"):
        HashSlicer().slice(key, 10, 4, 2)  # type: ignore[arg-type]
