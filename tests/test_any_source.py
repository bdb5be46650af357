"""Any-source receive (``recv(x, src=rc.ANY_SOURCE)``): matching, order, failures.

The ordering cases run over the in-memory transport (tests/memory_world.py), where the hub
holds back one sender's messages so that arrival order is what the case says; the matrix
and the departure case run between real processes (rc.spawn). The rule checked
throughout (MPI's): an any-source receive takes the earliest-arrived message with its tag
from any rank, or the first to arrive; a receive posted earlier for the sender matches
first; messages from one sender with one tag match receives in the order sent; a message
is never split between receives.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from memory_world import hub_of, memory_world, run_ranks

import ringcomm as rc

TAG = 5
MARK = 99  # a marker message: once it is in, everything sent before it is in too


def payload(sender: int, k: int, n: int = 6) -> np.ndarray:
    return np.arange(n, dtype=np.int64) + 1000 * sender + k


def mark(pg: rc.ProcessGroup, src: int) -> None:
    """Receive ``src``'s marker: its earlier messages to us have been dispatched."""
    pg.recv(np.zeros(1, np.uint8), src=src, tag=MARK)


def send_mark(pg: rc.ProcessGroup, dst: int) -> None:
    pg.send(np.zeros(1, np.uint8), dst=dst, tag=MARK)


# -- matching and order (memory transport) ----------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 8])
def test_every_message_once_per_sender_order_kept(seed: int, chunk_bytes: int) -> None:
    """4 senders x 5 messages of many pieces, interleaved by the hub's seed: rank 0's
    any-source receives get each message whole, once, each sender's in the order sent."""
    per = 5

    def body(pg: rc.ProcessGroup) -> Any:
        if pg.rank == 0:
            got = []
            for _ in range(per * (pg.world_size - 1)):
                x = np.zeros(6, np.int64)
                src = pg.recv(x, rc.ANY_SOURCE, tag=TAG)
                k = int(x[0] - 1000 * src)
                assert np.array_equal(x, payload(src, k)), (src, x)
                got.append((src, k))
            return got
        works = [pg.isend(payload(pg.rank, k), dst=0, tag=TAG) for k in range(per)]
        for w in works:
            w.wait()
        return None

    with memory_world(5, seed=seed, chunk_bytes=chunk_bytes) as groups:
        got = run_ranks(groups, body)[0]
    for sender in range(1, 5):
        assert [k for s, k in got if s == sender] == list(range(per))


def test_earliest_arrival_first_when_waiting() -> None:
    """Messages already in (rank 2's, then rank 1's): recv(ANY) takes rank 2's first."""

    def body(pg: rc.ProcessGroup) -> Any:
        hub = hub_of(pg)
        if pg.rank == 0:
            mark(pg, 2)  # rank 2's tag-5 message is in; rank 1's is held back
            hub.release(1, 0)
            mark(pg, 1)
            x = np.zeros(6, np.int64)
            first = pg.recv(x, rc.ANY_SOURCE, tag=TAG)
            second = pg.recv(x, None, tag=TAG)  # None: any source too
            return first, second
        if pg.rank == 1:
            pg.send(payload(1, 0), dst=0, tag=TAG)
            send_mark(pg, 0)
        else:
            pg.send(payload(2, 0), dst=0, tag=TAG)
            send_mark(pg, 0)
        return None

    with memory_world(3) as groups:
        hub_of(groups[0]).hold(1, 0)
        assert run_ranks(groups, body)[0] == (2, 1)


def test_any_posted_before_specific_matches_first() -> None:
    """irecv(ANY) then irecv(src=1): rank 1's first message goes to the any-source one,
    its second to the specific one (posting order, as MPI)."""

    def body(pg: rc.ProcessGroup) -> Any:
        if pg.rank == 0:
            a, b = np.zeros(6, np.int64), np.zeros(6, np.int64)
            wa = pg.irecv(a, rc.ANY_SOURCE, tag=TAG)
            wb = pg.irecv(b, 1, tag=TAG)
            pg.send(np.zeros(1, np.uint8), dst=1, tag=MARK)  # both are posted: go
            assert wb.wait() is b and wb.source == 1
            src = wa.wait()
            return src, wa.source, int(a[0]), int(b[0])
        if pg.rank == 1:
            mark(pg, 0)
            pg.send(payload(1, 0), dst=0, tag=TAG)
            pg.send(payload(1, 1), dst=0, tag=TAG)
        return None

    with memory_world(3) as groups:
        assert run_ranks(groups, body)[0] == (1, 1, 1000, 1001)


def test_specific_posted_before_any_matches_first() -> None:
    """irecv(src=1) then irecv(ANY): rank 1's message goes to the specific receive; the
    any-source one waits for the next (here rank 2's)."""

    def body(pg: rc.ProcessGroup) -> Any:
        if pg.rank == 0:
            a, b = np.zeros(6, np.int64), np.zeros(6, np.int64)
            wb = pg.irecv(b, 1, tag=TAG)
            wa = pg.irecv(a, rc.ANY_SOURCE, tag=TAG)
            for peer in (1, 2):
                pg.send(np.zeros(1, np.uint8), dst=peer, tag=MARK)
            wb.wait()
            return wa.wait(), int(a[0]), int(b[0])
        mark(pg, 0)
        if pg.rank == 1:
            pg.send(payload(1, 0), dst=0, tag=TAG)
            send_mark(pg, 2)  # rank 2 sends only once rank 1's message is on its way
        else:
            mark(pg, 1)
            pg.send(payload(2, 0), dst=0, tag=TAG)
        return None

    with memory_world(3) as groups:
        assert run_ranks(groups, body)[0] == (2, 2000, 1000)


def test_pending_any_receives_match_in_posting_order() -> None:
    """Three irecv(ANY) posted, then three messages: the first posted gets the first."""

    def body(pg: rc.ProcessGroup) -> Any:
        if pg.rank == 0:
            bufs = [np.zeros(6, np.int64) for _ in range(3)]
            works = [pg.irecv(b, rc.ANY_SOURCE, tag=TAG) for b in bufs]
            pg.send(np.zeros(1, np.uint8), dst=1, tag=MARK)
            return [(w.wait(), int(b[0])) for w, b in zip(works, bufs)]
        if pg.rank == 1:
            mark(pg, 0)
            for k in range(3):
                pg.send(payload(1, k), dst=0, tag=TAG)
        return None

    with memory_world(3) as groups:
        assert run_ranks(groups, body)[0] == [(1, 1000), (1, 1001), (1, 1002)]


def test_other_tags_and_groups_never_match() -> None:
    """Rank 1's tag-6 message and its message on a sub-group are in first: recv(ANY,
    tag 5) on the world group waits for rank 2's; each of the others is still there for
    its own receive."""

    def body(pg: rc.ProcessGroup) -> Any:
        sub = pg.new_group([0, 1])
        if pg.rank == 0:
            assert sub is not None
            mark(pg, 1)  # the tag-6 and sub-group messages are in, unexpected
            send_mark(pg, 2)  # now rank 2 sends
            x, y, z = (np.zeros(6, np.int64) for _ in range(3))
            src = pg.recv(x, rc.ANY_SOURCE, tag=TAG)
            pg.recv(y, 1, tag=6)
            assert sub.recv(z, rc.ANY_SOURCE, tag=TAG) == 1
            return src, int(x[0]), int(y[0]), int(z[0])
        if pg.rank == 1:
            assert sub is not None
            pg.send(payload(1, 6), dst=0, tag=6)
            sub.send(payload(1, 7), dst=0, tag=TAG)
            send_mark(pg, 0)
        else:
            mark(pg, 0)
            pg.send(payload(2, 0), dst=0, tag=TAG)
        return None

    with memory_world(3) as groups:
        assert run_ranks(groups, body)[0] == (2, 2000, 1006, 1007)


def test_self_send_and_world_of_one() -> None:
    """A message to oneself matches an any-source receive (W=1 and W=2)."""

    def body(pg: rc.ProcessGroup) -> Any:
        w = pg.isend(payload(pg.rank, 3), dst=pg.rank, tag=TAG)
        x = np.zeros(6, np.int64)
        src = pg.recv(x, rc.ANY_SOURCE, tag=TAG)
        w.wait()
        return src, int(x[0])

    for n in (1, 2):
        with memory_world(n) as groups:
            assert run_ranks(groups, body) == [(r, 1000 * r + 3) for r in range(n)]


def test_timeout_withdraws_the_receive() -> None:
    """An any-source receive that times out is withdrawn: the message that comes later
    goes to the next receive, whole."""

    def body(pg: rc.ProcessGroup) -> Any:
        if pg.rank == 0:
            x = np.zeros(6, np.int64)
            with pytest.raises(rc.CommTimeoutError, match=r"recv from any peer.*tag 5"):
                pg.recv(x, rc.ANY_SOURCE, tag=TAG, timeout_s=0.2)
            pg.send(np.zeros(1, np.uint8), dst=1, tag=MARK)
            src = pg.recv(x, rc.ANY_SOURCE, tag=TAG)
            return src, int(x[0])
        if pg.rank == 1:
            mark(pg, 0)
            pg.send(payload(1, 4), dst=0, tag=TAG)
        return None

    with memory_world(2) as groups:
        assert run_ranks(groups, body)[0] == (1, 1004)


def test_size_mismatch_names_the_sender() -> None:
    def body(pg: rc.ProcessGroup) -> Any:
        if pg.rank == 0:
            with pytest.raises(rc.MessageMismatchError, match="recv from peer 1"):
                pg.recv(np.zeros(3, np.int64), rc.ANY_SOURCE, tag=TAG)
        else:
            pg.send(payload(1, 0), dst=0, tag=TAG)

    with memory_world(2) as groups:
        run_ranks(groups, body)


def test_bad_source_rejected_at_the_call() -> None:
    with memory_world(2) as groups:
        pg = groups[0]
        for bad in (-1, -2, 2):  # a negative rank is a mistake, not "any source"
            with pytest.raises(ValueError, match=rf"rank 0: recv: src {bad} is out of range"):
                pg.recv(np.zeros(1), bad)
        with pytest.raises(TypeError, match=r"rank 0: recv: src must be an int"):
            pg.irecv(np.zeros(1), "any")  # type: ignore[arg-type]


def test_killed_senders_fail_the_receive() -> None:
    """Every other rank killed (no goodbye): the any-source receive raises
    PeerFailedError naming one, well within its timeout."""
    with memory_world(3, timeout_s=30.0) as groups:
        hub = hub_of(groups[0])

        def body(pg: rc.ProcessGroup) -> Any:
            if pg.rank != 0:
                return None
            w = pg.irecv(np.zeros(1), rc.ANY_SOURCE, tag=TAG)
            hub.kill(1)
            hub.kill(2)
            t0 = time.monotonic()
            with pytest.raises(rc.PeerFailedError, match=r"peer rank [12]"):
                w.wait()
            return time.monotonic() - t0

        assert run_ranks(groups, body)[0] < 5.0


def test_departed_senders_fail_the_receive_only_when_all_left() -> None:
    """Rank 1 closes: an any-source receive still gets rank 2's message; once rank 2
    closes too, the next one raises PeerFailedError (nobody is left to send)."""

    def body(pg: rc.ProcessGroup) -> Any:
        if pg.rank == 0:
            mark(pg, 1)  # rank 1 is about to close
            x = np.zeros(6, np.int64)
            pg.send(np.zeros(1, np.uint8), dst=2, tag=MARK)
            src = pg.recv(x, rc.ANY_SOURCE, tag=TAG)
            t0 = time.monotonic()
            with pytest.raises(rc.PeerFailedError, match="left the group"):
                pg.recv(x, rc.ANY_SOURCE, tag=TAG)
            return src, int(x[0]), time.monotonic() - t0
        if pg.rank == 1:
            send_mark(pg, 0)
        else:
            mark(pg, 0)
            pg.send(payload(2, 0), dst=0, tag=TAG)
        pg.close()
        return None

    with memory_world(3, timeout_s=30.0) as groups:
        src, first, took = run_ranks(groups, body)[0]
    assert (src, first) == (2, 2000)
    assert took < 5.0


# -- between processes -------------------------------------------------------------------
def many_senders_job(pg: rc.ProcessGroup, per: int) -> Any:
    """Every rank but 0 sends ``per`` messages (some many-piece); rank 0 receives them
    all from any source with irecv and recv mixed, checking content and order."""
    pg.chunk_bytes = 64
    n = pg.world_size
    if pg.rank == 0:
        seen: dict[int, list[int]] = {r: [] for r in range(1, n)}
        for i in range(per * (n - 1)):
            x = np.zeros(100, np.int64)
            if i % 2:
                src = pg.recv(x, rc.ANY_SOURCE, tag=TAG)
            else:
                w = pg.irecv(x, rc.ANY_SOURCE, tag=TAG)
                src = w.wait()
                assert w.source == src
            k = int(x[0] - 1000 * src)
            assert np.array_equal(x, payload(src, k, 100))
            seen[src].append(k)
        return seen
    for k in range(per):
        pg.send(payload(pg.rank, k, 100), dst=0, tag=TAG)
    return None


def leavers_job(pg: rc.ProcessGroup) -> Any:
    """Ranks 1.. close their group; rank 0's any-source receive fails, bounded."""
    if pg.rank != 0:
        pg.close()
        return None
    t0 = time.monotonic()
    try:
        pg.recv(np.zeros(1), rc.ANY_SOURCE, tag=TAG, timeout_s=30.0)
    except rc.PeerFailedError as exc:
        return f"PeerFailedError: {exc}", time.monotonic() - t0
    return "no error", time.monotonic() - t0


@pytest.mark.timeout(120)
def test_many_senders_over_sockets(no_child_processes: None) -> None:
    results = rc.spawn(many_senders_job, 4, args=(8,), timeout_s=90)
    assert results[0] == {r: list(range(8)) for r in range(1, 4)}


@pytest.mark.timeout(120)
def test_all_senders_leave_over_sockets(no_child_processes: None) -> None:
    text, took = rc.spawn(leavers_job, 3, timeout_s=90)[0]
    assert text.startswith("PeerFailedError") and "left the group" in text, text
    assert took < 10.0


def test_device_buffer_any_source() -> None:
    """A device receive buffer (the host stand-in) takes an any-source message too."""
    from ringcomm.device.standin import StandinArray

    def body(pg: rc.ProcessGroup) -> Any:
        if pg.rank == 0:
            x = StandinArray(np.zeros(6, np.int64))
            src = pg.recv(x, rc.ANY_SOURCE, tag=TAG)
            return src, x.get().tolist()
        pg.send(payload(1, 2), dst=0, tag=TAG)
        return None

    with memory_world(2, chunk_bytes=16) as groups:
        assert run_ranks(groups, body)[0] == (1, payload(1, 2).tolist())
