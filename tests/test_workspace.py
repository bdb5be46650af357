"""The shared workspace of a group on one host (ringcomm.transport.workspace) and the
collectives over it (ringcomm.collectives.workspace).

The correctness matrix of every collective over it runs in test_collectives (``shm`` is
an all_reduce algorithm there and the default of the other collectives on one host, with
tiny rounds); the mismatch and timeout texts in test_collectives_errors; ranks that go down
while the others wait in a sync in test_exit_matrix (its peers' collectives take the
workspace). Here: the synchronisation itself (in one process, two views of one segment),
symmetric buffers (``pg.alloc``), a rank killed with SIGKILL mid-sync, what the segment
leaves behind, and the ordering of asynchronous calls with the engine's.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_same_results

import ringcomm as rc
from ringcomm.ops import reference_reduce
from ringcomm.transport import workspace as ws_mod

pytestmark = pytest.mark.skipif(not ws_mod.AVAILABLE, reason="the workspace needs x86-64 Linux")

SCRIPTS = Path(__file__).resolve().parent / "scripts"
DTYPES = [np.dtype(d) for d in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                                "int64", "uint64", "float16", "float32", "float64")]  # fmt: skip
OPS = ("sum", "avg", "max", "min", "prod")


# --------------------------------------------------------------------------- sync, in-process
def _pair(slot_bytes: int = 4096) -> tuple[ws_mod.Workspace, ws_mod.Workspace]:
    fd = ws_mod.create_segment(2, slot_bytes)
    other = ws_mod.open_segment(os.getpid(), fd, ws_mod.segment_bytes(2, slot_bytes))
    pids = [os.getpid(), os.getpid()]
    return ws_mod.Workspace(fd, 0, 2, pids, slot_bytes), ws_mod.Workspace(
        other, 1, 2, pids, slot_bytes
    )


def test_a_sync_completes_when_both_arrive_and_data_crosses() -> None:
    a, b = _pair()
    try:
        a.buffers[0][0][:4] = [1, 2, 3, 4]  # rank 0 writes its buffer, then arrives
        k = a.arrive()
        assert not a.complete(k) and a.late(k) == [1]
        assert b.arrive() == k and a.complete(k) and b.complete(k)
        b.wait(k, time.monotonic() + 5, lambda: None)
        assert b.buffers[0][0][:4].tolist() == [1, 2, 3, 4]  # rank 1 sees it
    finally:
        a.close()
        b.close()


def test_a_sleeping_waiter_is_woken_by_the_last_arrival() -> None:
    a, b = _pair()
    got: list[object] = []
    try:
        k = a.arrive()

        def waiter() -> None:
            try:
                a.wait(k, time.monotonic() + 20, lambda: None)
                got.append("done")
            except BaseException as exc:  # noqa: BLE001 (reported)
                got.append(exc)

        t = threading.Thread(target=waiter)
        t.start()
        # The waiter marks its line before it sleeps: arrive once it does.
        deadline = time.monotonic() + 10
        while not a.words[ws_mod.SLEEP] and time.monotonic() < deadline:
            threading.Event().wait(0.001)
        assert a.words[ws_mod.SLEEP] == k, "the waiter never slept"
        b.arrive()
        b.wait(k, time.monotonic() + 5, lambda: None)  # rings the bell
        t.join(10)
        assert got == ["done"]
        assert a.sleeps >= 1
    finally:
        a.close()
        b.close()


def test_a_wait_runs_idle_between_sleeps_and_times_out() -> None:
    a, b = _pair()
    calls = []
    try:
        k = a.arrive()
        t0 = time.monotonic()
        with pytest.raises(ws_mod.WorkspaceTimeout):
            a.wait(k, t0 + 0.2, lambda: calls.append(1))
        assert 0.2 <= time.monotonic() - t0 < 2.0
        assert calls, "idle never ran"

        def stop() -> None:
            raise RuntimeError("peer gone")

        with pytest.raises(RuntimeError, match="peer gone"):
            a.wait(k, time.monotonic() + 5, stop)
    finally:
        a.close()
        b.close()


# --------------------------------------------------------------------------- jobs
def job_basics(pg: rc.ProcessGroup) -> tuple[bool, list[str], list[str]]:
    """Whether the group has a workspace; what of it is in /proc/self/maps and /dev/shm."""
    x = np.ones(3)
    pg.all_reduce(x)
    with open("/proc/self/maps") as f:
        maps = sorted({line.split(maxsplit=5)[-1].strip() for line in f if "ringcomm" in line})
    return pg.core.workspace is not None, maps, sorted(os.listdir("/dev/shm"))


@pytest.mark.timeout(60)
def test_ranks_of_one_host_share_a_memfd_and_leave_nothing_behind() -> None:
    before = set(os.listdir("/dev/shm"))
    results = rc.spawn(job_basics, 3, timeout_s=50)
    for has, maps, shm in results:
        assert has
        assert any("memfd:ringcomm-workspace" in m for m in maps), maps
        assert set(shm) == before  # no name in /dev/shm
    assert set(os.listdir("/dev/shm")) == before


@pytest.mark.timeout(60)
def test_workspace_setting_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGCOMM_WORKSPACE", "0")
    assert [r[0] for r in rc.spawn(job_basics, 2, timeout_s=50)] == [False, False]


def job_symmetric(pg: rc.ProcessGroup, chunk: int) -> tuple[list[str], list[str], int]:
    """all_reduce of symmetric buffers (whole, slices, every dtype and op, mixed with
    plain arrays on some ranks) against NumPy; digests of the results (bit-identical)."""
    pg.chunk_bytes = chunk
    n, me = pg.world_size, pg.rank
    failures, digests = [], []
    # 3 x 25000: above the small all_reduce (64 KiB) for every dtype, read in place; a row
    # of int8/bool/float16 below it (copied in): both paths.
    bufs = {dt: pg.alloc((3, 25000), dt) for dt in DTYPES}
    for i, (dt, op) in enumerate(itertools.product(DTYPES, OPS)):
        if op == "avg" and dt.kind == "b":
            continue
        rng = np.random.default_rng
        inputs = [(rng(1000 * i + r).integers(0, 3, (3, 25000))).astype(dt) for r in range(n)]
        buf = bufs[dt]
        for view, mixed in ((buf, False), (buf[1], False), (buf[1:], False), (buf, True)):
            if not view.flags.c_contiguous:
                continue
            full = np.array(inputs[me])
            buf[...] = full
            x = view.copy() if (mixed and me % 2 == 0) else view
            sel = (slice(None),) if view is buf else ((1,) if view.ndim == 1 else (slice(1, None),))
            exp = reference_reduce(op, [inp[sel] for inp in inputs])
            res = pg.all_reduce(x, op, timeout_s=30)
            if res is not x or not np.array_equal(res, exp):
                failures.append(f"rank {me}: {dt} {op} shape {view.shape} mixed={mixed}: wrong")
            digests.append(res.tobytes().hex()[:64])
            if view is not buf and not mixed and not np.array_equal(buf[0], full[0]):
                failures.append(f"rank {me}: {dt} {op}: all_reduce of a slice wrote outside it")
    return failures, digests, pg.core.workspace_calls.in_place_calls


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world_size", "chunk"), [(2, 4 << 20), (3, 16384), (4, 4 << 20)])
def test_symmetric_buffers(world_size: int, chunk: int) -> None:
    results = rc.spawn(job_symmetric, world_size, args=(chunk,), timeout_s=180)
    for rank, (failures, _, in_place) in enumerate(results):
        assert failures == []
        # whole buffers and the 2-row slices of every dtype, unmixed or (odd ranks) mixed
        assert in_place >= 12 * 4, (rank, in_place)
    assert all(r[1] == results[0][1] for r in results), "ranks differ"


def job_alloc_plain(pg: rc.ProcessGroup) -> tuple[str, list[float]]:
    a = pg.alloc(4, np.float64)
    a[:] = pg.rank + 1
    pg.all_reduce(a)
    return type(a).__name__, a.tolist()


@pytest.mark.timeout(60)
def test_alloc_without_a_workspace_is_a_plain_array(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGCOMM_WORKSPACE", "0")
    assert rc.spawn(job_alloc_plain, 2, timeout_s=50) == [("ndarray", [3.0] * 4)] * 2
    assert rc.spawn(job_alloc_plain, 1, timeout_s=50) == [("ndarray", [1.0] * 4)]


def job_async_mixed(pg: rc.ProcessGroup) -> list[str]:
    """Async collectives on the workspace, then p2p the peer needs before it joins them:
    the caller is not held up (the workspace's worker runs them), and every result is right."""
    n, me = pg.world_size, pg.rank
    failures = []
    works = [pg.all_reduce(np.full(1000, me + i, np.int64), async_op=True) for i in range(5)]
    token = np.zeros(1, np.int64)
    if me == 0:
        pg.send(np.array([7], np.int64), 1, tag=3)
    elif me == 1:
        pg.recv(token, 0, tag=3)  # rank 0 got here after posting its async calls
    for i, w in enumerate(works):
        got = w.wait(timeout_s=30)
        if got.tolist() != [sum(r + i for r in range(n))] * 1000:
            failures.append(f"work {i} wrong")
    if me == 1 and token.tolist() != [7]:
        failures.append("p2p lost")
    # A message-path collective after async workspace ones runs after them, and back.
    a = pg.all_reduce(np.ones(3), async_op=True)
    b = pg.all_reduce(np.ones(3), algo="ring")
    c = pg.all_reduce(np.ones(3), async_op=True)
    if not (a.done() and b.tolist() == [n] * 3 and c.wait().tolist() == [n] * 3):
        failures.append("order between the workspace and the engine broken")
    return failures


@pytest.mark.timeout(60)
def test_async_calls_do_not_block_the_caller() -> None:
    assert rc.spawn(job_async_mixed, 3, timeout_s=50) == [[]] * 3


def job_large_rounds(pg: rc.ProcessGroup) -> list[str]:
    """Calls larger than a workspace buffer (several rounds, alternating buffers)."""
    n, me = pg.world_size, pg.rank
    count = (ws_mod.SLOT_BYTES // 4) * 2 + 12345
    x = np.full(count, me + 1, np.float32)
    pg.all_reduce(x)
    out = []
    if not (x == n * (n + 1) / 2).all():
        out.append("all_reduce")
    rows = np.full((n, count // n), me, np.int32)
    if not (pg.reduce_scatter(rows, op="max") == n - 1).all():
        out.append("reduce_scatter")
    g = pg.all_gather(np.full(count // 2, me, np.int32))
    if any((g[r] != r).any() for r in range(n)):
        out.append("all_gather")
    b = np.full(count, me, np.float32)
    pg.broadcast(b, src=n - 1)
    if not (b == n - 1).all():
        out.append("broadcast")
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 4])
def test_calls_larger_than_the_workspace(world_size: int) -> None:
    assert rc.spawn(job_large_rounds, world_size, timeout_s=180) == [[]] * world_size


# --------------------------------------------------------------------------- a rank killed
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("world", "victim", "nbytes"), [(3, 2, 8), (3, 0, 1 << 20), (4, 1, 8 << 20)]
)
def test_a_rank_killed_mid_sync(world: int, victim: int, nbytes: int, tmp_path: Path) -> None:
    """SIGKILL (no goodbye) while the others wait in a sync: each survivor raises
    PeerFailedError naming the victim, within the usual bound; every process ends."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RINGCOMM_RANK=str(r), RINGCOMM_WORLD_SIZE=str(world),
                   RINGCOMM_MASTER_ADDR="127.0.0.1", RINGCOMM_MASTER_PORT=str(port))  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, str(SCRIPTS / "workspace_kill.py"), str(victim), str(nbytes),
             str(tmp_path)], env=env))  # fmt: skip
    try:
        codes = [p.wait(60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes[victim] == -9
    t_kill = json.loads((tmp_path / f"kill.{victim}").read_text())
    for r in range(world):
        if r == victim:
            continue
        kind, text, t_err, had_workspace = json.loads((tmp_path / f"peer.{r}").read_text())
        assert had_workspace
        assert kind == "PeerFailedError", text
        assert f"peer rank {victim}" in text, text
        assert t_err - t_kill < 2.0, f"rank {r} noticed after {t_err - t_kill:.2f} s"
        assert codes[r] == 1


@pytest.mark.timeout(60)
def test_results_are_bit_identical_for_random_floats() -> None:
    assert_same_results(rc.spawn(job_random, 4, timeout_s=50))


def job_random(pg: rc.ProcessGroup) -> tuple[list[str], dict[int, str]]:
    """Random floats (inexact sums): every rank gets the same bits, small and large."""
    digests = {}
    for i, count in enumerate((5, 1000, 70_000)):
        x = np.random.default_rng(10 * i + pg.rank).standard_normal(count).astype(np.float32)
        pg.all_reduce(x)
        digests[i] = hashlib.sha256(x.tobytes()).hexdigest()
    return [], digests


def job_sync_timeout(pg: rc.ProcessGroup) -> str:
    """Rank 0 alone in an all_reduce of a sub-group whose workspace is set up: the
    timeout says whom it waited for, at which sync, and what that rank last did."""
    sub = pg.new_group(range(pg.world_size))
    assert sub is not None
    sub.barrier()  # the workspace is set up (every member's first collective)
    text = ""
    token = np.zeros(1, np.int64)
    if pg.rank == 0:
        try:
            sub.all_reduce(np.ones(4), timeout_s=0.5)
        except rc.CommTimeoutError as exc:
            text = str(exc)
        pg.send(token, 1, tag=5)
    else:
        pg.recv(token, 0, tag=5)  # until rank 0 gave up
    return text


@pytest.mark.timeout(60)
def test_a_timeout_says_whom_it_waited_for_and_where() -> None:
    text = rc.spawn(job_sync_timeout, 2, timeout_s=50)[0]
    assert "timed out after 0.5 s: waiting for rank 1 at sync 1 of round 1/1" in text, text
    assert "rank 1's last call here: barrier(" in text, text


def job_engine_then_workspace(pg: rc.ProcessGroup, reps: int) -> list[str]:
    """An async collective on the engine, then one on the workspace, ``reps`` times, while
    another thread drives the engine (a blocked receive): the engine then only queues the
    first one for its driver, and the workspace call must still wait for it."""
    peer = 1 - pg.rank
    token = np.zeros(1, np.int64)
    driver = threading.Thread(target=pg.recv, args=(token, peer), kwargs={"tag": 99})
    driver.start()
    overtaken = 0
    for i in range(reps):
        first = pg.all_reduce(np.full(50_000, i, np.int64), async_op=True, algo="rd")
        pg.all_reduce(np.full(1, i, np.int64), async_op=True).wait(timeout_s=30)
        overtaken += not first.done()  # (done() drives the engine: it can only hide one)
        first.wait(timeout_s=30)
    pg.barrier()
    pg.send(np.ones(1, np.int64), peer, tag=99)
    driver.join(30)
    return [f"{overtaken} of {reps} workspace calls overtook the engine's"] if overtaken else []


@pytest.mark.timeout(120)
def test_a_workspace_call_waits_for_the_engine_call_before_it() -> None:
    assert rc.spawn(job_engine_then_workspace, 2, args=(300,), timeout_s=100) == [[]] * 2
