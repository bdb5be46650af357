"""The staged (device-array) path, exercised on the CPU through the host stand-in.

``ringcomm.device.standin.StandinArray`` poses as a CuPy array: every collective and p2p call on
it goes through ``ringcomm.device.staging`` (pinned-buffer pool, stream, events, stagers) exactly
as a CuPy array does, with NumPy copies for CUDA copies. The stand-in's stream runs queued
copies and kernels only when an event after them is waited for, so a send that does not
wait for its copy, or a result read before the stream finished, gives wrong bytes here.

* unit tests without sockets: the pool (reuse, waits, bound), the lazy stream and events,
  the stager's send queue;
* the whole collectives matrix of ``test_collectives`` (every collective and algorithm,
  every dtype, ops rotating, odd counts, every root; ``chunk_bytes = 64`` so messages are
  cut into many pieces) through a proxy that hands the group stand-in arrays, world sizes
  1-5, compared with the same NumPy oracle and byte-identical across ranks where it must be;
* p2p, a bounded pool that must recycle buffers while libzmq still holds some, pool reuse
  across calls, host and device ranks in one call, mixing refused at the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import assert_same_results
from test_collectives import _compare, _digest, matrix_cases, run_case

import ringcomm as rc
from ringcomm.device.staging import (
    MIN_SLOT_BYTES,
    DeviceStager,
    HostStandinBackend,
    StagingPool,
    backend_for,
    size_class,
)
from ringcomm.device.standin import StandinArray, standin_array
from ringcomm.device.xp import get_xp, is_device_array
from ringcomm.ops import ReduceOp, reference_reduce


# --------------------------------------------------------------------------- unit tests
class _Flag:
    def __init__(self, done: bool = False) -> None:
        self.done = done


def test_size_class() -> None:
    assert size_class(0) == MIN_SLOT_BYTES
    assert size_class(MIN_SLOT_BYTES) == MIN_SLOT_BYTES
    assert size_class(MIN_SLOT_BYTES + 1) == 2 * MIN_SLOT_BYTES
    assert size_class(3 << 20) == 4 << 20


def test_pool_reuses_buffers_and_honours_waits() -> None:
    pool = StagingPool(lambda n: np.empty(n, np.uint8), max_bytes=1 << 30)
    a = pool.acquire(1000, deadline=1e18)
    pool.release(a)
    b = pool.acquire(5000, deadline=1e18)
    assert b is a and pool.allocations == 1  # same size class: the same buffer again
    busy = _Flag()
    pool.release(b, busy)  # a copy or a send still reads it
    c = pool.acquire(10, deadline=1e18)
    assert c is not a and pool.allocations == 2 and pool.busy_count == 1
    busy.done = True
    pool.release(c)
    d = pool.acquire(10, deadline=1e18)
    e = pool.acquire(10, deadline=1e18)
    assert {id(d), id(e)} == {id(a), id(c)} and pool.allocations == 2


def test_pool_bound_waits_then_times_out() -> None:
    pool = StagingPool(lambda n: np.empty(n, np.uint8), max_bytes=MIN_SLOT_BYTES)
    a = pool.acquire(10, deadline=1e18)
    flag = _Flag()
    pool.release(a, flag)
    with pytest.raises(rc.CommTimeoutError, match="staging buffer"):
        pool.acquire(10, deadline=0.0)  # at the bound, and the only buffer stays busy
    assert pool.try_acquire(10) is None and pool.waited == 1
    flag.done = True
    assert pool.acquire(10, deadline=0.0) is a and pool.waited == 1
    # A free buffer of another size class is traded in rather than exceeding the bound.
    pool.release(a)
    big = pool.acquire(MIN_SLOT_BYTES * 2, deadline=0.0)
    assert big.capacity == 2 * MIN_SLOT_BYTES and pool.allocated_bytes == 2 * MIN_SLOT_BYTES


def test_lazy_stream_runs_only_when_waited_for() -> None:
    be = HostStandinBackend(max_staging_bytes=1 << 20)
    s = be.stream()
    dev = standin_array(np.arange(8, dtype=np.uint8))
    host = np.zeros(8, np.uint8)
    be.d2h(s, host, dev)
    ev = be.record(s)
    assert not host.any()  # enqueued, not run: reading now would race
    assert ev.done is False  # one look lets the stream take a step...
    assert ev.done is True and np.array_equal(host, np.arange(8))  # ...and it finished
    be.reduce_into(s, ReduceOp.SUM, dev, standin_array(np.ones(8, np.uint8)))
    ev2 = be.record(s)
    assert np.array_equal(dev.get(), np.arange(8))
    ev2.synchronize()
    assert np.array_equal(dev.get(), np.arange(8) + 1)


def test_stager_sends_after_copy_in_order_and_keeps_newest() -> None:
    be = HostStandinBackend(max_staging_bytes=1 << 30)
    st = DeviceStager(be, None, 1e18, "test")
    dev = standin_array(np.arange(300, dtype=np.int32))
    sent: list[tuple[int, np.ndarray]] = []

    def sender(i: int, payload: Any) -> None:
        sent.append((i, np.frombuffer(payload, np.int32).copy()))

    data = st.bytes_of(dev)
    for i in range(3):
        st.send(data[i * 400 : (i + 1) * 400], sender, i)
    st.pump(keep=1)
    assert [i for i, _ in sent] == [0, 1]  # FIFO; the newest stays queued
    st.forward(None, np.full(4, 7, np.int32).tobytes(), sender, 3)
    st.pump(0)
    assert [i for i, _ in sent] == [0, 1, 2, 3]
    for i in range(3):  # each piece sent only once its copy had run: the device bytes
        assert np.array_equal(sent[i][1], np.arange(i * 100, (i + 1) * 100))
    assert np.array_equal(sent[3][1], [7, 7, 7, 7])
    # Staging buffers all came back (no tracker held them): the next sends reuse them.
    allocations = be.pool.allocations
    for _ in range(3):
        st.send(data[:40], sender, 9)
    st.pump(0)
    assert be.pool.allocations == allocations


def test_stager_reduce_and_copy_in_run_on_the_stream() -> None:
    be = HostStandinBackend(max_staging_bytes=1 << 30)
    st = DeviceStager(be, None, 1e18, "test")
    acc = standin_array(np.array([1.0, 2.0, 3.0], np.float32))
    st.reduce_into(ReduceOp.MAX, acc, np.array([3.0, 1.0, 5.0], np.float32).tobytes())
    st.copy_in(acc[:1], np.array([-1.0], np.float32).tobytes())
    assert np.array_equal(acc.get(), [1.0, 2.0, 3.0])  # still queued
    st.sync()
    assert np.array_equal(acc.get(), [-1.0, 2.0, 5.0])


def test_standin_array_and_xp() -> None:
    a = standin_array(np.arange(12, dtype=np.int16).reshape(3, 4))
    assert is_device_array(a) and not is_device_array(np.zeros(1))
    assert a.shape == (3, 4) and a.nbytes == 24 and a.dtype == np.int16
    assert isinstance(a[1], StandinArray) and np.array_equal(a[1].get(), [4, 5, 6, 7])
    assert get_xp(a).empty((2,), np.int8).shape == (2,)
    assert isinstance(backend_for(a), HostStandinBackend)
    picked = a[[0, 2]]  # advanced indexing: a copy, as CuPy's (basic indexing: views)
    assert isinstance(picked, StandinArray) and not get_xp(a).may_share_memory(picked, a)
    assert np.array_equal(picked.get(), [[0, 1, 2, 3], [8, 9, 10, 11]])
    with pytest.raises(TypeError, match=r"numpy\.ndarray mixed with stand-in"):
        a[np.array([0, 2])]  # a host index array: copy it over first, as CuPy requires


# --------------------------------------------------------------------------- multi-process
class DeviceProxy:
    """A group whose calls take NumPy arrays but hand the real group stand-in copies, then
    copy results back (so ``test_collectives.run_case`` runs unchanged on the staged path).
    Checks that results are device arrays and in-place results are the arrays passed."""

    def __init__(self, pg: rc.ProcessGroup) -> None:
        self.pg = pg
        self.world_size, self.rank = pg.world_size, pg.rank

    @staticmethod
    def _dev(a: Any) -> Any:
        return None if a is None else standin_array(a)

    @staticmethod
    def _host(res: Any) -> Any:
        if res is None:
            return None
        assert isinstance(res, StandinArray), f"result is a {type(res).__name__}"
        return res.get()

    def _back(self, res: Any, dev_out: Any, out: Any) -> Any:
        if dev_out is not None:
            assert res is dev_out, "result is not the out passed"
        host = self._host(res)
        if out is not None:
            out[...] = host
            return out
        return host

    def all_reduce(self, x: np.ndarray, op: str, **kw: Any) -> np.ndarray:
        d = self._dev(x)
        assert self.pg.all_reduce(d, op, **kw) is d
        x[...] = d.get()
        return x

    def reduce_scatter(self, x: np.ndarray, out: Any = None, **kw: Any) -> Any:
        dx, dout = self._dev(x), self._dev(out)
        res = self.pg.reduce_scatter(dx, out=dout, **kw)
        x[...] = dx.get()  # the caller checks x was not modified
        return self._back(res, dout, out)

    def all_gather(self, x: np.ndarray, out: Any = None, **kw: Any) -> Any:
        dout = self._dev(out)
        return self._back(self.pg.all_gather(self._dev(x), out=dout, **kw), dout, out)

    def broadcast(self, x: np.ndarray, **kw: Any) -> np.ndarray:
        d = self._dev(x)
        assert self.pg.broadcast(d, **kw) is d
        x[...] = d.get()
        return x

    def reduce(self, x: np.ndarray, **kw: Any) -> np.ndarray:
        d = self._dev(x)
        assert self.pg.reduce(d, **kw) is d
        x[...] = d.get()
        return x

    def gather(self, x: np.ndarray, **kw: Any) -> Any:
        return self._host(self.pg.gather(self._dev(x), **kw))

    def scatter(self, x: Any, out: Any = None, **kw: Any) -> Any:
        dout = self._dev(out)
        res = self.pg.scatter(self._dev(x), out=dout, **kw)
        if x is None and out is None:  # shape and dtype came from the source: host
            return res
        return self._back(res, dout, out)

    def all_to_all(self, x: np.ndarray, **kw: Any) -> Any:
        return self._host(self.pg.all_to_all(self._dev(x), **kw))

    def barrier(self, **kw: Any) -> Any:
        return self.pg.barrier(**kw)


def job_device_matrix(pg: rc.ProcessGroup, chunk_bytes: int) -> tuple[list[str], dict[int, Any]]:
    pg.chunk_bytes = chunk_bytes
    proxy = DeviceProxy(pg)
    failures: list[str] = []
    digests: dict[int, Any] = {}
    for cid, case in enumerate(matrix_cases(pg.world_size)):
        if case[1] == "shm":  # the shared workspace takes host arrays only
            continue
        try:
            res, exp, identical = run_case(proxy, cid, case)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 (report and stop: the group is failed)
            failures.append(f"rank {pg.rank}: {case}: {type(exc).__name__}: {exc}")
            break
        problem = _compare(case, res, exp)
        if problem:
            failures.append(f"rank {pg.rank}: {problem}")
        if identical:
            digests[cid] = _digest(res)
    return failures, digests


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_device_matrix(world_size: int) -> None:
    """Every collective on stand-in device arrays: the oracle's results, identical bytes."""
    results = rc.spawn(job_device_matrix, world_size, args=(64,), timeout_s=280)
    assert_same_results(results)


def job_pipeline(pg: rc.ProcessGroup) -> list[str]:
    """Many pieces, all ops, a bounded pool, reuse across calls, p2p, host/device mixing."""
    n, r = pg.world_size, pg.rank
    failures: list[str] = []
    be = backend_for(standin_array(np.zeros(1)))

    def check(what: str, ok: bool) -> None:
        if not ok:
            failures.append(f"rank {r}: {what}")

    # Many pieces per message (odd count, 4 KiB pieces), every op, the ring and the chain.
    pg.chunk_bytes = 4096
    count = 100_003
    for op in ("sum", "avg", "max", "min", "prod"):

        def inp(k: int, op: str = op) -> np.ndarray:
            return np.random.default_rng([7, k]).integers(-3, 4, count).astype(np.float64)

        d = standin_array(inp(r))
        pg.all_reduce(d, op, algo="ring")
        exp = reference_reduce(op, [inp(k) for k in range(n)])
        check(f"ring all_reduce {op}", np.array_equal(d.get(), exp))
    src = np.arange(count, dtype=np.int32)
    b = standin_array(src if r == n - 1 else np.zeros(count, np.int32))
    pg.broadcast(b, src=n - 1, algo="chain")
    check("broadcast chain", np.array_equal(b.get(), np.arange(count, dtype=np.int32)))

    # Pool reuse: after a warm-up call, repeated calls allocate no more staging buffers.
    allocations = 0
    for i in range(6):
        x = standin_array(np.ones(50_000, np.float32))
        pg.all_reduce(x, algo="ring")
        pg.all_gather(standin_array(np.ones(7_000, np.float32)))
        pg.reduce_scatter(standin_array(np.ones((n, 7_000), np.float32)))
        if i == 0:
            allocations = be.pool.allocations
    grew = be.pool.allocations - allocations
    check(f"pool grew by {grew} buffers after the first round", grew <= 2)
    check("all_reduce result", np.array_equal(x.get(), np.full(50_000, n, np.float32)))

    # A tiny pool (two 256 KiB buffers for messages of 12 MB): buffers must be recycled
    # while libzmq still holds the earlier ones.
    saved = be.pool.max_bytes
    be.pool.max_bytes = 2 * size_class(256 * 1024)
    try:
        pg.chunk_bytes = 256 * 1024
        big = 3_000_001
        d = standin_array(np.arange(big, dtype=np.float32) % 97 * (r + 1))
        pg.all_reduce(d, algo="ring")
        exp = (np.arange(big, dtype=np.float32) % 97) * (n * (n + 1) // 2)
        check("bounded pool all_reduce", np.array_equal(d.get(), exp))
        check(
            f"bounded pool: {be.pool.allocated_bytes} bytes",
            be.pool.allocated_bytes <= 2 * size_class(256 * 1024),
        )
    finally:
        be.pool.max_bytes = saved

    # p2p: device to device, and device and host ends talking to each other.
    pg.chunk_bytes = 1000
    if n > 1:
        right, left = (r + 1) % n, (r - 1) % n
        y = standin_array(np.zeros(5001, np.int64))
        w = pg.irecv(y, left, tag=11)
        pg.send(standin_array(np.arange(5001, dtype=np.int64) * r), right, tag=11)
        w.wait(timeout_s=60)
        check("p2p device->device", np.array_equal(y.get(), np.arange(5001) * left))
        h = np.zeros(5001, np.int64)
        w = pg.irecv(h, left, tag=12)
        pg.send(standin_array(np.arange(5001, dtype=np.int64) + r), right, tag=12)
        w.wait(timeout_s=60)
        check("p2p device->host", np.array_equal(h, np.arange(5001) + left))
        # Host ranks and device ranks in one collective (same wire format).
        z = np.full(3001, r, np.float32)
        arr: Any = standin_array(z) if r % 2 else z
        pg.all_reduce(arr, algo="ring")
        got = arr.get() if r % 2 else arr
        check("mixed host/device all_reduce", np.array_equal(got, np.full(3001, n * (n - 1) / 2)))

    # Async calls on the same device buffer complete in order.
    a = standin_array(np.ones(20_000, np.int32))
    works = [pg.all_reduce(a, async_op=True, algo="ring") for _ in range(3)]
    for w in works:
        w.wait(timeout_s=60)
    check("chained async all_reduce", np.array_equal(a.get(), np.full(20_000, n**3, np.int32)))

    # Mixing host and device arrays in one call is refused at the call.
    try:
        pg.all_gather(standin_array(np.zeros(4)), out=np.zeros((n, 4)))
        failures.append(f"rank {r}: mixed x/out accepted")
    except TypeError as exc:
        check("mixed x/out message", "cannot be mixed" in str(exc))
    return failures


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_device_pipeline(world_size: int, no_child_processes: None) -> None:
    results = rc.spawn(job_pipeline, world_size, timeout_s=220)
    failures = [f for fails in results for f in fails]
    assert not failures, "\n".join(failures)
