"""The fast lane's logic (``Progress.exchange``) over the in-memory transport: no sockets,
no sleeps (STYLE.md, habit 9).

A blocking all_reduce below the inline size tries to complete on the calling thread while
the engine is idle; ``exchange`` returns the payloads (done), False (not taken: the regular
path from the start) or True (handed over to the regular path after sending). Each test
fixes which way the lane must go and orders the ranks with the hub (``hold``/``wait_held``/
``release``) or an event, never with time:

* ``patient_lane`` stretches the lane's one wait (``POLL_SLICE_S``) past every call's
  deadline, so the lane gives up only for a reason of logic (a mismatch, a submission,
  async work), never because a thread was slow;
* the tests of a long wait keep the real slice: the late rank only calls once the lane has
  given up (an event), so "later than one slice" holds by construction.

The end-to-end run of the lane over sockets is test_fast_lane.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from fast_lane_calls import CASES, count_lane, interop_calls, is_blocking
from memory_world import hub_of, memory_world, run_ranks

import ringcomm as rc
from ringcomm.core import progress
from ringcomm.core.progress import POLL_SLICE_S

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def patient_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane waits until the call's deadline (module docstring)."""
    monkeypatch.setattr(progress, "POLL_SLICE_S", 600.0)


def _note_exchange(pg: rc.ProcessGroup) -> tuple[threading.Event, list[float]]:
    """Wrap the engine's exchange: the event is set once it handed a call over; the list
    gets how long each exchange took (seconds)."""
    engine = pg.core.progress
    handed_over = threading.Event()
    took: list[float] = []
    original = engine.exchange

    def exchange(*args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        got = original(*args, **kwargs)
        took.append(time.monotonic() - t0)
        if got is True:
            handed_over.set()
        return got

    engine.exchange = exchange  # type: ignore[method-assign]
    return handed_over, took


# -- interop: ranks on either path in the same call --------------------------------------
@pytest.mark.usefixtures("patient_lane")
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_lane_and_regular_path_interoperate(world_size: int, seed: int) -> None:
    with memory_world(world_size, seed=seed) as groups:
        results = run_ranks(groups, interop_calls, timeout_s=50)
    for rank, (failures, _, _) in enumerate(results):
        assert failures == [], f"rank {rank}: " + "\n".join(failures)
    assert all(r[1] == results[0][1] for r in results), "results differ between ranks"
    for rank, (_, _, counts) in enumerate(results):
        blocking = sum(1 for i in range(2 * len(CASES)) if is_blocking(i, rank))
        # Every blocking call tries the lane, and a patient lane never hands one over
        # (nothing here gives it a reason). Right after an async call the progress thread
        # may still hold the driver lock or count the call pending: then it is not taken.
        assert sum(counts.values()) == blocking and "handed over" not in counts, counts
        assert counts.get("done", 0) > blocking // 4, counts


# -- a message that arrived before the call ----------------------------------------------
def _early_message(bad: bool) -> tuple[list[tuple[str, bool]], dict[str, int]]:
    """Rank 1's message is in rank 0's unexpected queue before rank 0 calls; with ``bad``
    it is another call's (op max against sum). In a sub-group, so that a mismatch fails
    that group only."""
    with memory_world(2) as groups:
        counts = count_lane(groups[0])

        def body(pg: rc.ProcessGroup) -> tuple[str, bool]:
            sub = pg.new_group(range(pg.world_size))
            assert sub is not None
            x = np.full(2, pg.rank + 1, np.float32)
            before = x.copy()
            token = np.zeros(1, np.uint8)
            try:
                if pg.rank == 1:
                    work = sub.all_reduce(x, op="max" if bad else "sum", async_op=True)
                    sub.send(token, 0)  # after our all_reduce message: rank 0 takes it first
                    work.wait(timeout_s=10)
                else:
                    sub.recv(token, 1, timeout_s=10)  # drains rank 1's all_reduce message
                    assert pg.core.progress.unexpected_count == 1
                    sub.all_reduce(x, timeout_s=10)
            except rc.CollectiveMismatchError:
                return "mismatch", bool(np.array_equal(x, before))
            return "ok", bool(np.array_equal(x, before))

        results = run_ranks(groups, body)
    return results, dict(counts)


def test_lane_takes_a_message_that_arrived_first() -> None:
    results, counts = _early_message(bad=False)
    assert results == [("ok", False)] * 2
    assert counts == {"done": 1}


def test_lane_hands_a_mismatch_found_in_the_queue_over() -> None:
    results, counts = _early_message(bad=True)
    assert results == [("mismatch", True)] * 2  # both raise, neither buffer written
    assert counts == {"handed over": 1}


# -- a mismatch met in the lane ----------------------------------------------------------
@pytest.mark.usefixtures("patient_lane")
@pytest.mark.parametrize("world_size", [2, 3])  # direct, star (rank 0 replies in its lane)
def test_lane_mismatch_after_warmup_fails_fast(world_size: int) -> None:
    """Warm a shape up (its plan cached), then the last rank calls with another op: every
    rank's lane hands the call over and the regular path raises the mismatch well before
    the deadline; the world group goes on, on the lane."""
    with memory_world(world_size) as groups:
        counts = [count_lane(pg) for pg in groups]

        def body(pg: rc.ProcessGroup) -> tuple[str, float, bool, list[float], dict[str, int]]:
            sub = pg.new_group(range(pg.world_size))
            assert sub is not None
            for _ in range(5):
                sub.all_reduce(np.ones(3, np.int32))
            warm = dict(counts[pg.rank])
            x = np.full(3, 7, np.int32)
            t0 = time.monotonic()
            outcome = "ok"
            try:
                sub.all_reduce(x, op="max" if pg.rank == pg.world_size - 1 else "sum", timeout_s=30)
            except rc.CollectiveMismatchError as exc:
                outcome = f"mismatch: {exc}"
            elapsed = time.monotonic() - t0
            pg.barrier(timeout_s=10)
            y = pg.all_reduce(np.ones(2), timeout_s=10)
            return outcome, elapsed, bool((x == 7).all()), y.tolist(), warm

        results = run_ranks(groups, body, timeout_s=50)
    for rank, (outcome, elapsed, untouched, y, warm) in enumerate(results):
        assert outcome.startswith("mismatch"), f"rank {rank}: {outcome}"
        assert elapsed < 10, f"rank {rank}: took {elapsed:.1f} s"
        if outcome.endswith("output buffer is untouched"):
            assert untouched, f"rank {rank}: buffer modified"
        assert y == [float(world_size)] * 2
        assert warm == {"done": 5}, f"rank {rank}: {warm}"
        # Rank 0 (the star's root) and the odd rank out always meet the mismatch in their
        # lane. A rank between them may not: when the root has seen the odd call and told
        # everyone before that rank calls, the notice is waiting and its lane is not entered.
        handed = counts[rank].pop("handed over", 0)
        assert counts[rank] == {"done": 6}, f"rank {rank}: {counts[rank]}"
        assert handed == 1 or (handed == 0 and 0 < rank < world_size - 1), f"rank {rank}"


# -- the engine is needed elsewhere: not taken, or handed over ---------------------------
@pytest.mark.usefixtures("patient_lane")
def test_lane_hands_over_when_another_thread_submits() -> None:
    """Rank 0 waits in the lane (its message to rank 1 held back: the cue) while another
    of its threads submits an isend: the lane hands the all_reduce over because of the
    submission (the patient lane has no other reason), rank 1 calls once it has, and both
    calls and the isend complete."""
    with memory_world(2) as groups:
        hub = hub_of(groups[0])
        hub.hold(0, 1)
        counts = [count_lane(pg) for pg in groups]
        handed_over, _ = _note_exchange(groups[0])
        engine = groups[0].core.progress
        submitted_then: list[bool] = []
        give_back = engine._give_back

        def give_back_noted(*args: Any, **kwargs: Any) -> bool:
            submitted_then.append(bool(engine._submitted))
            return give_back(*args, **kwargs)

        engine._give_back = give_back_noted  # type: ignore[method-assign]

        def body(pg: rc.ProcessGroup) -> tuple[list[float], list[int]]:
            x = np.full(2, pg.rank + 1.0)
            got = np.zeros(3, np.int64)
            if pg.rank == 0:
                works: list[rc.Work] = []

                def submit() -> None:
                    # Rank 0's lane sent its message (held): it is in the lane, holding
                    # the driver lock, so the isend is queued for the driver.
                    if hub.wait_held(0, 1, timeout_s=10):
                        works.append(pg.isend(np.arange(3, dtype=np.int64), 1, tag=5))

                sender = threading.Thread(target=submit)
                sender.start()
                pg.all_reduce(x, timeout_s=10)
                sender.join(10)
                assert works, "rank 0's lane message never came"
                works[0].wait(timeout_s=10)
            else:
                assert handed_over.wait(10), "rank 0's lane did not hand over"
                hub.release(0, 1)
                pg.all_reduce(x, timeout_s=10)
                pg.recv(got, 0, tag=5, timeout_s=10)
            return x.tolist(), got.tolist()

        results = run_ranks(groups, body)
    assert results == [([3.0, 3.0], [0, 0, 0]), ([3.0, 3.0], [0, 1, 2])]
    assert submitted_then == [True]  # gave up because of the submission
    assert counts == [{"handed over": 1}, {"done": 1}]


@pytest.mark.usefixtures("patient_lane")
def test_lane_not_taken_with_async_work_in_flight() -> None:
    """An irecv in flight (asynchronous work): rank 0's lane is not taken, its call runs
    the regular way and meets rank 1's lane; the irecv completes after."""
    with memory_world(2) as groups:
        counts = [count_lane(pg) for pg in groups]

        def body(pg: rc.ProcessGroup) -> tuple[list[float], list[int]]:
            x = np.full(2, pg.rank + 1.0)
            got = np.zeros(2, np.int64)
            if pg.rank == 0:
                work = pg.irecv(got, 1, tag=3)
                pg.all_reduce(x, timeout_s=10)
                work.wait(timeout_s=10)
            else:
                pg.all_reduce(x, timeout_s=10)
                pg.send(np.array([4, 5], np.int64), 0, tag=3, timeout_s=10)
            return x.tolist(), got.tolist()

        results = run_ranks(groups, body)
    assert results == [([3.0, 3.0], [4, 5]), ([3.0, 3.0], [0, 0])]
    assert counts == [{"not taken": 1}, {"done": 1}]


# -- a long wait: the real slice ---------------------------------------------------------
def test_lane_hands_a_long_wait_over() -> None:
    """Rank 1 calls only once rank 0's lane has given up waiting for it (one poll slice):
    rank 0's call goes on the regular way, rank 1's lane finds rank 0's message there."""
    with memory_world(2) as groups:
        counts = [count_lane(pg) for pg in groups]
        handed_over, took = _note_exchange(groups[0])

        def body(pg: rc.ProcessGroup) -> list[float]:
            if pg.rank == 1:
                assert handed_over.wait(10), "rank 0's lane did not hand over"
            x = np.full(2, pg.rank + 1.0)
            pg.all_reduce(x, timeout_s=10)
            return x.tolist()

        results = run_ranks(groups, body)
    assert results == [[3.0, 3.0]] * 2
    assert counts == [{"handed over": 1}, {"done": 1}]
    assert took[0] >= POLL_SLICE_S  # it waited its slice, no less


def test_lane_hands_over_when_its_peer_dies() -> None:
    """Rank 1 is killed while rank 0 waits in the lane for it: the lane hands over (at
    the end of its slice) and the regular path raises PeerFailedError naming rank 1."""
    with memory_world(2) as groups:
        hub = hub_of(groups[0])
        hub.hold(0, 1)
        counts = count_lane(groups[0])

        def body(pg: rc.ProcessGroup) -> str:
            if pg.rank == 1:
                assert hub.wait_held(0, 1, timeout_s=10)  # rank 0 is in the lane
                hub.kill(1)
                return ""
            with pytest.raises(rc.PeerFailedError) as info:
                pg.all_reduce(np.ones(2), timeout_s=10)
            assert info.value.peer == 1, info.value
            return str(info.value)

        results = run_ranks(groups, body)
    assert "1" in results[0]
    assert counts == {"handed over": 1}
