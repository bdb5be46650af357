"""A rendezvous checks before it waits; groups are instances (DESIGN.md §8 Rendezvous).

* The store's host refuses a join that disagrees with its group (world size, rank range,
  a duplicate rank, the version) at once, and every rank of that group raises
  ``RendezvousError`` naming both values: by hand, under ``ringcomm run`` and torchrun.
* A wait longer than a few seconds says once which ranks are missing.
* A second and a third group in one process, one after another and side by side, under
  ``ringcomm run``, ``rc.spawn``, mpirun and torchrun (20 repetitions in one job each); the
  torch backend destroyed and formed again; the plain API under torchrun on ports from
  the OS, published in torchrun's store.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launcher_results import clean_env

import ringcomm as rc
from ringcomm.errors import CommTimeoutError, RendezvousError
from ringcomm.rendezvous import JoinRequest, Store, StoreServer, meeting
from ringcomm.rendezvous.join import Formations

SCRIPTS = Path(__file__).resolve().parent / "scripts"
MISMATCH = SCRIPTS / "join_mismatch.py"
GROUPS = SCRIPTS / "groups_again.py"
REPS = 20
_REFUSED = re.compile(r"REFUSED (\d+) ([\d.]+) (.*)")


def _req(rank: int, world: int, ns: str = "pg0", version: str = "v1", who: str = "") -> JoinRequest:
    return JoinRequest(ns, rank, world, version, who or f"pid {100 + rank}", f"n{rank}{who}")


# -- the checks, as pure bookkeeping --------------------------------------------------------
def test_world_size_disagreement_names_both_values_and_fails_the_namespace() -> None:
    f = Formations()
    assert f.join(_req(0, 2)) is None
    error = f.join(_req(1, 3))
    assert error is not None
    assert "rank 1 (pid 101) says world_size=3, the group was formed with world_size=2" in error
    assert "by rank 0" in error
    assert f.join(_req(1, 2)) == error  # the namespace stays failed, for every later join
    assert f.failure(["pg0/rank/0"]) == error and f.failure(["pg1/rank/0"]) is None
    assert f.join(_req(1, 3, ns="pg1")) is None  # another instance: its own values


def test_launcher_world_size_binds_every_group() -> None:
    f = Formations(2, "ringcomm run -n 2 started 2 ranks")
    error = f.join(_req(0, 3))
    assert error is not None and "world_size=3" in error and "world_size=2" in error
    assert "ringcomm run -n 2" in error


@pytest.mark.parametrize(
    ("second", "words"),
    [
        (
            _req(1, 2, who="pid 7"),
            "rank 1 joined twice: pid 7 says it is rank 1, and so did pid 101",
        ),
        (_req(2, 2), "rank 2 (pid 102) is out of range: the group has ranks 0..1"),
        (_req(0, 2, version="v2", who="x"), "rank 0 (x) runs v2, the group was formed by v1"),
    ],
)
def test_rank_and_version_disagreements(second: JoinRequest, words: str) -> None:
    f = Formations()
    assert f.join(_req(1, 2)) is None
    assert f.join(_req(1, 2)) is None  # the same join again (same nonce) is no duplicate
    error = f.join(second)
    assert error is not None and words in error, error


def test_a_gated_store_admits_a_namespace_once_its_host_opened_it() -> None:
    f = Formations(gated=True)
    assert not f.admits(_req(1, 2))
    host = JoinRequest("pg0", 0, 2, "v1", "host", "h", opens=True)
    assert f.admits(host) and f.admits(_req(1, 2))
    assert not f.admits(_req(1, 2, ns="pg1"))


# -- the store answers at once, also the ranks already waiting ------------------------------
@pytest.mark.timeout(30)
def test_a_refused_join_answers_the_ranks_waiting_in_the_store() -> None:
    with StoreServer() as server:
        a = Store("127.0.0.1", server.port, timeout_s=20.0, label="rank 0")
        b = Store("127.0.0.1", server.port, timeout_s=20.0, label="rank 1")
        try:
            assert a.join(_req(0, 2))
            view = a.prefixed("pg0")
            errors: list[BaseException] = []

            def waiter() -> None:
                try:
                    view.wait(["rank/1"], timeout_s=20.0)
                except BaseException as exc:  # noqa: BLE001 (checked below)
                    errors.append(exc)

            thread = threading.Thread(target=waiter)
            thread.start()
            while server.num_waiters == 0:  # parked on the server (bounded by the timeout)
                time.sleep(0.005)
            t0 = time.monotonic()
            with pytest.raises(RendezvousError, match="says world_size=3"):
                b.join(_req(1, 3))
            thread.join(10.0)
            assert time.monotonic() - t0 < 2.0
            assert len(errors) == 1 and isinstance(errors[0], RendezvousError)
            assert "rank 0: the group's rendezvous failed: rank 1" in str(errors[0])
            with pytest.raises(RendezvousError, match="world_size=3"):  # and later waits too
                b.prefixed("pg0").get("rank/0", timeout_s=5.0)
        finally:
            a.close()
            b.close()


def test_a_long_wait_says_once_which_ranks_are_missing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(meeting, "NOTICE_S", 0.3)
    port = _free_port()
    caplog.set_level(logging.WARNING, logger="ringcomm")
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"ranks 1, 2 never joined \(world_size=3"):
        rc.init_process_group(0, 3, master_port=port, timeout_s=1.5, env={})
    assert time.monotonic() - t0 < 5.0
    notes = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert len(notes) == 1, notes
    assert "rank 0: waited 0.3 s for ranks 1, 2 to join the group (world_size=3" in notes[0]


def test_a_store_not_up_is_waited_for_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(meeting, "NOTICE_S", 0.3)
    port = _free_port()  # nobody serves it: rank 0 never started
    caplog.set_level(logging.WARNING, logger="ringcomm")
    with pytest.raises(RendezvousError, match=r"could not reach the store at 127\.0\.0\.1"):
        rc.init_process_group(1, 2, master_port=port, timeout_s=1.5, env={})
    notes = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert len(notes) == 1, notes
    assert f"rank 1: waited 0.3 s for the store at 127.0.0.1:{port} to answer" in notes[0]


# -- every rank fails within seconds, naming both values ------------------------------------
def _refusals(out: str) -> dict[int, tuple[float, str]]:
    found = {}
    for line in out.splitlines():
        m = _REFUSED.search(line)
        if m:
            found[int(m.group(1))] = (float(m.group(2)), m.group(3))
    return found


def _assert_all_refused(out: str, ranks: int, *words: str) -> None:
    refused = _refusals(out)
    assert sorted(refused) == list(range(ranks)), out
    for rank, (seconds, message) in refused.items():
        assert seconds < 5.0, (rank, seconds, message)
        assert "RendezvousError" not in message  # (printed as the message alone)
        for w in words:
            assert re.search(w, message), (rank, w, message)


def _ringcomm_run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ringcomm", "run", *args],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "words"),
    [
        ("world", [r"world_size=3", r"WORLD_SIZE=2"]),
        ("world_port", [r"says world_size=3", r"formed with world_size=2", "ringcomm run -n 2"]),
    ],
)
def test_world_size_mismatch_under_ringcomm_run(mode: str, words: list[str]) -> None:
    proc = _ringcomm_run("-n", "2", str(MISMATCH), mode)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_all_refused(proc.stdout, 2, *words)


@pytest.mark.timeout(120)
def test_duplicate_rank_under_ringcomm_run() -> None:
    proc = _ringcomm_run("-n", "3", str(MISMATCH), "dup")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_all_refused(
        proc.stdout,
        3,
        r"rank 1 joined twice: pid \d+ on \S+ says it is rank 1, "
        r"and so did pid \d+",
    )


def _by_hand(envs: list[dict[str, str]], mode: str) -> str:
    procs = [
        subprocess.Popen(
            [sys.executable, str(MISMATCH), mode],
            env=clean_env(e),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for e in envs
    ]
    out = []
    try:
        for p in procs:
            out.append(p.communicate(timeout=60)[0])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return "\n".join(out)


@pytest.mark.timeout(120)
def test_world_size_mismatch_by_hand() -> None:
    # Two ranks started by hand with RINGCOMM_WORLD_SIZE 2 and 3 at one store (rank 0
    # serves it): both raise at once, naming both values.
    port = str(_free_port())
    envs = [
        {"RINGCOMM_RANK": "0", "RINGCOMM_WORLD_SIZE": "2", "RINGCOMM_MASTER_PORT": port},
        {"RINGCOMM_RANK": "1", "RINGCOMM_WORLD_SIZE": "3", "RINGCOMM_MASTER_PORT": port},
    ]
    out = _by_hand(envs, "none")
    refused = _refusals(out)
    assert sorted(refused) == [0, 1], out
    for seconds, message in refused.values():
        assert seconds < 5.0
        said = r"rank \d \(pid \d+ on \S+\) says world_size=\d, the group was formed with"
        assert re.search(said, message), message
        assert "world_size=3" in message and "world_size=2" in message


@pytest.mark.timeout(120)
def test_duplicate_rank_by_hand() -> None:
    port = str(_free_port())
    envs = [
        {"RINGCOMM_RANK": str(r), "RINGCOMM_WORLD_SIZE": "3", "RINGCOMM_MASTER_PORT": port}
        for r in (0, 1, 1)
    ]
    refused = _refusals(_by_hand(envs, "none"))
    assert sorted(refused) == [0, 1], refused  # (two report as rank 1)
    for seconds, message in refused.values():
        assert seconds < 5.0 and "rank 1 joined twice" in message, message


@pytest.mark.timeout(120)
def test_duplicate_rank_0_by_hand_is_named_too() -> None:
    # Both try to serve the store at one port: the second finds the first's and is refused
    # there as a second rank 0, and the first with it.
    port = str(_free_port())
    envs = [
        {"RINGCOMM_RANK": "0", "RINGCOMM_WORLD_SIZE": "2", "RINGCOMM_MASTER_PORT": port}
        for _ in range(2)
    ]
    out = _by_hand(envs, "none")
    lines = [ln for ln in out.splitlines() if ln.startswith("REFUSED 0 ")]
    assert len(lines) == 2, out
    for line in lines:
        assert "rank 0 joined twice" in line, line
        assert float(line.split()[2]) < 5.0


# -- groups as instances ---------------------------------------------------------------------
def _groups_done(out: str, world: int) -> None:
    done = dict(re.findall(r"GROUPS (\d+) (\d+)", out))
    assert done == {str(r): str(REPS) for r in range(world)}, out[-3000:]


@pytest.mark.timeout(150)
def test_second_and_third_group_under_ringcomm_run() -> None:
    proc = _ringcomm_run("-n", "2", str(GROUPS), str(REPS), timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _groups_done(proc.stdout, 2)


@pytest.mark.timeout(150)
def test_second_and_third_group_under_spawn() -> None:
    sys.path.insert(0, str(SCRIPTS))  # (the spawned ranks import it from there too)
    try:
        import groups_again

        assert rc.spawn(groups_again.spawned, 2, args=(REPS,), timeout_s=140) == [REPS, REPS]
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.mark.needs_mpi
@pytest.mark.timeout(150)
def test_second_and_third_group_under_mpirun() -> None:
    if shutil.which("mpirun") is None:
        pytest.skip("needs_mpi: mpirun is not installed")
    cmd = ["mpirun"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    cmd += ["--oversubscribe", "--bind-to", "none", "-np", "2", "-x", "PYTHONPATH"]
    proc = subprocess.run(
        [*cmd, sys.executable, str(GROUPS), str(REPS)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _groups_done(proc.stdout, 2)


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("torch", reason="needs_torch: torch is not installed")
    env = clean_env({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
    )


@pytest.mark.needs_torch
@pytest.mark.timeout(150)
def test_second_and_third_group_under_torchrun() -> None:
    proc = _torchrun(2, str(GROUPS), str(REPS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _groups_done(proc.stdout, 2)


@pytest.mark.needs_torch
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("mode", "world", "words"),
    [
        ("world", 2, [r"world_size=3", r"WORLD_SIZE=2"]),
        ("dup", 3, [r"rank 1 joined twice"]),
    ],
)
def test_mismatch_under_torchrun(mode: str, world: int, words: list[str]) -> None:
    proc = _torchrun(world, str(MISMATCH), mode)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _assert_all_refused(proc.stdout, world, *words)


@pytest.mark.needs_torch
@pytest.mark.timeout(150)
def test_torch_backend_reinit_and_plain_api_ports_under_torchrun() -> None:
    # destroy_process_group() + init_process_group("ringcomm") again (torchrun's agent
    # store keeps the first group's keys), then the plain API: every group's store on a
    # port from the OS, published in torchrun's store (no guessed port to collide with).
    proc = _torchrun(2, str(SCRIPTS / "torch_reinit.py"), "10", "plain")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(re.findall(r"REINIT (\d) 10", proc.stdout)) == ["0", "1"], proc.stdout
    plain = re.findall(r"PLAIN (\d) 10 (\d+)", proc.stdout)
    assert sorted(r for r, _ in plain) == ["0", "1"], proc.stdout


@pytest.mark.needs_torch
@pytest.mark.timeout(150)
def test_torch_backend_under_ringcomm_run_and_formed_again() -> None:
    # The launcher's MASTER_PORT is free for torch's env:// rank 0 (the store is at
    # RINGCOMM_MASTER_PORT), and a re-init reaches the new torch store, not the old one.
    pytest.importorskip("torch", reason="needs_torch: torch is not installed")
    proc = _ringcomm_run("-n", "2", str(SCRIPTS / "torch_reinit.py"), "5", timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(re.findall(r"REINIT (\d) 5", proc.stdout)) == ["0", "1"], proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
