"""The in-memory transport (ringcomm.transport.memory) and the protocol logic above it.

No sockets, no sleeps: every rank of a job is a thread of this process, over one
``MemoryHub`` whose seed fixes the delivery order across senders (STYLE.md, habit 9).

(a) the transport alone: per-sender order, seeded order across senders, framing, faults;
(b) collectives and point-to-point over it at world sizes 1..5, several seeds, tiny pieces,
    against NumPy references, every rank bit-identical;
(c) protocol logic that otherwise needs real processes: a collective mismatch, a killed
    rank, a goodbye, a delayed message, a lost one, an abort.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from memory_world import close_all, hub_of, memory_groups, memory_world, run_ranks

from ringcomm.core.progress import SUSPECT_GRACE_S
from ringcomm.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    PeerFailedError,
    RingcommError,
)
from ringcomm.ops import reference_reduce
from ringcomm.transport.base import EVENT_DISCONNECTED, INLINE_MAX_BYTES, Stream
from ringcomm.transport.memory import MemoryHub, MemoryTransport
from ringcomm.transport.wire import KIND_P2P, Header, pack_header, unpack_header

pytestmark = pytest.mark.timeout(60)

WORLDS = (1, 2, 3, 4, 5)
SEEDS = (0, 1, 2)
ALL_REDUCE_ALGOS = ("ring", "direct", "rd", "star")
COUNTS = (0, 1, 7, 300)
CHUNK_BYTES = 16  # 4 float32 per piece: a 300-element ring step is ~20 pieces


# -- (a) the transport alone -----------------------------------------------------------
def _header(src: int, step: int, nbytes: int = 0) -> bytes:
    return pack_header(Header(KIND_P2P, src, 0, 0, step=step, nbytes=nbytes))


def _drain(t: MemoryTransport) -> list[tuple[Header, bytes]]:
    """Everything visible to ``t`` now, as (header, payload)."""
    got = []
    while (first := t.recv_first()) is not None:
        frame, more = first
        header, inline = unpack_header(frame)
        if more:
            payload = t.recv_payload(copy=True, src=header.src)
            assert isinstance(payload, memoryview)
            got.append((header, bytes(payload)))
        else:
            got.append((header, inline or b""))
    return got


def _arrival_order(seed: int, senders: int = 4, per_sender: int = 20) -> list[tuple[int, int]]:
    """(src, step) of each message as rank 0 takes them, all sent before it looks."""
    hub = MemoryHub(senders + 1, seed=seed)
    ts = [MemoryTransport(r, hub) for r in range(senders + 1)]
    for step in range(per_sender):
        for src in range(1, senders + 1):
            ts[src].send(0, Stream(), _header(src, step), b"x", 1)
    return [(h.src, h.step) for h, _ in _drain(ts[0])]


def test_per_sender_order_is_kept() -> None:
    for seed in SEEDS:
        order = _arrival_order(seed)
        assert len(order) == 4 * 20
        for src in range(1, 5):
            assert [s for r, s in order if r == src] == list(range(20)), (seed, src)


def test_order_across_senders_follows_the_seed() -> None:
    orders = {seed: _arrival_order(seed) for seed in range(5)}
    assert all(_arrival_order(seed) == order for seed, order in orders.items())
    assert len({tuple(o) for o in orders.values()}) > 1  # the seed changes the interleaving


def test_small_payloads_travel_inline_large_ones_copied_in_a_frame() -> None:
    hub = MemoryHub(2)
    a, b = MemoryTransport(0, hub), MemoryTransport(1, hub)
    small = np.arange(INLINE_MAX_BYTES - 1, dtype=np.uint8)
    large = np.arange(INLINE_MAX_BYTES, dtype=np.uint8)
    assert a.send(1, Stream(), _header(0, 0, small.nbytes), small, small.nbytes) is None
    assert a.send(1, None, _header(0, 1, large.nbytes), large, large.nbytes) is None
    expected_large = large.tobytes()
    large[:] = 7  # the caller may reuse its buffer at once
    first = b.recv_first()
    assert first is not None
    frame, more = first
    # One frame: exactly what the zmq transport sends (the header with the payload inline).
    assert not more and frame == pack_header(
        Header(KIND_P2P, 0, 0, 0, step=0, nbytes=small.nbytes), small.tobytes()
    )
    first = b.recv_first()
    assert first is not None
    frame, more = first
    assert more and frame == _header(0, 1, large.nbytes)
    payload = b.recv_payload(copy=False, src=0)
    assert isinstance(payload, memoryview) and payload.tobytes() == expected_large
    assert payload.readonly
    assert b.recv_first() is None and b.recv_payload(copy=True) is False
    assert (a.sent_messages, a.sent_bytes) == (2, small.nbytes + large.nbytes)
    assert (a.lane_messages, a.shm_pieces, a.lane_fallbacks, a.auth_failures) == (0, 0, 0, 0)
    assert a.security is None and a.peers() == [1]


def test_kill_reports_disconnected_and_drops_its_traffic() -> None:
    hub = MemoryHub(3)
    ts = [MemoryTransport(r, hub) for r in range(3)]
    ts[0].send(2, None, _header(0, 0), b"a", 1)  # queued at 2: lost with it
    ts[2].send(1, None, _header(2, 0), b"b", 1)  # already at 1 before the kill: stays
    hub.hold(2, 0)
    ts[2].send(0, None, _header(2, 0), b"e", 1)  # held back on its way to 0: lost
    hub.kill(2)
    hub.kill(2)  # idempotent
    assert ts[0].poll_events() == [(2, EVENT_DISCONNECTED)]
    assert ts[1].poll_events() == [(2, EVENT_DISCONNECTED)]
    assert ts[1].poll_events() == []  # each event is handed out once
    assert ts[2].poll_events() == [(0, EVENT_DISCONNECTED), (1, EVENT_DISCONNECTED)]
    ts[0].send(2, None, _header(0, 1), b"c", 1)  # to the dead: lost
    ts[2].send(0, None, _header(2, 1), b"d", 1)  # from the dead: lost
    assert hub.dropped == 4 and hub.killed(2) and hub.held(2, 0) == 0
    assert [h.src for h, _ in _drain(ts[1])] == [2]
    assert ts[0].recv_first() is None and ts[2].recv_first() is None
    assert ts[2].poll(0.0) is False


def test_hold_release_and_drop_next() -> None:
    hub = MemoryHub(2)
    a, b = MemoryTransport(0, hub), MemoryTransport(1, hub)
    hub.hold(0, 1, 2)  # two go through, the rest waits
    for step in range(5):
        a.send(1, None, _header(0, step), b"x", 1)
    assert hub.held(0, 1) == 3 and hub.wait_held(0, 1, 3, timeout_s=0.0)
    assert [h.step for h, _ in _drain(b)] == [0, 1]
    assert not b.poll(0.0)
    hub.hold(0, 1, 5)  # letting more through must not overtake what is held
    a.send(1, None, _header(0, 5), b"x", 1)
    assert b.recv_first() is None
    hub.release(0, 1)
    assert [h.step for h, _ in _drain(b)] == [2, 3, 4, 5]
    hub.drop_next(0, 1, 2)
    for step in range(6, 9):
        a.send(1, None, _header(0, step), b"x", 1)
    assert [h.step for h, _ in _drain(b)] == [8] and hub.dropped == 2


def test_poll_wake_farewell_and_close() -> None:
    hub = MemoryHub(2)
    a, b = MemoryTransport(0, hub), MemoryTransport(1, hub)
    assert b.poll(0.0) is False
    b.wake()  # a wake-up before the poll: the poll returns at once
    t0 = time.monotonic()
    assert b.poll(30.0) is False and time.monotonic() - t0 < 10.0
    result: list[bool] = []
    poller = threading.Thread(target=lambda: result.append(b.poll(30.0)))
    poller.start()
    a.send(1, None, _header(0, 0), b"x", 1)  # wakes the poll (any thread)
    poller.join(10.0)
    assert result == [True]
    _drain(b)
    completion = a.send_tracked(1, _header(0, 1))
    assert completion.done and a.wait_sent(completion, 0.0)
    a.send_farewell(_header(0, 2), [1], 0.1)
    assert sorted(h.step for h, _ in _drain(b)) == [1, 2]
    a.close()
    a.close()  # idempotent
    assert b.poll_events() == [(0, EVENT_DISCONNECTED)]
    with pytest.raises(RingcommError, match="closed"):
        a.send(1, None, _header(0, 3), b"x", 1)
    with pytest.raises(RingcommError, match="closed"):
        a.recv_first()
    with pytest.raises(RingcommError, match="closed"):
        a.poll(0.0)
    a.send_farewell(_header(0, 4), [1], 0.1)  # works after close, as zmq's does
    assert [h.step for h, _ in _drain(b)] == [4]
    b.send(0, None, _header(1, 0), b"x", 1)  # to a closed rank: lost
    assert hub.dropped == 1
    a.wake()
    a.remove_files()


# -- (b) collectives and point-to-point against NumPy ----------------------------------
def _data(rank: int, count: int, dtype: Any, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: different on every rank; floats not exactly summable."""
    rng = np.random.default_rng([rank, count, salt])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(count).astype(dtype)
    return rng.integers(-1000, 1000, count).astype(dtype)


def _check(results: list[Any], expected: Any, exact: bool) -> None:
    """Every rank bit-identical to rank 0; rank 0 equal (or close) to the reference."""
    first = results[0]
    for rank, got in enumerate(results):
        assert got.dtype == first.dtype and got.shape == first.shape, rank
        assert got.tobytes() == first.tobytes(), f"rank {rank} differs from rank 0"
    if exact:
        np.testing.assert_array_equal(first, expected)
    else:
        np.testing.assert_allclose(first, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_every_algorithm(world: int, seed: int) -> None:
    cases = [
        (algo, count, dtype, op)
        for algo in ALL_REDUCE_ALGOS
        for count in COUNTS
        for dtype, op in ((np.int64, "sum"), (np.float32, "sum"), (np.int32, "max"))
    ]

    def body(pg: Any) -> list[np.ndarray]:
        out = []
        for i, (algo, count, dtype, op) in enumerate(cases):
            x = _data(pg.rank, count, dtype, i)
            assert pg.all_reduce(x, op, algo=algo) is x
            out.append(x)
        return out

    with memory_world(world, seed=seed, chunk_bytes=CHUNK_BYTES) as groups:
        per_rank = run_ranks(groups, body)
    for i, (algo, count, dtype, op) in enumerate(cases):
        ref = reference_reduce(op, [_data(r, count, dtype, i) for r in range(world)])
        try:
            _check([res[i] for res in per_rank], ref, exact=np.dtype(dtype).kind != "f")
        except AssertionError as exc:
            raise AssertionError(f"{algo} {count} {np.dtype(dtype)} {op}: {exc}") from exc


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("world", WORLDS)
def test_other_collectives_and_p2p(world: int, seed: int) -> None:
    counts = (1, 5, 120)

    def body(pg: Any) -> dict[str, Any]:
        r, n = pg.rank, pg.world_size
        got: dict[str, Any] = {}
        for count in counts:
            x = _data(r, n * count, np.float32).reshape(n, count)
            got[f"reduce_scatter {count}"] = pg.reduce_scatter(x)
            got[f"all_gather {count}"] = pg.all_gather(_data(r, count, np.int16))
            for src in range(n):
                for algo in ("tree", "chain"):
                    y = _data(r, count, np.float64) if r == src else np.zeros(count)
                    got[f"broadcast {algo} {src} {count}"] = pg.broadcast(y, src, algo=algo)
            # Point-to-point around the ring, several messages in flight on each link.
            sends = [
                pg.isend(_data(r, count, np.int32, tag), (r + 1) % n, tag) for tag in (3, 1, 2)
            ]
            for tag in (1, 2, 3):
                got[f"recv {tag} {count}"] = pg.recv(np.empty(count, np.int32), (r - 1) % n, tag)
            for work in sends:
                work.wait()
            pg.barrier()
        return got

    with memory_world(world, seed=seed, chunk_bytes=CHUNK_BYTES) as groups:
        per_rank = run_ranks(groups, body)
    for count in counts:
        inputs = [_data(r, world * count, np.float32).reshape(world, count) for r in range(world)]
        full = reference_reduce("sum", inputs)
        for r, res in enumerate(per_rank):
            np.testing.assert_allclose(res[f"reduce_scatter {count}"], full[r], 1e-5, 1e-5)
            left = (r - 1) % world
            for tag in (1, 2, 3):  # bit-identical to what the left neighbour sent
                sent = _data(left, count, np.int32, tag)
                assert res[f"recv {tag} {count}"].tobytes() == sent.tobytes(), (r, tag)
        gathered = np.stack([_data(r, count, np.int16) for r in range(world)])
        _check([res[f"all_gather {count}"] for res in per_rank], gathered, exact=True)
        for src in range(world):
            for algo in ("tree", "chain"):
                key = f"broadcast {algo} {src} {count}"
                _check([res[key] for res in per_rank], _data(src, count, np.float64), True)


# -- (c) protocol logic ------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_mismatch_raises_on_every_rank(world: int, seed: int) -> None:
    def body(pg: Any) -> BaseException | None:
        x = np.ones(40, np.float32)
        try:
            if pg.rank == world - 1:
                pg.all_gather(x, timeout_s=5.0)  # the others call all_reduce
            else:
                pg.all_reduce(x, timeout_s=5.0)
        except RingcommError as exc:
            return exc
        return None

    with memory_world(world, seed=seed, chunk_bytes=CHUNK_BYTES) as groups:
        errors = run_ranks(groups, body)
    for rank, err in enumerate(errors):
        assert isinstance(err, CollectiveMismatchError), (rank, err)


@pytest.mark.parametrize(("world", "algo"), [(3, "direct"), (4, "ring"), (5, "rd")])
def test_killed_rank_fails_the_survivors_pending_all_reduce(world: int, algo: str) -> None:
    victim = 1
    survivors = [r for r in range(world) if r != victim]
    groups = memory_groups(world, chunk_bytes=CHUNK_BYTES, timeout_s=10.0)
    hub = hub_of(groups[0])
    for r in survivors:
        hub.hold(r, victim)  # the victim sees the survivors' first messages go by

    def body(pg: Any) -> BaseException | None:
        if pg.rank == victim:
            # Die once every survivor is inside its all_reduce: each sends us something
            # when it starts (data, or a fingerprint message: collectives/base.py).
            assert all(hub.wait_held(r, victim) for r in survivors)
            hub.kill(victim)
            return None
        try:
            pg.all_reduce(np.ones(100, np.float32), algo=algo)
        except RingcommError as exc:
            return exc
        return None

    t0 = time.monotonic()
    try:
        errors = run_ranks(groups, body)
    finally:
        close_all(groups)
    for r in survivors:
        err = errors[r]
        assert isinstance(err, PeerFailedError) and err.peer == victim, (r, err)
        assert f"peer rank {victim}" in str(err), str(err)
    assert time.monotonic() - t0 < SUSPECT_GRACE_S + 5.0  # well before any deadline


def test_goodbye_fails_a_pending_receive() -> None:
    posted = threading.Event()

    def body(pg: Any) -> BaseException | None:
        if pg.rank == 0:
            assert posted.wait(10.0)
            pg.close()  # says goodbye to everyone
            return None
        if pg.rank == 2:
            return None  # a bystander: closing rank 0 is no failure for it
        work = pg.irecv(np.empty(10, np.float32), 0)
        posted.set()
        try:
            work.wait()
        except RingcommError as exc:
            return exc
        return None

    with memory_world(3) as groups:
        errors = run_ranks(groups, body)
        assert groups[2].core.progress.failure is None  # nothing of its own waited on 0
    err = errors[1]
    assert isinstance(err, PeerFailedError) and err.peer == 0, err
    assert "peer rank 0 left the group (it closed its process group)" in str(err), str(err)


def test_a_peer_that_leaves_after_our_goodbye_without_its_own_is_no_failure() -> None:
    # The store's host says goodbye, then waits for the others to check out; a peer that
    # has its goodbye leaves without one to it (it counts the host as gone): its dropped
    # connection is a departure (at once), not "failed: dropped without a goodbye".
    groups = memory_groups(2)
    hub = hub_of(groups[0])
    try:
        host = groups[0].core.progress
        host.say_goodbye(0.0)
        hub.kill(1)
        host.read_control()  # what the check-out loop does between its store waits
        assert host.departed(1)
        assert host.failure is None and 1 not in host.failed_peers
    finally:
        close_all(groups)


@pytest.mark.parametrize("seed", SEEDS)
def test_held_messages_arrive_in_order_after_release(seed: int) -> None:
    groups = memory_groups(3, seed=seed, chunk_bytes=CHUNK_BYTES)
    hub = hub_of(groups[0])
    hub.hold(0, 1, 3)  # 3 pieces of the first message go through, the rest wait
    count = 50  # 200 bytes: 13 pieces per message

    def body(pg: Any) -> list[np.ndarray]:
        if pg.rank == 0:
            works = [pg.isend(np.full(count, tag, np.int32), 1, 0) for tag in range(3)]
            assert hub.wait_held(0, 1, 3 * 13 - 3)  # all of it is on the wire, mostly held
            pg.send(np.full(count, 9, np.int32), 2, 5)  # other links are not held
            hub.release(0, 1)
            for work in works:
                work.wait()
            return []
        if pg.rank == 2:
            return [pg.recv(np.empty(count, np.int32), 0, 5)]
        return [pg.recv(np.empty(count, np.int32), 0, 0) for _ in range(3)]

    try:
        got = run_ranks(groups, body)
    finally:
        close_all(groups)
    assert [int(a[0]) for a in got[1]] == [0, 1, 2]  # same tag: in the order sent
    assert all(len(set(a.tolist())) == 1 for a in got[1])  # no piece of another message
    assert got[2][0].tolist() == [9] * count


def test_lost_message_times_out_with_a_progress_map() -> None:
    groups = memory_groups(2, timeout_s=10.0)
    hub_of(groups[0]).drop_next(0, 1, 1)

    def body(pg: Any) -> BaseException | None:
        if pg.rank == 0:
            pg.send(np.arange(4, dtype=np.int64), 1)  # lost on the way
            return None
        try:
            pg.recv(np.empty(4, np.int64), 0, timeout_s=0.2)
        except RingcommError as exc:
            return exc
        return None

    try:
        errors = run_ranks(groups, body)
    finally:
        close_all(groups)
    err = errors[1]
    assert isinstance(err, CommTimeoutError), err
    assert "timed out after 0.2 s" in str(err) and "where each rank was" in str(err)


def test_abort_tells_peers_why() -> None:
    started = threading.Event()

    def body(pg: Any) -> BaseException | None:
        if pg.rank == 0:
            assert started.wait(10.0)
            pg.abort("disk full")  # a farewell: no data path, no waiting
            return None
        work = pg.irecv(np.empty(3, np.float32), 0)
        started.set()
        try:
            work.wait()
        except RingcommError as exc:
            return exc
        return None

    with memory_world(2) as groups:
        errors = run_ranks(groups, body)
    err = errors[1]
    assert isinstance(err, PeerFailedError) and err.peer == 0, err
    assert "peer rank 0 exited: disk full" in str(err), str(err)
