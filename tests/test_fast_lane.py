"""The fast lane of small blocking all_reduce (``Progress.exchange``, ``AllReduceDirect.run_now``).

A blocking all_reduce below the inline size (direct algorithm) runs on the calling thread
without inboxes or rounds while the engine is otherwise idle; on anything unusual it hands
the call over to the regular op. These jobs check that the two paths interoperate (ranks on
different paths in the same call give the same bits), that every way of leaving the lane
ends as the regular path would (mismatches, aborts, messages that arrived early, another
thread submitting meanwhile, asynchronous work in flight), and count which way the lane went
(``Progress.exchange`` returns the payloads, False: not taken, True: handed over).
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm import progress
from ringcomm.ops import reference_reduce


def _count_lane(pg: rc.ProcessGroup) -> collections.Counter[str]:
    """Wrap the engine's exchange: counts 'done', 'not taken' and 'handed over'."""
    engine = pg.core.progress
    counts: collections.Counter[str] = collections.Counter()
    original = engine.exchange

    def exchange(*args: Any, **kwargs: Any) -> Any:
        got = original(*args, **kwargs)
        counts["done" if type(got) is list else "handed over" if got else "not taken"] += 1
        return got

    engine.exchange = exchange  # type: ignore[method-assign]
    return counts


def _input(i: int, rank: int, dtype: np.dtype[Any], shape: tuple[int, ...], op: str) -> np.ndarray:
    rng = np.random.default_rng([i, rank])
    size = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "b":
        a = rng.random(size) < 0.5
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    elif op == "prod":
        a = rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), size)
    else:
        a = rng.integers(-8, 9, size).astype(np.float64)
    return a.astype(dtype).reshape(shape)


CASES = [
    (dtype, op, shape)
    for dtype in ("float32", "float16", "float64", "int64", "int8", "uint16", "bool")
    for op in ("sum", "avg", "max", "min", "prod")
    for shape in ((2,), (3, 2), ())
    if not (dtype == "bool" and op == "avg")
] + [  # from the inline size (4 KiB) up: header and payload frames
    ("float32", "sum", (1024,)),
    ("float64", "max", (2000,)),
    ("int32", "prod", (64, 64)),
]


def job_interop(pg: rc.ProcessGroup) -> tuple[list[str], list[str], dict[str, int]]:
    """Each call: some ranks blocking (the lane), others async (the regular op)."""
    counts = _count_lane(pg)
    failures, digests = [], []
    n, me = pg.world_size, pg.rank
    for i, (name, op, shape) in enumerate(CASES * 2):  # twice: the plans are cached then
        dtype = np.dtype(name)
        x = _input(i, me, dtype, shape, op)
        if (i + me) % 3:
            out = pg.all_reduce(x, op=op)
        else:
            out = pg.all_reduce(x, op=op, async_op=True).wait()
        want = reference_reduce(op, [_input(i, r, dtype, shape, op) for r in range(n)])
        if out is not x or not np.array_equal(x, want):
            failures.append(f"{name} {op} {shape}: {x.tolist()} != {want.tolist()}")
        digests.append(hashlib.sha256(x.tobytes()).hexdigest())
    return failures, digests, dict(counts)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_lane_and_regular_path_interoperate(world_size: int) -> None:
    results = rc.spawn(job_interop, world_size, timeout_s=110)
    for rank, (failures, _, _) in enumerate(results):
        assert failures == [], f"rank {rank}: " + "\n".join(failures)
    assert all(r[1] == results[0][1] for r in results), "results differ between ranks"
    for rank, (_, _, counts) in enumerate(results):
        blocking = sum(1 for i in range(2 * len(CASES)) if (i + rank) % 3)
        # Every blocking call tries the lane; right after an async call the progress
        # thread may still hold the driver lock (then it is not taken), else it is done.
        assert sum(counts.values()) == blocking and counts.get("done", 0) > blocking // 4, counts


def job_early_message(pg: rc.ProcessGroup, bad: bool) -> tuple[str, bool, dict[str, int]]:
    """Rank 1's message is in rank 0's unexpected queue before rank 0 calls; with ``bad``
    it is another call's (op max against sum). In a sub-group: a mismatch fails that one
    only, and the world group's barrier at the end lets every message out before the
    ranks close (a failed group closes without lingering)."""
    sub = pg.new_group(range(pg.world_size))
    assert sub is not None
    counts = _count_lane(pg)
    x = np.full(2, pg.rank + 1, np.float32)
    before = x.copy()
    token = np.zeros(1, np.uint8)
    outcome = "ok"
    try:
        if pg.rank == 1:
            work = sub.all_reduce(x, op="max" if bad else "sum", async_op=True)
            sub.send(token, 0)  # after our all_reduce message: rank 0 receives it first
            work.wait(timeout_s=30)
        else:
            sub.recv(token, 1)  # drains rank 1's all_reduce message into the queue
            assert pg.core.progress.unexpected_count == 1
            sub.all_reduce(x, timeout_s=30)
    except rc.CollectiveMismatchError:
        outcome = "mismatch"
    result = outcome, bool(np.array_equal(x, before)), dict(counts)
    pg.barrier(timeout_s=30)
    return result


@pytest.mark.timeout(60)
def test_lane_takes_a_message_that_arrived_first() -> None:
    results = rc.spawn(job_early_message, 2, args=(False,), timeout_s=50)
    assert [r[:2] for r in results] == [("ok", False)] * 2
    assert results[0][2] == {"done": 1}  # (counted before the closing barrier)


@pytest.mark.timeout(60)
def test_lane_hands_a_mismatch_found_in_the_queue_over() -> None:
    results = rc.spawn(job_early_message, 2, args=(True,), timeout_s=50)
    assert [r[:2] for r in results] == [("mismatch", True)] * 2
    assert results[0][2] == {"handed over": 1}


def job_mismatch_after_warmup(pg: rc.ProcessGroup) -> tuple[list[str], float, bool]:
    """Warm a shape up (its plan cached), then the last rank calls with another op."""
    counts = _count_lane(pg)
    sub = pg.new_group(range(pg.world_size))
    assert sub is not None
    for _ in range(5):
        sub.all_reduce(np.ones(3, np.int32))
    x = np.full(3, 7, np.int32)
    t0 = time.monotonic()
    outcome = "ok"
    try:
        sub.all_reduce(x, op="max" if pg.rank == pg.world_size - 1 else "sum", timeout_s=30)
    except rc.CollectiveMismatchError as exc:
        outcome = f"mismatch: {exc}"
    elapsed = time.monotonic() - t0
    pg.barrier()
    y = pg.all_reduce(np.ones(2))  # the world group goes on (on the lane)
    return [outcome, str(dict(counts)), str(y.tolist())], elapsed, bool((x == 7).all())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_lane_mismatch_after_warmup_fails_fast(world_size: int) -> None:
    results = rc.spawn(job_mismatch_after_warmup, world_size, timeout_s=110)
    for rank, ((outcome, counts, y), elapsed, untouched) in enumerate(results):
        assert outcome.startswith("mismatch"), f"rank {rank}: {outcome}"
        assert elapsed < 10, f"rank {rank}: took {elapsed:.1f} s"
        if outcome.endswith("output buffer is untouched"):
            assert untouched, f"rank {rank}: buffer modified"
        assert y == str([float(world_size)] * 2)
        assert "'handed over': 1" in counts, counts


def job_submission_meanwhile(
    pg: rc.ProcessGroup,
) -> tuple[list[float], list[int], dict[str, int], list[bool]]:
    """Rank 0 waits in the lane for a late rank 1 while another of its threads submits an
    isend: the lane hands the all_reduce over at once, both complete. (The poll slice, the
    longest the lane waits, is stretched so that only the submission can end it.)"""
    counts = _count_lane(pg)
    pg.barrier()
    x = np.full(2, pg.rank + 1.0)
    got = np.zeros(3, np.int64)
    if pg.rank == 0:
        progress.POLL_SLICE_S = 5.0
        engine = pg.core.progress
        in_lane = threading.Event()
        submitted_then: list[bool] = []
        exchange, give_back = engine.exchange, engine._give_back

        def exchange_announced(*args: Any) -> Any:
            in_lane.set()
            return exchange(*args)

        def give_back_noted(*args: Any) -> Any:
            submitted_then.append(bool(engine._submitted))
            return give_back(*args)

        engine.exchange = exchange_announced  # type: ignore[method-assign]
        engine._give_back = give_back_noted  # type: ignore[method-assign]
        data = np.arange(3, dtype=np.int64)
        works: list[rc.Work] = []

        def submit() -> None:
            in_lane.wait(10)
            time.sleep(0.05)
            works.append(pg.isend(data, 1, tag=5))

        sender = threading.Thread(target=submit)
        sender.start()
        pg.all_reduce(x, timeout_s=30)
        sender.join()
        works[0].wait(timeout_s=30)
    else:
        submitted_then = []
        time.sleep(0.5)
        pg.all_reduce(x, timeout_s=30)
        pg.recv(got, 0, tag=5)
    return x.tolist(), got.tolist(), dict(counts), submitted_then


@pytest.mark.timeout(60)
def test_lane_hands_over_when_another_thread_submits() -> None:
    results = rc.spawn(job_submission_meanwhile, 2, timeout_s=50)
    assert results[0][0] == results[1][0] == [3.0, 3.0]
    assert results[1][1] == [0, 1, 2]
    assert results[0][3] == [True], results[0]  # gave up because of the submission


def job_async_in_flight(pg: rc.ProcessGroup) -> tuple[list[float], list[int], dict[str, int]]:
    """An irecv in flight (asynchronous work): the lane is not taken, the call still runs."""
    counts = _count_lane(pg)
    x = np.full(2, pg.rank + 1.0)
    got = np.zeros(2, np.int64)
    if pg.rank == 0:
        work = pg.irecv(got, 1, tag=3)
        pg.all_reduce(x, timeout_s=30)
        work.wait(timeout_s=30)
    else:
        pg.all_reduce(x, timeout_s=30)
        pg.send(np.array([4, 5], np.int64), 0, tag=3)
    return x.tolist(), got.tolist(), dict(counts)


@pytest.mark.timeout(60)
def test_lane_not_taken_with_async_work_in_flight() -> None:
    results = rc.spawn(job_async_in_flight, 2, timeout_s=50)
    assert results[0][0] == results[1][0] == [3.0, 3.0]
    assert results[0][1] == [4, 5]
    assert results[0][2] == {"not taken": 1} and results[1][2] == {"done": 1}


def job_late_peer(pg: rc.ProcessGroup) -> tuple[list[float], dict[str, int]]:
    """A peer later than one poll slice: the lane hands the call over; it completes."""
    counts = _count_lane(pg)
    pg.barrier()
    if pg.rank == 1:
        time.sleep(0.3)
    x = np.full(2, pg.rank + 1.0)
    pg.all_reduce(x, timeout_s=30)
    return x.tolist(), dict(counts)


@pytest.mark.timeout(60)
def test_lane_hands_a_long_wait_over() -> None:
    results = rc.spawn(job_late_peer, 2, timeout_s=50)
    assert results[0] == ([3.0, 3.0], {"handed over": 1})
    assert results[1] == ([3.0, 3.0], {"done": 1})
