"""Ring, recursive-doubling and tree schedules, checked by simulating them without sockets."""

from __future__ import annotations

import itertools
from collections import defaultdict, deque

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.ops import ReduceOp, finalize, reduce_into, reference_reduce
from ringcomm.schedule.rd import RdStep, rd_allreduce_plan
from ringcomm.schedule.ring import (
    all_gather_steps,
    owned_segment,
    reduce_scatter_steps,
    ring_neighbors,
    ring_position,
    segment_bounds,
)
from ringcomm.schedule.topology import topology
from ringcomm.schedule.tree import (
    binomial_children,
    binomial_parent,
    binomial_rounds,
    chain_neighbors,
)

WORLD_SIZES = range(1, 10)
ALL_OPS = list(ReduceOp)


def ring_counts(n: int) -> list[int]:
    return sorted({0, 1, n - 1, n + 1, 1000})


def rank_inputs(n: int, count: int, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """One array per rank; ints span the whole range so sums and products wrap."""
    rng = np.random.default_rng(seed + 1000 * n + count)
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(count).astype(dtype) for _ in range(n)]
    info = np.iinfo(dtype)
    return [rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True) for _ in range(n)]


def ceil_log2(n: int) -> int:
    """Smallest k with 2**k >= n."""
    k = 0
    while 2**k < n:
        k += 1
    return k


# ============================================================================== ring


@given(count=st.integers(0, 10_000), n=st.integers(1, 64))
def test_segment_bounds_cover_in_order_and_balance(count, n):
    bounds = segment_bounds(count, n)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    for (_, stop), (start, _) in itertools.pairwise(bounds):
        assert stop == start  # contiguous, in order
    sizes = [stop - start for start, stop in bounds]
    assert sizes == [count // n + (1 if s < count % n else 0) for s in range(n)]


def test_segment_bounds_small_counts_give_empty_segments():
    assert segment_bounds(0, 3) == [(0, 0), (0, 0), (0, 0)]
    assert segment_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert segment_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_step_formulas(n):
    for r in range(n):
        assert ring_neighbors(r, n) == ((r + 1) % n, (r - 1) % n)
        assert owned_segment(r, n) == r
        rs, ag = reduce_scatter_steps(r, n), all_gather_steps(r, n)
        assert len(rs) == len(ag) == n - 1
        for k in range(n - 1):
            assert rs[k] == ((r - k - 1) % n, (r - k - 2) % n)
            assert ag[k] == ((r - k) % n, (r - k - 1) % n)
        if n > 1:
            assert rs[-1][1] == owned_segment(r, n)  # last reduction lands on the owned one
            assert ag[0][0] == owned_segment(r, n)  # all-gather starts from it


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_send_matches_right_neighbours_recv_and_forwards_last_recv(n):
    for r in range(n):
        right = ring_neighbors(r, n)[0]
        for steps in (reduce_scatter_steps, all_gather_steps):
            mine, theirs = steps(r, n), steps(right, n)
            for k in range(n - 1):
                assert mine[k][0] == theirs[k][1]  # what r sends is what r+1 receives
                if k > 0:
                    assert mine[k][0] == mine[k - 1][1]  # r forwards what it just received


def simulate_ring_allreduce(
    op: ReduceOp, inputs: list[np.ndarray], order: tuple[int, ...] | None = None
) -> tuple[list, list]:
    """Run reduce-scatter then all-gather (ranks visited in ``order``); return (buffers
    after RS, buffers after AG)."""
    n, count = len(inputs), inputs[0].size
    bufs = [x.copy() for x in inputs]
    seg = [slice(*b) for b in segment_bounds(count, n)]

    def run(steps_of, combine) -> None:
        plans = [steps_of(r, n, order) for r in range(n)]
        for k in range(n - 1):
            # All ranks send at once: snapshot every outgoing segment first.
            sent = [bufs[r][seg[plans[r][k][0]]].copy() for r in range(n)]
            for r in range(n):
                left = ring_neighbors(r, n, order)[1]
                combine(bufs[r][seg[plans[r][k][1]]], sent[left])

    run(reduce_scatter_steps, lambda local, msg: reduce_into(op, local, msg))
    for r in range(n):
        finalize(op, bufs[r][seg[owned_segment(r, n)]], n)
    after_rs = [b.copy() for b in bufs]

    def overwrite(local, msg):
        local[...] = msg

    run(all_gather_steps, overwrite)
    return after_rs, bufs


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_allreduce_simulation_exact_on_ints(n, op):
    for count in ring_counts(n):
        inputs = rank_inputs(n, count, "int64")
        expected = reference_reduce(op, inputs)
        seg = [slice(*b) for b in segment_bounds(count, n)]
        after_rs, after_ag = simulate_ring_allreduce(op, inputs)
        for r in range(n):
            np.testing.assert_array_equal(after_rs[r][seg[r]], expected[seg[r]])
            np.testing.assert_array_equal(after_ag[r], expected)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_allreduce_simulation_floats_close_and_identical_on_all_ranks(n):
    for count in ring_counts(n):
        inputs = rank_inputs(n, count, "float32")
        _, after_ag = simulate_ring_allreduce(ReduceOp.AVG, inputs)
        expected = reference_reduce(ReduceOp.AVG, inputs)
        for r in range(n):
            np.testing.assert_allclose(after_ag[r], expected, rtol=1e-5, atol=1e-5)
            assert after_ag[r].tobytes() == after_ag[0].tobytes()


#: ring orders: host-contiguous orders of round-robin and uneven placements
ORDERS = [(0, 2, 1, 3), (0, 3, 1, 4, 2, 5), (0, 2, 4, 1, 3), (2, 0, 1), (0, 1, 2, 3)]


@pytest.mark.parametrize("order", ORDERS)
def test_a_ring_in_host_order_reduces_exactly_and_each_rank_owns_its_segment(order):
    n = len(order)
    for k, r in enumerate(order):
        assert ring_position(r, n, order) == k
        assert ring_neighbors(r, n, order) == (order[(k + 1) % n], order[(k - 1) % n])
        rs, ag = reduce_scatter_steps(r, n, order), all_gather_steps(r, n, order)
        assert rs[-1][1] == r and ag[0][0] == r  # rank r still owns segment r (x[rank])
        right = ring_neighbors(r, n, order)[0]
        for steps in (reduce_scatter_steps, all_gather_steps):
            mine, theirs = steps(r, n, order), steps(right, n, order)
            assert all(mine[i][0] == theirs[i][1] for i in range(n - 1))
    for op in ALL_OPS:
        for count in ring_counts(n):
            inputs = rank_inputs(n, count, "int64")
            expected = reference_reduce(op, inputs)
            seg = [slice(*b) for b in segment_bounds(count, n)]
            after_rs, after_ag = simulate_ring_allreduce(op, inputs, order)
            for r in range(n):
                np.testing.assert_array_equal(after_rs[r][seg[r]], expected[seg[r]])
                np.testing.assert_array_equal(after_ag[r], expected)


def test_a_ring_in_topology_order_crosses_each_host_boundary_once():
    # ranks placed round-robin over 3 hosts (h0 h1 h2 h0 h1 h2 ...), as launchers may
    topo = topology([f"h{r % 3}" for r in range(9)])
    n, order = 9, topo.ring_order

    def crossings(order):
        return sum(
            topo.host_of[r] != topo.host_of[ring_neighbors(r, n, order)[0]] for r in range(n)
        )

    assert crossings(None) == 9 and crossings(order) == 3
    for root in range(n):  # the chain too: one crossing per host boundary on its way
        chain, node = [root], root
        while (node := chain_neighbors(node, n, root, order)[1]) is not None:
            chain.append(node)
        assert sorted(chain) == list(range(n))
        hops = sum(topo.host_of[a] != topo.host_of[b] for a, b in itertools.pairwise(chain))
        assert hops <= 3


def test_ring_order_must_be_a_permutation():
    with pytest.raises(ValueError, match="permutation"):
        ring_neighbors(0, 3, (0, 1, 1))
    with pytest.raises(ValueError, match="permutation"):
        reduce_scatter_steps(0, 3, (0, 1))


def test_ring_rejects_bad_ranks():
    for fn in (reduce_scatter_steps, all_gather_steps, owned_segment, ring_neighbors):
        with pytest.raises(ValueError):
            fn(3, 3)
        with pytest.raises(ValueError):
            fn(0, 0)
    with pytest.raises(ValueError):
        segment_bounds(-1, 2)


# ============================================================================== recursive doubling


def simulate_rd(op: ReduceOp, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Carry out every rank's plan with FIFO mailboxes; fail on deadlock."""
    n = len(inputs)
    bufs = [x.copy() for x in inputs]
    plans = [rd_allreduce_plan(r, n) for r in range(n)]
    pc = [0] * n  # next step per rank
    sent_this_step = [False] * n  # exchange: outgoing part done
    mail: dict[tuple[int, int], deque] = defaultdict(deque)

    def advance(r: int) -> bool:
        step: RdStep = plans[r][pc[r]]
        box_in = mail[(step.peer, r)]
        if step.kind in ("send", "send_result"):
            mail[(r, step.peer)].append(bufs[r].copy())
        elif step.kind == "exchange" and not sent_this_step[r]:
            mail[(r, step.peer)].append(bufs[r].copy())  # snapshot before reducing in
            sent_this_step[r] = True
            return True
        elif not box_in:
            return False  # blocked on a receive
        elif step.kind in ("recv_reduce", "exchange"):
            reduce_into(op, bufs[r], box_in.popleft(), incoming_first=step.incoming_first)
        else:  # recv_result
            bufs[r][...] = box_in.popleft()
        pc[r] += 1
        sent_this_step[r] = False
        return True

    while any(pc[r] < len(plans[r]) for r in range(n)):
        progressed = [advance(r) for r in range(n) if pc[r] < len(plans[r])]
        assert any(progressed), f"deadlock at {pc}"
    assert not any(mail.values()), "unconsumed messages"
    for b in bufs:
        finalize(op, b, n)
    return bufs


def rd_bracketing(op: ReduceOp, inputs: list[np.ndarray]) -> np.ndarray:
    """The expression RD must evaluate: fold pairs (2i, 2i+1) for i < rem, then a balanced
    pairwise tree in rank order, lower operand always on the left."""
    n = len(inputs)
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2

    def combine(a, b):
        out = a.copy()
        reduce_into(op, out, b)
        return out

    vals = [combine(inputs[2 * i], inputs[2 * i + 1]) for i in range(rem)]
    vals += [x.copy() for x in inputs[2 * rem :]]
    while len(vals) > 1:
        vals = [combine(vals[i], vals[i + 1]) for i in range(0, len(vals), 2)]
    finalize(op, vals[0], n)
    return vals[0]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_rd_plan_shape_and_pairing(n):
    plans = [rd_allreduce_plan(r, n) for r in range(n)]
    p2 = 1 << (n.bit_length() - 1)
    partner_kind = {"send": "recv_reduce", "send_result": "recv_result", "exchange": "exchange"}
    for r, plan in enumerate(plans):
        exchanges = [s for s in plan if s.kind == "exchange"]
        assert len(exchanges) in (0, ceil_log2(p2))
        for step in plan:
            assert step.peer != r and 0 <= step.peer < n
            if step.kind in ("exchange", "recv_reduce"):  # the lower rank's data goes left
                assert step.incoming_first == (step.peer < r)
            else:
                assert not step.incoming_first
            if step.kind in partner_kind:
                mirror = [s for s in plans[step.peer] if s.peer == r]
                assert any(s.kind == partner_kind[step.kind] for s in mirror)
        # Exchange partners meet at the same exchange index.
        for i, step in enumerate(exchanges):
            theirs = [s for s in plans[step.peer] if s.kind == "exchange"]
            assert theirs[i].peer == r
    assert sum(1 for p in plans if any(s.kind == "exchange" for s in p)) == (p2 if n > 1 else 0)


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_rd_simulation_ints_exact(n, op):
    for dtype in ("int64", "uint8"):
        inputs = rank_inputs(n, 33, dtype)
        results = simulate_rd(op, inputs)
        expected = reference_reduce(op, inputs)
        for r in range(n):
            np.testing.assert_array_equal(results[r], expected)


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_rd_simulation_floats_bit_identical(n, op):
    inputs = rank_inputs(n, 65, "float32")
    results = simulate_rd(op, inputs)
    expected = rd_bracketing(op, inputs)
    for r in range(n):
        assert results[r].tobytes() == expected.tobytes()
    np.testing.assert_allclose(expected, reference_reduce(op, inputs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_rd_signed_zeros_identical_on_all_ranks(n, op):
    # max/min of +0.0 and -0.0 depend on operand order: the plan must fix it.
    rng = np.random.default_rng(n)
    inputs = [np.where(rng.integers(0, 2, 64) == 1, 0.0, -0.0) for _ in range(n)]
    results = simulate_rd(op, inputs)
    for r in range(n):
        assert results[r].tobytes() == results[0].tobytes()


def test_rd_bool_and_avg_semantics_hold():
    inputs = [np.array([r == 2, False, True]) for r in range(5)]
    for r_result in simulate_rd(ReduceOp.SUM, inputs):
        assert r_result.tolist() == [True, False, True]
    ints = [np.array([-r], np.int32) for r in range(5)]  # sum -10, avg -2
    ints[0][0] = -1  # sum -11: truncation gives -2, floor would give -3
    assert [b[0] for b in simulate_rd(ReduceOp.AVG, ints)] == [-2] * 5


def test_rd_plans_for_known_sizes():
    assert rd_allreduce_plan(0, 1) == []
    assert rd_allreduce_plan(0, 2) == [RdStep("exchange", 1)]
    assert rd_allreduce_plan(1, 2) == [RdStep("exchange", 0, incoming_first=True)]
    # n = 3: p2 = 2, rem = 1; rank 1 folds into 0; ranks 0 and 2 exchange.
    assert rd_allreduce_plan(1, 3) == [RdStep("send", 0), RdStep("recv_result", 0)]
    assert rd_allreduce_plan(0, 3) == [
        RdStep("recv_reduce", 1),
        RdStep("exchange", 2),
        RdStep("send_result", 1),
    ]
    assert rd_allreduce_plan(2, 3) == [RdStep("exchange", 0, incoming_first=True)]
    with pytest.raises(ValueError):
        rd_allreduce_plan(3, 3)


# ============================================================================== trees


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_binomial_parent_children_consistent(n):
    for root in range(n):
        assert binomial_parent(root, n, root) is None
        children_of = {r: binomial_children(r, n, root) for r in range(n)}
        received = [c for kids in children_of.values() for c in kids]
        assert sorted(received) == sorted(set(range(n)) - {root})  # each exactly once
        for r, kids in children_of.items():
            for c in kids:
                assert binomial_parent(c, n, root) == r
            vranks = [(c - root) % n for c in kids]
            assert vranks == sorted(vranks, reverse=True)  # largest subtree first


def simulate_rounds(n: int, root: int, children_of) -> int:
    """Broadcast where every informed rank sends to its next child once per round."""
    informed_at = {root: 0}
    queue = {r: deque(children_of(r, n, root)) for r in range(n)}
    rounds = 0
    while len(informed_at) < n:
        rounds += 1
        senders = [r for r in informed_at if queue[r]]
        assert senders, "broadcast stalled"
        for r in senders:
            child = queue[r].popleft()
            assert child not in informed_at  # exactly once
            informed_at[child] = rounds
    assert all(not q for q in queue.values())
    return rounds


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_binomial_broadcast_takes_ceil_log2_rounds(n):
    assert binomial_rounds(n) == ceil_log2(n)
    for root in range(n):
        assert simulate_rounds(n, root, binomial_children) == ceil_log2(n)
        for r in range(n):  # no path longer than that either
            depth, node = 0, r
            while (node := binomial_parent(node, n, root)) is not None:
                depth += 1
            assert depth <= ceil_log2(n)


def reduce_up(r: int, n: int, root: int) -> list[int]:
    """Tree reduce with list concatenation as a non-commutative "op": shows the order."""
    acc = [(r - root) % n]
    for child in reversed(binomial_children(r, n, root)):  # increasing mask
        acc = acc + reduce_up(child, n, root)  # local (op) incoming
    return acc


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_binomial_reduce_folds_in_vrank_order(n):
    for root in range(n):
        assert reduce_up(root, n, root) == list(range(n))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_chain_visits_every_rank_once_from_root(n):
    for root in range(n):
        order, node = [root], root
        assert chain_neighbors(root, n, root)[0] is None
        while (node := chain_neighbors(node, n, root)[1]) is not None:
            order.append(node)
        assert order == [(root + i) % n for i in range(n)]
        for pos, r in enumerate(order):
            prev, nxt = chain_neighbors(r, n, root)
            assert prev == (order[pos - 1] if pos else None)  # parent before child
            assert nxt == (order[pos + 1] if pos + 1 < n else None)


def chain_children(r: int, n: int, root: int) -> list[int]:
    nxt = chain_neighbors(r, n, root)[1]
    return [] if nxt is None else [nxt]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_chain_broadcast_each_rank_receives_once(n):
    for root in range(n):
        assert simulate_rounds(n, root, chain_children) == n - 1


def test_tree_rejects_bad_arguments():
    for fn in (binomial_children, binomial_parent, chain_neighbors):
        with pytest.raises(ValueError):
            fn(0, 3, 3)  # root out of range
        with pytest.raises(ValueError):
            fn(3, 3, 0)  # rank out of range
        with pytest.raises(ValueError):
            fn(0, 0, 0)
    with pytest.raises(ValueError):
        binomial_rounds(0)
