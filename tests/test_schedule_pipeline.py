"""Pure engine schedules: batch splits, buckets, flat layouts and shards, stage balancing,
GPipe and 1F1B orders (checked by simulating them on a clock), no sockets."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.schedule.partition import (
    balance_stages,
    bucket_groups,
    flat_layout,
    shard_pieces,
    split_rows,
)
from ringcomm.schedule.pipeline import (
    Action,
    gpipe_bubble,
    live_activations,
    schedule,
    simulate,
    stage_orders,
)


# -- split_rows ---------------------------------------------------------------------------
@given(st.integers(0, 200), st.integers(1, 17))
def test_split_rows_covers_in_order_near_equal(n: int, parts: int) -> None:
    spans = split_rows(n, parts)
    assert len(spans) == parts
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    sizes = [b - a for a, b in spans]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_split_rows_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        split_rows(4, 0)
    with pytest.raises(ValueError):
        split_rows(-1, 2)


# -- bucket_groups ------------------------------------------------------------------------
def test_bucket_groups_fill_from_the_last_layer() -> None:
    # layers: 100, 0, 50, 300, 0, 20 bytes; buckets of 120 (160) bytes
    assert bucket_groups([100, 0, 50, 300, 0, 20], 120) == [(4, 6), (3, 4), (1, 3), (0, 1)]
    assert bucket_groups([100, 0, 50, 300, 0, 20], 160) == [(4, 6), (3, 4), (0, 3)]
    # a layer larger than the bucket gets its own; zero-byte layers join the open bucket
    assert bucket_groups([10, 10], 1000) == [(0, 2)]
    assert bucket_groups([0, 0], 8) == [(0, 2)]
    assert bucket_groups([], 8) == []


@given(st.lists(st.integers(0, 500), min_size=1, max_size=30), st.integers(1, 800))
def test_bucket_groups_cover_layers_backwards(sizes: list[int], bucket: int) -> None:
    groups = bucket_groups(sizes, bucket)
    assert groups[0][1] == len(sizes) and groups[-1][0] == 0
    assert all(a[0] == b[1] for a, b in itertools.pairwise(groups))  # contiguous, descending
    for a, b in groups:
        total = sum(sizes[a:b])
        assert total <= bucket or b - a == 1 or sum(1 for s in sizes[a:b] if s) == 1


# -- flat_layout / shard_pieces -----------------------------------------------------------
SHAPES = [
    [("W", (3, 5)), ("b", (5,))],
    [],
    [("gamma", (5,)), ("beta", (5,))],
    [("W", (5, 2)), ("b", (2,))],
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("segments", [[(0, 4)], [(0, 1), (1, 2), (2, 3), (3, 4)], [(2, 4), (0, 2)]])
def test_flat_layout_pads_segments_and_shards_partition(world_size, segments) -> None:
    lay = flat_layout(SHAPES, segments, world_size)
    assert lay.numel == 15 + 5 + 10 + 10 + 2
    # parameters are disjoint, in layer order, inside their segment
    covered = set()
    for s in lay.slots:
        span = set(range(s.offset, s.offset + s.size))
        assert not span & covered
        covered |= span
        k = lay.segment_of(s.layer)
        off, size = lay.segments[k]
        assert off <= s.offset and s.offset + s.size <= off + size
    assert [s.layer for s in lay.slots] == sorted(s.layer for s in lay.slots)
    # segments are contiguous, padded to a multiple of world_size, minimal padding
    pos = 0
    for (off, size), (a, b) in zip(lay.segments, lay.segment_layers):
        assert off == pos and size % world_size == 0
        used = sum(s.size for s in lay.slots if a <= s.layer < b)
        assert used <= size < used + world_size
        pos += size
    assert pos == lay.total
    # every element of the buffer is owned by exactly one rank; shards are contiguous
    owned = []
    for r in range(world_size):
        pieces = shard_pieces(lay, r)
        assert sum(q.size for q in pieces) == lay.shard_size
        assert [q.shard_offset for q in pieces] == list(
            itertools.accumulate([0] + [q.size for q in pieces[:-1]])
        )
        for q in pieces:
            owned += range(q.flat_offset, q.flat_offset + q.size)
    assert sorted(owned) == list(range(lay.total))


def test_flat_layout_rejects_gaps() -> None:
    with pytest.raises(ValueError):
        flat_layout(SHAPES, [(0, 2), (3, 4)], 2)
    with pytest.raises(ValueError):
        flat_layout(SHAPES, [(0, 3)], 2)
    with pytest.raises(ValueError):
        shard_pieces(flat_layout(SHAPES, [(0, 4)], 2), 2)


# -- balance_stages -----------------------------------------------------------------------
def _brute_force(costs: list[int], p: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), p - 1):
        bounds = [0, *cuts, len(costs)]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 5))
def test_balance_stages_is_optimal_and_contiguous(costs: list[int], p: int) -> None:
    if p > len(costs):
        with pytest.raises(ValueError):
            balance_stages(costs, p)
        return
    spans = balance_stages(costs, p)
    assert len(spans) == p and spans[0][0] == 0 and spans[-1][1] == len(costs)
    assert all(a < b for a, b in spans) and all(x[1] == y[0] for x, y in itertools.pairwise(spans))
    assert max(sum(costs[a:b]) for a, b in spans) == _brute_force(costs, p)


# -- pipeline orders ----------------------------------------------------------------------
CASES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), CASES)
def test_orders_run_every_action_once_without_deadlock(name: str, p: int, m: int) -> None:
    orders = stage_orders(p, m, name)
    for s, order in enumerate(orders):
        assert sorted(order) == sorted(Action(s, i, k) for i in range(m) for k in "FB")
        # forwards in micro-batch order on every stage
        assert [a.micro for a in order if a.kind == "F"] == list(range(m))
    tl = simulate(orders, fwd_s=1.0, bwd_s=2.0)
    # every stage is busy m*(f+b); the ideal makespan is (m+p-1)(f+b) for both schedules
    assert tl.busy == [3.0 * m] * p
    assert tl.makespan == pytest.approx(3.0 * (m + p - 1))
    assert tl.bubble == pytest.approx(gpipe_bubble(p, m))
    full = schedule(p, m, name)
    assert sorted(full) == sorted(a for o in orders for a in o)
    # the global order respects each stage's order
    for s in range(p):
        assert [a for a in full if a.stage == s] == orders[s]


@pytest.mark.parametrize(("p", "m"), CASES)
def test_1f1b_bounds_live_activations_gpipe_does_not(p: int, m: int) -> None:
    g = stage_orders(p, m, "gpipe")
    f = stage_orders(p, m, "1f1b")
    for s in range(p):
        assert live_activations(g[s]) == m
        assert live_activations(f[s]) == min(p - s, m)


def test_simulate_detects_deadlock_and_bad_orders() -> None:
    # stage 0 waits for a backward that stage 1 can only run after a forward stage 0 never sends
    bad = [[Action(0, 0, "B"), Action(0, 0, "F")], [Action(1, 0, "F"), Action(1, 0, "B")]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad)
    with pytest.raises(ValueError):
        stage_orders(2, 2, "interleaved")
    with pytest.raises(ValueError):
        stage_orders(0, 2)


def test_gpipe_bubble_formula() -> None:
    assert gpipe_bubble(1, 4) == 0.0
    assert gpipe_bubble(2, 4) == pytest.approx(1 / 5)
    assert gpipe_bubble(4, 1) == pytest.approx(3 / 4)


def test_shared_bubble_floor() -> None:
    from ringcomm.schedule.pipeline import shared_bubble_floor

    assert shared_bubble_floor(4, 1) == 0.75  # 4 stages on one GPU without MPS
    assert shared_bubble_floor(4, 2) == 0.5
    assert shared_bubble_floor(4, 4) == 0.0 and shared_bubble_floor(2, 8) == 0.0
    with pytest.raises(ValueError, match="units >= 1"):
        shared_bubble_floor(4, 0)
