"""rc.spawn and the process supervisor under it (ringcomm.launch.spawn).

The supervisor tests (``_run_ranks``) need no process group, so they pin the process
machinery down on its own; the ``spawn`` tests run real groups. Every test checks that no
process it started is left behind (see ``no_leftovers``).
"""

from __future__ import annotations

import functools
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import leakcheck

from ringcomm.errors import RankFailedError
from ringcomm.launch import spawn
from ringcomm.launch.spawn import _run_ranks

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch: pytest.MonkeyPatch):
    """Tag every process the test starts (through the environment); none may outlive it."""
    multiprocessing.resource_tracker.ensure_running()  # started untagged, lives with pytest
    tag = uuid.uuid4().hex
    monkeypatch.setenv(leakcheck.TAG_VAR, tag)
    yield tag
    left = leakcheck.wait_gone(tag, 5.0, exclude=(os.getpid(),))
    assert not left, f"processes left behind: {left}"


# --- entries for the supervisor (module level: the children import them) ---------------


def entry_info(rank: int, world_size: int) -> tuple[int, int, int]:
    return rank, world_size, os.getpid()


def entry_raise_on(bad: int, rank: int, world_size: int) -> int:
    if rank == bad:
        raise ValueError(f"boom from rank {rank}")
    time.sleep(60)
    return rank


def entry_exit_on(bad: int, code: int, rank: int, world_size: int) -> int:
    if rank == bad:
        os._exit(code)
    time.sleep(60)
    return rank


def entry_sigkill_on(bad: int, rank: int, world_size: int) -> int:
    if rank == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return rank


def entry_sleep_unless(fast: int, rank: int, world_size: int) -> int:
    if rank != fast:
        time.sleep(60)
    return rank


def entry_ignore_sigterm(rank: int, world_size: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 0:
        time.sleep(0.5)
        raise RuntimeError("rank 0 fails")
    time.sleep(60)


def entry_unpicklable_result(rank: int, world_size: int) -> object:
    return lambda: rank


def _explode() -> None:
    raise RuntimeError("refuses to unpickle")


class UnpicklesBadly:
    def __reduce__(self):
        return (_explode, ())


def entry_result_that_fails_to_load(rank: int, world_size: int) -> object:
    return UnpicklesBadly()


def entry_all_raise(rank: int, world_size: int) -> None:
    raise KeyError(f"rank{rank}")


# --- supervisor ----------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_run_ranks_returns_in_rank_order(world_size: int) -> None:
    out = _run_ranks(entry_info, world_size)
    assert [(r, w) for r, w, _ in out] == [(r, world_size) for r in range(world_size)]
    assert len({pid for *_, pid in out} | {os.getpid()}) == world_size + 1


@pytest.mark.timeout(60)
def test_run_ranks_exception_names_rank_with_remote_traceback() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        _run_ranks(functools.partial(entry_raise_on, 1), 3)
    err = info.value
    assert time.monotonic() - t0 < 30  # the sleeping ranks were stopped, not waited for
    assert list(err.failures) == [1]  # stopped ranks are not failures
    assert err.rank == 1
    assert err.exitcodes == {1: 1}
    text = str(err)
    assert "rank 1" in text
    assert "ValueError: boom from rank 1" in text
    assert "Traceback" in text and "entry_raise_on" in text


@pytest.mark.timeout(60)
def test_run_ranks_exit_code() -> None:
    with pytest.raises(RankFailedError) as info:
        _run_ranks(functools.partial(entry_exit_on, 0, 3), 2)
    assert list(info.value.failures) == [0]
    assert info.value.exitcodes == {0: 3}
    assert "exit code 3" in str(info.value)


@pytest.mark.timeout(60)
def test_run_ranks_killed_by_signal() -> None:
    with pytest.raises(RankFailedError) as info:
        _run_ranks(functools.partial(entry_sigkill_on, 1), 2)
    assert list(info.value.failures) == [1]
    assert "SIGKILL" in str(info.value)


@pytest.mark.timeout(60)
def test_run_ranks_exit_zero_without_result_is_a_failure() -> None:
    with pytest.raises(RankFailedError) as info:
        _run_ranks(functools.partial(entry_exit_on, 1, 0), 2)
    assert list(info.value.failures) == [1]
    assert "without returning a result" in str(info.value)


@pytest.mark.timeout(60)
def test_run_ranks_timeout_names_running_ranks_with_stacks() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        _run_ranks(functools.partial(entry_sleep_unless, 1), 3, timeout_s=4.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 20
    text = str(info.value)
    assert "timed out after 4 s; ranks still running: [0, 2]" in text
    assert sorted(info.value.failures) == [0, 2]  # rank 1 returned in time
    assert "entry_sleep_unless" in text  # the hung ranks' stacks


@pytest.mark.timeout(60)
def test_run_ranks_kills_ranks_that_ignore_sigterm() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        _run_ranks(entry_ignore_sigterm, 2, grace_s=1.0)
    assert list(info.value.failures) == [0]
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(60)
def test_run_ranks_unpicklable_result() -> None:
    with pytest.raises(RankFailedError) as info:
        _run_ranks(entry_unpicklable_result, 1)
    assert "could not send its return value back" in str(info.value)


@pytest.mark.timeout(60)
def test_run_ranks_result_that_does_not_unpickle() -> None:
    with pytest.raises(RankFailedError) as info:
        _run_ranks(entry_result_that_fails_to_load, 2)
    assert "could not be unpickled" in str(info.value)
    assert "refuses to unpickle" in str(info.value)


@pytest.mark.timeout(60)
def test_run_ranks_several_failures_all_listed_when_all_fail() -> None:
    # Every rank fails at once: the first is reported, the others may or may not have
    # failed before being stopped; whatever is listed must be a real failure.
    with pytest.raises(RankFailedError) as info:
        _run_ranks(entry_all_raise, 3)
    for rank, text in info.value.failures.items():
        assert f"KeyError: 'rank{rank}'" in text


@pytest.mark.timeout(60)
def test_parent_sigkill_leaves_no_orphans(no_leftovers: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    parent = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "spawn_parent.py"), "3"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        ready = set()
        assert parent.stdout is not None
        while len(ready) < 3:
            line = parent.stdout.readline()
            assert line, "parent exited early"
            ready.add(line.strip())
        assert len(leakcheck.processes_with_tag(no_leftovers, exclude=(os.getpid(),))) >= 4
        parent.kill()
        parent.wait()
        left = leakcheck.wait_gone(no_leftovers, 5.0, exclude=(os.getpid(),))
        assert not left, f"orphans after the parent was SIGKILLed: {left}"
    finally:
        parent.kill()
        parent.wait()


# --- argument checks -------------------------------------------------------------------


def module_level_fn(pg: object) -> None:
    return None


@pytest.mark.timeout(30)
def test_spawn_rejects_lambda_and_nested_functions() -> None:
    def nested(pg: object) -> None:
        return None

    with pytest.raises(TypeError, match="module level"):
        spawn(lambda pg: None, 2)
    with pytest.raises(TypeError, match="module level"):
        spawn(nested, 2)
    with pytest.raises(TypeError, match="args must be picklable"):
        spawn(module_level_fn, 2, args=(lambda: 0,))


@pytest.mark.timeout(30)
def test_spawn_rejects_bad_world_size_and_timeout() -> None:
    with pytest.raises(ValueError):
        spawn(module_level_fn, 0)
    with pytest.raises(TypeError):
        spawn(module_level_fn, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        spawn(module_level_fn, 2, timeout_s=0)


# --- spawn with a real process group ---------------------------------------------------


def fn_rank_info(pg, offset: int) -> tuple[int, int]:
    return pg.rank + offset, pg.world_size


def fn_raise_on(pg, bad: int) -> int:
    if pg.rank == bad:
        raise ValueError(f"boom from rank {pg.rank}")
    time.sleep(60)
    return pg.rank


def fn_exit_on(pg, bad: int, code: int) -> int:
    if pg.rank == bad:
        os._exit(code)
    time.sleep(60)
    return pg.rank


def fn_fail_while_peer_waits(pg) -> None:
    buf = np.zeros(8)
    if pg.rank == 1:
        raise RuntimeError("rank 1 gives up before sending")
    pg.recv(buf, 1)  # rank 0 waits for a message that never comes


def fn_hang(pg) -> None:
    time.sleep(60)


def fn_ring_pass(pg, n: int) -> list[float]:
    """Pass a token around the ring: rank r adds r at each hop; everyone ends with the sum."""
    right, left = (pg.rank + 1) % pg.world_size, (pg.rank - 1) % pg.world_size
    buf = np.zeros(n, dtype=np.float64)
    if pg.rank == 0:
        buf[:] = 1000.0
        pg.send(buf, right)
        pg.recv(buf, left)
    else:
        pg.recv(buf, left)
        buf += pg.rank
        pg.send(buf, right)
    return buf.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_spawn_returns_in_rank_order(world_size: int) -> None:
    out = spawn(fn_rank_info, world_size, args=(10,), timeout_s=60)
    assert out == [(10 + r, world_size) for r in range(world_size)]


@pytest.mark.timeout(120)
def test_spawn_rank_raises() -> None:
    with pytest.raises(RankFailedError) as info:
        spawn(fn_raise_on, 3, args=(2,), timeout_s=60)
    assert 2 in info.value.failures
    assert "ValueError: boom from rank 2" in str(info.value)
    assert "fn_raise_on" in str(info.value)


@pytest.mark.timeout(120)
def test_spawn_rank_exit_code() -> None:
    with pytest.raises(RankFailedError) as info:
        spawn(fn_exit_on, 2, args=(1, 3), timeout_s=60)
    assert info.value.exitcodes.get(1) == 3
    assert "exit code 3" in str(info.value)


@pytest.mark.timeout(120)
def test_spawn_failure_while_peer_waits() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(fn_fail_while_peer_waits, 2, timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert 1 in info.value.failures
    assert "rank 1 gives up before sending" in str(info.value)


@pytest.mark.timeout(120)
def test_spawn_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(fn_hang, 2, timeout_s=5)
    assert time.monotonic() - t0 < 30
    assert "timed out after 5 s; ranks still running: [0, 1]" in str(info.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_spawn_ring_pass(world_size: int) -> None:
    out = spawn(fn_ring_pass, world_size, args=(1000,), timeout_s=60)
    total = 1000.0 + sum(range(world_size))
    expected_at = [total] + [1000.0 + sum(range(1, r + 1)) for r in range(1, world_size)]
    assert [row[0] for row in out] == expected_at
    assert all(len(set(row)) == 1 for row in out)
