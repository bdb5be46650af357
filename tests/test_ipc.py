"""Device windows (``algo="ipc"``, ringcomm.collectives.ipc) on the host stand-in.

What a GPU would run, on the CPU: the stand-in device (ringcomm.device.ipc) keeps its
windows and interprocess events in memfd segments that the peers open through ``/proc``,
at a non-zero offset of their allocation, and runs every copy and reduction on its *lazy*
stream, so a missing event wait, record or offset shows as wrong bytes (the first tests
prove that, by taking each away). Then:

* the handle cache (opened once per handle, views at offsets, references, a failed
  owner's handle dropped) and the stand-in's events, in one process;
* the collectives matrix through ``ipc`` at world sizes 1-8: every dtype and op, counts
  0, 1, n-1, n+1 and large, windows of 512 bytes (so calls take many rounds), one-shot and
  two-shot all_reduce, the small-message host path, every collective and the uneven ones,
  results exact and identical bytes on every rank where they must be;
* the choice of algorithm (default for device arrays, ``algo=``, ``RINGCOMM_ALGO``);
* failures ending on every rank within the usual bounds: a rank killed in a copy or at a
  sync, a mismatch, a deadline (on the host and on the device), and a shrink after a
  death, whose survivors open each other's new windows.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_same_results
from test_collectives import DTYPES, OPS, _compare, _digest, _op_for, run_case
from test_staging import DeviceProxy
from test_uneven import run_case as run_uneven_case

import ringcomm as rc
import ringcomm.collectives.ipc as ipc_mod
from ringcomm.device.ipc import (
    STANDIN_GUARD_BYTES,
    HandleCache,
    StandinIpcDevice,
    ipc_device_for,
)
from ringcomm.device.standin import StandinArray, standin_array

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ipc_fail.py"
#: Windows of 512 bytes per buffer in the spawned jobs: calls of a few KiB take many rounds.
WINDOW = "512"


@pytest.fixture
def tiny_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGCOMM_IPC_WINDOW_BYTES", WINDOW)
    monkeypatch.setenv("RINGCOMM_IPC_SMALL_BYTES", "0")


def _ipc(pg: rc.ProcessGroup) -> Any:
    calls = pg.core.workspace_calls
    return None if calls is None else calls.extensions.get("ipc")


# --------------------------------------------------------------------------- in one process
def test_handle_cache_opens_once_per_handle_and_counts_references() -> None:
    opened: list[bytes] = []
    closed: list[Any] = []
    cache = HandleCache(lambda h, size: (opened.append(h), np.arange(size))[1], closed.append)
    a = cache.open(b"A", 100)
    assert cache.open(b"A", 100) is a and cache.open(b"A", 50) is a  # offsets: views of one
    assert opened == [b"A"] and cache.references(b"A") == 3 and cache.hits == 2
    with pytest.raises(ValueError, match="100 bytes"):
        cache.open(b"A", 200)
    b = cache.open(b"B", 10)
    cache.release(b"A")
    cache.release(b"A")
    assert b"A" in cache and not closed
    cache.release(b"A")
    assert b"A" not in cache and len(closed) == 1 and closed[0] is a
    assert cache.open(b"A", 100) is not a and opened == [b"A", b"B", b"A"]  # opened again
    cache.drop(b"B")  # its owner failed: closed whatever the references
    assert b"B" not in cache and closed[-1] is b
    cache.release(b"B")  # (nothing left to release)
    assert (cache.opens, cache.closes) == (3, 2)


def test_standin_windows_sit_at_an_offset_and_peers_map_them() -> None:
    """A window is exported as handle + offset; a mapping through the handle sees the
    window at that offset (the guard bytes before it, not the data, at offset 0)."""
    dev = StandinIpcDevice()
    win = dev.alloc_window(1000)
    assert win.offset == STANDIN_GUARD_BYTES and win.size == STANDIN_GUARD_BYTES + 1000
    win.buf.host[:] = np.arange(1000) % 251
    view = dev.map_window(win.handle, win.offset, 1000, win.size)
    again = dev.map_window(win.handle, win.offset + 10, 20, win.size)
    assert isinstance(view, StandinArray)
    assert np.array_equal(view.host, np.arange(1000) % 251)
    assert np.array_equal(again.host, np.arange(10, 30))
    assert dev.cache.opens == 1 and dev.cache.references(win.handle) == 2
    wrong = dev.map_window(win.handle, 0, 16, win.size)  # the offset forgotten
    assert not np.array_equal(wrong.host, np.arange(16))
    for _ in range(3):
        dev.unmap_window(win.handle)
    assert dev.cache.closes == 1
    dev.free_window(win)


def test_standin_event_wait_orders_two_streams() -> None:
    """Stream B copies A's window after waiting for A's event: it sees A's copy in (A's
    stream runs meanwhile, as another process's GPU work would); without the wait, the
    stale bytes."""
    a, b = (
        StandinIpcDevice(),
        StandinIpcDevice(),
    )
    sa, sb = a.caller_stream(), b.caller_stream()
    win = a.alloc_window(64)
    src = standin_array(np.arange(64, dtype=np.uint8))
    ev, handle = a.new_event()
    peer_ev = b.open_event(handle)
    peer_win = b.map_window(win.handle, win.offset, 64, win.size)
    for waits in (False, True):
        win.buf.host[:] = 0
        dst = standin_array(np.zeros(64, np.uint8))
        a.copy(sa, win.buf, src)
        a.record(sa, ev)
        if waits:
            b.wait(sb, peer_ev, watch=sa.run_one)  # A's stream steps while B spins
        b.copy(sb, dst, peer_win)
        b.complete(sb, watch=lambda: None)
        assert np.array_equal(dst.host, np.arange(64)) is waits, waits
        a.complete(sa, watch=lambda: None)
    assert peer_ev.completed == 2 and ev.recorded == 2


def test_a_stand_in_event_wait_gives_up_through_its_watch() -> None:
    """A peer's event recorded but never run (its process stalled): the wait spins and
    asks its watch, which gives up (the collectives' watch: deadline, dead peers)."""
    a = StandinIpcDevice()
    ev, handle = a.new_event()
    a.record(a.caller_stream(), ev)  # recorded, never run
    b = StandinIpcDevice()
    sb = b.caller_stream()
    stop = time.monotonic() + 0.2
    looks = []

    def watch() -> None:
        looks.append(1)
        if time.monotonic() > stop:
            raise TimeoutError("gave up")

    b.wait(sb, b.open_event(handle), watch)
    with pytest.raises(TimeoutError):
        b.complete(sb, watch)
    assert len(looks) > 3


# --------------------------------------------------------------------------- the stand-in catches
def job_mutations(pg: rc.ProcessGroup, mutation: str, flags: str) -> int:
    """all_reduce over windows with one piece of the protocol taken away: wrong results.

    Without its record a rank's copies into its window are ordered by nothing, so the
    result depends on when each process runs its (lazy) stream. "no record" fixes the
    order a GPU is free to choose: rank 0 runs its stream only once rank 1 has finished
    the same call (told through a file in ``flags``), so rank 1 reads windows rank 0 has
    not written yet. The intact protocol would wait there for rank 0's record: not run."""
    import ringcomm.device.ipc as dipc

    at = {"it": -1}
    if mutation == "no wait":
        dipc.StandinIpcDevice.wait = lambda self, stream, ev, watch: None  # type: ignore[method-assign]
    elif mutation == "no offset":
        mapped = dipc.StandinIpcDevice.map_window
        dipc.StandinIpcDevice.map_window = (  # type: ignore[method-assign]
            lambda self, h, off, nb, size: mapped(self, h, 0, nb, size)
        )
    elif mutation == "no record":
        dipc.StandinIpcDevice.record = lambda self, stream, ev: None  # type: ignore[method-assign]
        if pg.rank == 0:
            complete = dipc.StandinIpcDevice.complete

            def late(self: Any, stream: Any, watch: Any) -> None:
                if at["it"] >= 0:
                    done = Path(flags) / f"done.{at['it']}"
                    stop = time.monotonic() + 20
                    while not done.exists():  # bounded: rank 1 never waits for rank 0 here
                        assert time.monotonic() < stop, "rank 1 did not finish its call"
                        time.sleep(0.001)
                complete(self, stream, watch)

            dipc.StandinIpcDevice.complete = late  # type: ignore[method-assign]
    n, r = pg.world_size, pg.rank
    pg.all_reduce(standin_array(np.zeros(3001, np.float32)), timeout_s=20)  # windows set up
    wrong = 0
    for it in range(4):
        at["it"] = it
        count = 3001
        x = standin_array(np.arange(count, dtype=np.float32) + r + it)
        pg.all_reduce(x, timeout_s=20)
        if r == 1:
            (Path(flags) / f"done.{it}").touch()
        want = np.arange(count, dtype=np.float32) * n + n * (n - 1) / 2 + n * it
        wrong += not np.array_equal(x.get(), want)
    return wrong


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mutation", ["none", "no wait", "no offset", "no record"])
def test_the_stand_in_shows_a_missing_wait_as_wrong_bytes(
    mutation: str, tiny_windows: None, tmp_path: Path
) -> None:
    wrong = rc.spawn(job_mutations, 2, args=(mutation, str(tmp_path)), timeout_s=100)
    if mutation == "none":
        assert wrong == [0, 0]
    else:
        assert sum(wrong) > 0, f"{mutation}: every result right: the stand-in cannot see it"


# --------------------------------------------------------------------------- the matrix
LARGE = 2000  # elements: many rounds of 512-byte windows


def ipc_cases(n: int) -> list[tuple[Any, ...]]:
    """(collective, algo, dtype, op, count, root, variant): run_case's cases, through ipc."""
    counts = sorted({0, 1, max(n - 1, 0), n + 1, LARGE})
    cases: list[tuple[Any, ...]] = []
    i = 0
    for dt in DTYPES:  # every dtype x every op
        for op in OPS:
            if op == "avg" and dt.kind == "b":
                continue
            cases.append(("all_reduce", "ipc", dt.name, op, n + 1 if i % 3 else LARGE, None, i))
            i += 1
    for count in counts:
        for dt in DTYPES:
            cases.append(("all_reduce", "ipc", dt.name, _op_for(dt, i), count, None, i))
            i += 1
    for dt in DTYPES:
        for op in OPS:
            if not (op == "avg" and dt.kind == "b"):
                cases.append(("reduce_scatter", "ipc", dt.name, op, (1, 7, 300)[i % 3], None, i))
                i += 1
    for row in (0, n - 1 if n > 1 else 2, 300):
        for dt in DTYPES[i % 3 :: 3]:
            cases.append(("reduce_scatter", "ipc", dt.name, _op_for(dt, i), row, None, i))
            i += 1
    for count in counts:
        for dt in DTYPES[i % 4 :: 4]:
            cases.append(("all_gather", "ipc", dt.name, None, count, None, i))
            i += 1
    for root in range(n):
        dt = DTYPES[i % len(DTYPES)]
        cases.append(("broadcast", "ipc", dt.name, None, (13, LARGE, 0)[i % 3], root, i))
        i += 1
        dt = DTYPES[i % len(DTYPES)]
        cases.append(
            ("reduce", "ipc", dt.name, _op_for(dt, i), (0, 1, n + 1, LARGE)[i % 4], root, i)
        )
        i += 1
        dt = DTYPES[i % len(DTYPES)]
        cases.append(("gather", "ipc", dt.name, None, (1, 300, 0)[i % 3], root, i))
        i += 1
        for variant in ("x", "out"):
            dt = DTYPES[i % len(DTYPES)]
            cases.append(("scatter", "ipc", dt.name, None, (3, 125, 0)[i % 3], root, variant))
            i += 1
    for dt, op in zip(DTYPES, OPS * 3, strict=False):  # reduce: every dtype
        if not (op == "avg" and dt.kind == "b"):
            cases.append(("reduce", "ipc", dt.name, op, 9, i % n, i))
            i += 1
    for row in (0, 1, 5, 125):
        dt = DTYPES[i % len(DTYPES)]
        cases.append(("all_to_all", "ipc", dt.name, None, row, None, i))
        i += 1
    cases.append(("barrier", "ipc", "uint8", None, 0, None, i))
    return cases


class IpcProxy(DeviceProxy):
    """DeviceProxy asking for ``algo="ipc"`` on every collective (scatter needs it asked;
    the others take it by default for device arrays, which this checks too)."""

    def scatter(self, x: Any, out: Any = None, **kw: Any) -> Any:
        dout = self._dev(out)
        if x is None and out is None:  # run_case's "none" variant: not for ipc
            raise AssertionError("ipc scatter needs an array on every rank")
        return self._back(self.pg.scatter(self._dev(x), out=dout, algo="ipc", **kw), dout, out)

    # the uneven collectives, for test_uneven.run_case
    def _v(self, res: Any, out: Any) -> Any:
        if isinstance(res, rc.Work):  # test_uneven's "async" variant waits on it itself
            return _Done(self._back(res.wait(), self._dout, out))
        return self._back(res, self._dout, out)

    def all_gather_v(self, x: Any, sizes: Any = None, out: Any = None, **kw: Any) -> Any:
        self._dout = self._dev(out)
        return self._v(self.pg.all_gather_v(self._dev(x), sizes, out=self._dout, **kw), out)

    def reduce_scatter_v(self, x: Any, splits: Any, out: Any = None, **kw: Any) -> Any:
        self._dout = self._dev(out)
        return self._v(self.pg.reduce_scatter_v(self._dev(x), splits, out=self._dout, **kw), out)

    def all_to_all_v(self, x: Any, ins: Any, outs: Any, out: Any = None, **kw: Any) -> Any:
        self._dout = self._dev(out)
        return self._v(self.pg.all_to_all_v(self._dev(x), ins, outs, out=self._dout, **kw), out)


class _Done:
    """A finished asynchronous call's result, converted to NumPy."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value


def _uneven_cases(n: int) -> list[tuple[Any, ...]]:
    from test_uneven import PATTERNS, ROWS, VARIANTS

    out = []
    i = 0
    for coll, variants in VARIANTS.items():
        for pattern in PATTERNS:
            dt = DTYPES[(i * 5 + n) % len(DTYPES)]
            op = _op_for(dt, i) if coll == "reduce_scatter_v" else None
            out.append((coll, dt.name, op, pattern, ROWS[i % 3], variants[i % len(variants)]))
            i += 1
    return out


def job_ipc_matrix(pg: rc.ProcessGroup, proxy_cls: Any = None) -> tuple[list[str], dict[int, Any]]:
    """The matrix on ``proxy_cls(pg)`` (default :class:`IpcProxy`: stand-in arrays;
    tests/test_gpu.py runs it on CuPy arrays)."""
    proxy = (proxy_cls or IpcProxy)(pg)
    failures: list[str] = []
    digests: dict[int, Any] = {}
    n = pg.world_size
    for cid, case in enumerate(ipc_cases(n)):
        ext = _ipc(pg)
        # one-shot and two-shot in turn; the small-message host path every fifth case
        ipc_mod.ONE_SHOT_MAX_BYTES = -1 if cid % 2 else 1 << 20
        if ext is not None:
            ext.small_bytes = 1 << 20 if cid % 5 == 0 else 0
        try:
            res, exp, identical = run_case(proxy, cid, case)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 (the group is failed now: report, stop)
            failures.append(f"rank {pg.rank}: {case}: {type(exc).__name__}: {exc}")
            break
        problem = _compare(case, res, exp)
        if problem:
            failures.append(f"rank {pg.rank}: {problem}")
        if n > 1 and case[0] != "barrier" and pg.core.last_algo != "ipc":
            failures.append(f"rank {pg.rank}: {case}: ran {pg.core.last_algo}, not ipc")
        if identical:
            digests[cid] = _digest(res)
    base = 100_000
    for k, case in enumerate(_uneven_cases(n)):
        cid = base + k
        try:
            res, exp, identical = run_uneven_case(proxy, cid, case)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            failures.append(f"rank {pg.rank}: {case}: {type(exc).__name__}: {exc}")
            break
        if not (
            isinstance(res, np.ndarray) and res.shape == exp.shape and np.array_equal(res, exp)
        ):
            failures.append(f"rank {pg.rank}: {case}: differs from the oracle")
        if n > 1 and pg.core.last_algo != "ipc":
            failures.append(f"rank {pg.rank}: {case}: ran {pg.core.last_algo}, not ipc")
        if identical:
            digests[cid] = _digest(res)
    ext = _ipc(pg)
    if n > 1 and not (ext is not None and ext.window_calls and ext.small_calls):
        failures.append(f"rank {pg.rank}: windows and host path not both used: {ext}")
    if n > 1 and ext.buffer_bytes != int(WINDOW):  # so LARGE calls took many rounds
        failures.append(f"rank {pg.rank}: windows of {ext.buffer_bytes} bytes")
    return failures, digests


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
def test_ipc_matrix(world_size: int, tiny_windows: None) -> None:
    """Every collective through device windows on stand-in arrays, against the oracle,
    with identical bytes on every rank where they must be."""
    assert_same_results(rc.spawn(job_ipc_matrix, world_size, timeout_s=280))


def job_extremes(pg: rc.ProcessGroup, to_device: Any = standin_array) -> list[str]:
    """int64/uint64 (and 32/8-bit) extremes through every op, AVG's truncation included,
    on device arrays: through the small-message host path, the device windows, and the
    staged ring."""
    from ringcomm.ops import reference_reduce

    n, r = pg.world_size, pg.rank
    bad = []
    for path in ("small", "windows", "ring"):
        for dtn in ("int64", "uint64", "int32", "uint32", "int8"):
            info = np.iinfo(dtn)
            base = np.array([info.min, info.min + 1, info.max, info.max - 1, -1 if info.min else 1,
                             0, 1, 2**53 + 1 if info.bits == 64 else 3], dtn)  # fmt: skip
            for op in OPS:
                inputs = [np.roll(base, k).astype(dtn) for k in range(n)]
                want = reference_reduce(op, inputs)
                x = to_device(inputs[r])
                ext = _ipc(pg)
                if ext is not None:
                    ext.small_bytes = 1 << 20 if path == "small" else 0
                pg.all_reduce(x, op, algo="ring" if path == "ring" else None)
                got = x.get()
                if not np.array_equal(got, want):
                    bad.append(f"rank {r}: {path} {dtn} {op}: {got.tolist()} != {want.tolist()}")
        issue = np.array([-2672802113933191955], np.int64)  # the sum issue 31 saw
        x = to_device(issue if r == 0 else np.zeros(1, np.int64))
        pg.all_reduce(x, "sum")
        pg.all_reduce(x, "avg", algo="ring" if path == "ring" else None)  # n * issue / n
        if int(x.get()[0]) != int(issue[0]):
            bad.append(f"rank {r}: {path} int64 avg {int(x.get()[0])}")
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_integer_extremes_every_op(world_size: int) -> None:
    assert rc.spawn(job_extremes, world_size, timeout_s=100) == [[]] * world_size


# --------------------------------------------------------------------------- choosing it
def job_choice(pg: rc.ProcessGroup) -> dict[str, Any]:
    got: dict[str, Any] = {}
    d = standin_array(np.ones(100, np.float32))
    pg.all_reduce(d)
    got["default"] = pg.core.last_algo
    pg.all_reduce(d, algo="shm")
    got["shm"] = pg.core.last_algo
    pg.all_reduce(d, algo="ring")
    got["ring"] = pg.core.last_algo
    pg.all_reduce(np.ones(4), algo="shm")
    got["host"] = pg.core.last_algo
    try:
        pg.all_reduce(np.ones(4), algo="ipc")
    except ValueError as exc:
        got["host ipc"] = str(exc)
    pg.barrier(algo="ipc")
    got["barrier"] = pg.core.last_algo
    pg.scatter(standin_array(np.ones((pg.world_size, 3))), src=0)
    got["scatter"] = pg.core.last_algo
    if pg.rank == 1:  # (checked at the call, before anything is sent: rank 0 stays out)
        try:
            pg.scatter(None, src=0, algo="ipc")
        except ValueError as exc:
            got["scatter none"] = str(exc)
    ipc_rows = standin_array(np.arange(pg.world_size * 3.0).reshape(-1, 3))
    row = pg.scatter(ipc_rows, src=1, out=standin_array(np.zeros(3)), algo="ipc")
    got["scatter ipc"] = (pg.core.last_algo, row.get().tolist())
    w = pg.all_reduce(d, async_op=True)
    w.wait(timeout_s=30)
    got["async"] = (pg.core.last_algo, float(d.get()[0]))
    return got


@pytest.mark.timeout(60)
def test_device_arrays_take_ipc_unless_asked_otherwise() -> None:
    got = rc.spawn(job_choice, 2, timeout_s=50)
    assert got[0]["default"] == got[0]["shm"] == "ipc"
    assert got[0]["ring"] == "ring" and got[0]["host"] == "shm" and got[0]["barrier"] == "shm"
    assert "needs device arrays" in got[0]["host ipc"]
    assert got[0]["scatter"] == "shm"  # (host copies: a rank may pass x=None)
    assert "needs a device array on every rank" in got[1]["scatter none"]
    assert got[1]["scatter ipc"] == ("ipc", [3.0, 4.0, 5.0])
    assert got[0]["async"][0] == "ipc" and got[1]["async"][1] == 2.0**4  # 1 x 2^4 calls


def job_env_algo(pg: rc.ProcessGroup) -> list[str]:
    d = standin_array(np.ones(10, np.float32))
    pg.all_reduce(d)
    a = pg.core.last_algo
    pg.all_reduce(np.ones(3))
    return [a, pg.core.last_algo]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("env", "want"), [("ipc", ["ipc", "shm"]), ("rd", ["rd", "rd"])])
def test_ringcomm_algo(env: str, want: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGCOMM_ALGO", env)
    assert rc.spawn(job_env_algo, 2, timeout_s=50) == [want, want]


def job_small_path(pg: rc.ProcessGroup) -> dict[str, Any]:
    """Small calls: one pinned buffer, reused; results left on the stream, read by get()."""
    dev = ipc_device_for(standin_array(np.zeros(1)))
    seen = set()
    for i in range(20):
        x = standin_array(np.full(100, pg.rank + i, np.int32))
        pg.all_reduce(x)
        seen.add(id(dev._pinned))
        if not np.all(x.get() == sum(range(pg.world_size)) + pg.world_size * i):
            return {"wrong": i}
    ext = _ipc(pg)
    return {"buffers": len(seen), "small": ext.small_calls, "windows": ext.window_calls}


@pytest.mark.timeout(60)
def test_small_calls_go_through_one_reused_pinned_buffer() -> None:
    got = rc.spawn(job_small_path, 3, timeout_s=50)
    assert got == [{"buffers": 1, "small": 20, "windows": 0}] * 3


# --------------------------------------------------------------------------- failures
def job_mismatch(pg: rc.ProcessGroup, kind: str) -> str:
    r = pg.rank
    d = standin_array(np.ones(3000, np.float32))
    pg.all_reduce(d)  # windows set up
    if kind == "dtype":
        x = standin_array(np.ones(3000, np.float32 if r else np.int32))
    else:  # a host array against device arrays: shm against ipc
        x = standin_array(np.ones(3000, np.float32)) if r else np.ones(3000, np.float32)
    try:
        pg.all_reduce(x, timeout_s=20)
    except rc.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["dtype", "memory"])
def test_a_mismatch_raises_on_every_rank(kind: str, tiny_windows: None) -> None:
    texts = rc.spawn(job_mismatch, 3, args=(kind,), timeout_s=50)
    for t in texts:
        assert "all_reduce" in t and ("int32" in t if kind == "dtype" else "algo=ipc" in t), t


def job_deadline(pg: rc.ProcessGroup, where: str) -> str:
    """Rank 0 alone: at a host sync (rank 1 not in the call) or on the device (rank 1's
    stream stalls before it records): the timeout says whom and where."""
    import ringcomm.device.ipc as dipc

    sub = pg.new_group(range(pg.world_size))  # (fails; the world group carries on)
    assert sub is not None
    d = standin_array(np.ones(3000, np.float32))
    sub.all_reduce(d)
    token = np.zeros(1, np.int64)
    text = ""
    if pg.rank == 1 and where == "device":
        real = dipc.StandinIpcDevice.copy

        def slow(self: Any, stream: Any, dst: Any, src: Any) -> None:
            stream.enqueue(lambda: time.sleep(3.0))
            real(self, stream, dst, src)

        dipc.StandinIpcDevice.copy = slow  # type: ignore[method-assign]
    if pg.rank == 0 or where == "device":
        t0 = time.monotonic()
        try:
            sub.all_reduce(d, timeout_s=1.0)
        except rc.CommTimeoutError as exc:
            text = f"{time.monotonic() - t0:.2f} {exc}"
        except rc.RingcommError as exc:
            text = f"other {type(exc).__name__}: {exc}"
    if pg.rank == 0:  # (and stay until rank 1 is done with its own call)
        pg.send(token, 1, tag=5)
        pg.recv(token, 1, tag=6)
    else:
        pg.recv(token, 0, tag=5)
        pg.send(token, 0, tag=6)
    return text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["host", "device"])
def test_a_deadline_says_whom_and_where(where: str, tiny_windows: None) -> None:
    text = rc.spawn(job_deadline, 2, args=(where,), timeout_s=50)[0]
    took, _, msg = text.partition(" ")
    assert float(took) < 3.0, text
    if where == "host":
        assert "waiting for rank 1 at sync 1 of round 1/" in msg, text
    else:
        assert "timed out after 1 s waiting for the device" in msg, text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_fail(world: int, victim: int, mode: str, tmp_path: Path) -> list[int | None]:
    port = _free_port()
    procs = []
    env0 = dict(os.environ, RINGCOMM_IPC_WINDOW_BYTES=WINDOW, RINGCOMM_IPC_SMALL_BYTES="0")
    try:
        for r in range(world):
            env = dict(env0, RINGCOMM_RANK=str(r), RINGCOMM_WORLD_SIZE=str(world),
                       RINGCOMM_MASTER_ADDR="127.0.0.1", RINGCOMM_MASTER_PORT=str(port))  # fmt: skip
            procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPT), str(victim), mode, str(tmp_path)], env=env))  # fmt: skip
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(60))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "victim", "mode"),
                         [(3, 1, "copy"), (4, 0, "copy"), (3, 2, "sync"), (2, 1, "copy")])  # fmt: skip
def test_a_rank_killed_mid_call(world: int, victim: int, mode: str, tmp_path: Path) -> None:
    """SIGKILL inside a copy on the victim's stream, or at a host sync between rounds:
    every survivor raises PeerFailedError naming it within 2 s; every process ends."""
    codes = _run_fail(world, victim, mode, tmp_path)
    assert codes[victim] == -9, codes
    t_kill = json.loads((tmp_path / f"kill.{victim}").read_text())
    for r in range(world):
        if r == victim:
            continue
        rep = json.loads((tmp_path / f"peer.{r}").read_text())
        assert rep["error"] == "PeerFailedError", rep
        assert f"peer rank {victim}" in rep["text"], rep
        assert rep["t_error"] - t_kill < 2.0, (
            f"rank {r} noticed after {rep['t_error'] - t_kill:.2f} s"
        )
        assert codes[r] == 1, codes


@pytest.mark.timeout(120)
def test_survivors_shrink_and_reopen_each_others_windows(tmp_path: Path) -> None:
    """After a death and a shrink the survivors' new group exchanges new windows: the dead
    rank's handle was dropped from every cache, the old group's released, and calls on
    the new group are right."""
    world, victim = 4, 2
    codes = _run_fail(world, victim, "shrink", tmp_path)
    assert codes[victim] == -9, codes
    for r in range(world):
        if r == victim:
            continue
        rep = json.loads((tmp_path / f"peer.{r}").read_text())
        assert codes[r] == 0, (codes, rep)
        assert rep["error"] == "PeerFailedError" and rep["ok"] is True, rep
        assert rep["dead_dropped"] is True, rep
        # 3 peers' windows opened in the old group, 2 in the new one; every old one closed
        assert rep["opens"] == 3 + 2 and rep["open_now"] == 2, rep
        assert rep["closes"] == 3, rep


# --------------------------------------------------------------------------- the bench
def _bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from ringcomm.cli import main

    code = main(["bench", *argv])
    return code, capsys.readouterr().out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                "all_to_all", "sendrecv"])  # fmt: skip
def test_bench_standin_rows_take_ipc_and_say_so(
    op: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--device standin``: rows ``ringcomm-standin`` through ``ipc`` (the algorithm a
    CuPy array takes), ``host-staged`` through staging; every row has ``algo``."""
    out_json = tmp_path / "rows.json"
    code, out = _bench([op, "-n", "2", "-b", "8", "-e", "256K", "-f", "16", "--iters", "2",
                        "--warmup", "1", "--check", "-q", "--device", "standin,host-staged,host",
                        "--json", str(out_json)], capsys)  # fmt: skip
    assert code == 0, out
    rows = [json.loads(line) for line in out_json.read_text().splitlines()]
    by_impl: dict[str, set[str]] = {}
    for row in rows:
        assert row["errors"] == 0, row
        by_impl.setdefault(row["impl"], set()).add(row["algo"])
    assert set(by_impl) == {"ringcomm-standin", "ringcomm-staged", "ringcomm"}
    if op == "sendrecv":
        assert by_impl["ringcomm-standin"] == {"p2p"}
    else:
        assert by_impl["ringcomm-standin"] == {"ipc"}, by_impl
        assert "ipc" not in by_impl["ringcomm-staged"] and by_impl["ringcomm"] == {"shm"}


@pytest.mark.timeout(120)
@pytest.mark.needs_torch
def test_bench_compare_gloo_rows_say_their_algo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "rows.json"
    code, out = _bench(["all_reduce", "-n", "2", "-b", "8", "-e", "4K", "-f", "8", "--iters",
                        "2", "--warmup", "1", "--check", "-q", "--device", "standin",
                        "--compare", "gloo", "--json", str(out_json)], capsys)  # fmt: skip
    assert code == 0, out
    rows = [json.loads(line) for line in out_json.read_text().splitlines()]
    assert {(r["impl"], r["algo"]) for r in rows} == {("ringcomm-standin", "ipc"), ("gloo", "gloo")}


@pytest.mark.timeout(60)
@pytest.mark.needs_torch
def test_bench_compare_nccl_without_gpus_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs for NCCL")
    from ringcomm.cli import main

    code = main(["bench", "all_reduce", "-n", "2", "--compare", "nccl"])
    err = capsys.readouterr().err
    assert code == 2 and "nccl" in err.lower(), err


# --------------------------------------------------------------------------- across hosts
@pytest.mark.timeout(300)
@pytest.mark.parametrize("hosts", ["0,0,1,1", "0,0,0,1,1"])
def test_device_arrays_across_pretend_hosts_use_windows_inside_each(hosts: str) -> None:
    """Stand-in arrays on a group spanning (pretend) hosts: hierarchical, with the device
    windows inside each host and host staging only across (tests/scripts/ipc_hier.py)."""
    repo = Path(__file__).resolve().parents[1]
    script = repo / "tests" / "scripts" / "ipc_hier.py"
    n = len(hosts.split(","))
    out = subprocess.run(
        [sys.executable, "-m", "ringcomm", "run", "-n", str(n), str(script), hosts],
        check=False, capture_output=True, text=True, timeout=280, cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "BAD" not in out.stdout
    algos = [line for line in out.stdout.splitlines() if "local algos:" in line]
    assert len(algos) == n and all("ipc" in line for line in algos), algos


def job_uneven_first(pg: rc.ProcessGroup) -> list[str]:
    """The group's first device call is an all_to_all_v whose splits differ per rank: the
    window setup compares only what every rank shares."""
    n, r = pg.world_size, pg.rank
    ins = [(r + j) % 3 + 1 for j in range(n)]  # rank r sends (r + j) % 3 + 1 rows to j
    outs = [(j + r) % 3 + 1 for j in range(n)]
    x = standin_array(np.repeat(np.arange(n) * 10 + r, ins).astype(np.int32))
    got = pg.all_to_all_v(x, ins, outs).get()
    want = np.concatenate([np.full(outs[j], r * 10 + j, np.int32) for j in range(n)])
    return [] if pg.core.last_algo == "ipc" and np.array_equal(got, want) else [f"{r}: {got}"]


@pytest.mark.timeout(60)
def test_an_uneven_call_first_sets_the_windows_up() -> None:
    assert rc.spawn(job_uneven_first, 3, timeout_s=50) == [[]] * 3
