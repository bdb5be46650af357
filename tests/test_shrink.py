"""Shrinking a failed group to its survivors (``ProcessGroup.shrink``, ringcomm.core.regroup).

Real processes (not ``rc.spawn``, which stops every rank on the first failure): W ranks
run a loop of collectives; one is killed with SIGKILL (rank 0 included: it hosts the
store, so the lowest survivor serves a new one); the survivors shrink and check the next
10 collectives on the new group. A second rank killed during the shrink: every survivor
raises a clear error, none hangs.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ringcomm.rendezvous import StoreServer

SCRIPT = Path(__file__).resolve().parent / "scripts" / "shrink_loop.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_with_the_next_taken() -> tuple[int, socket.socket]:
    """A free port whose next port is held by a listening socket (returned)."""
    while True:
        port = _free_port()
        blocker = socket.socket()
        try:
            blocker.bind(("127.0.0.1", port + 1))
            blocker.listen()
            return port, blocker
        except OSError:
            blocker.close()


def _run(
    world: int,
    victim: int,
    step: int,
    tmp_path: Path,
    *,
    second: int | None = None,
    external: bool = False,
    block_next_port: bool = False,
) -> tuple[list[int | None], dict[int, dict[str, Any]]]:
    server = StoreServer("127.0.0.1", 0, token="shrink-test").start() if external else None
    blocker = None
    if server is not None:
        port = server.port
    elif block_next_port:
        port, blocker = _port_with_the_next_taken()
    else:
        port = _free_port()
    procs = []
    try:
        for r in range(world):
            env = dict(
                os.environ,
                RINGCOMM_RANK=str(r),
                RINGCOMM_WORLD_SIZE=str(world),
                RINGCOMM_MASTER_ADDR="127.0.0.1",
                RINGCOMM_MASTER_PORT=str(port),
                RINGCOMM_TOKEN="shrink-test",
                RINGCOMM_STORE_EXTERNAL="1" if external else "0",
            )
            args = [sys.executable, str(SCRIPT), str(victim), str(step), str(tmp_path)]
            procs.append(
                subprocess.Popen(args + ([str(second)] if second is not None else []), env=env)
            )
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(60))
            except subprocess.TimeoutExpired:
                codes.append(None)  # a hang: fails below
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if server is not None:
            server.close()
        if blocker is not None:
            blocker.close()
    reports = {}
    for r in range(world):
        path = tmp_path / f"peer.{r}"
        if path.exists():
            reports[r] = json.loads(path.read_text())
    return codes, reports


# W=3..6, the victim random (rank 0 in a third of them), seeded: 20 trials.
_rng = random.Random(2026)
TRIALS = [
    (w, 0 if i % 3 == 0 else _rng.randrange(1, w), _rng.randrange(1, 5))
    for i, w in enumerate([3, 4, 5, 6] * 5)
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "victim", "step"), TRIALS)
def test_survivors_shrink_and_the_next_collectives_are_right(
    world: int, victim: int, step: int, tmp_path: Path
) -> None:
    codes, reports = _run(world, victim, step, tmp_path)
    assert codes[victim] == -9
    t_kill = json.loads((tmp_path / f"kill.{victim}").read_text())
    survivors = [r for r in range(world) if r != victim]
    for new_rank, r in enumerate(survivors):
        assert codes[r] == 0, (r, codes, reports.get(r))
        rep = reports[r]
        assert rep["error"] == "PeerFailedError" and f"rank {victim}" in rep["text"], rep
        assert rep["ok"] is True
        assert rep["rank"] == new_rank and rep["world_size"] == world - 1
        assert rep["t_shrunk"] - t_kill < 10.0, f"rank {r}: {rep['t_shrunk'] - t_kill:.1f} s"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 2])
def test_shrink_with_a_store_the_launcher_serves(victim: int, tmp_path: Path) -> None:
    codes, reports = _run(4, victim, 1, tmp_path, external=True)
    assert codes[victim] == -9
    assert all(reports[r]["ok"] for r in range(4) if r != victim), reports


@pytest.mark.timeout(120)
def test_the_failover_store_takes_the_next_free_port(tmp_path: Path) -> None:
    # Rank 0 (the store's host) dies; old port + 1 is taken by another socket.
    codes, reports = _run(4, 0, 2, tmp_path, block_next_port=True)
    assert codes[0] == -9
    assert all(codes[r] == 0 and reports[r]["ok"] for r in range(1, 4)), (codes, reports)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "victim", "second"), [(4, 1, 2), (5, 0, 3), (3, 2, 0)])
def test_a_second_failure_during_the_shrink_is_a_clear_error_everywhere(
    world: int, victim: int, second: int, tmp_path: Path
) -> None:
    codes, reports = _run(world, victim, 1, tmp_path, second=second)
    assert codes[victim] == -9 and codes[second] == -9
    survivors = [r for r in range(world) if r not in (victim, second)]
    assert all(codes[r] is not None for r in survivors), f"a survivor hung: {codes}"
    # The second victim dies right after publishing its view. If a survivor read that
    # view before it saw the death, it may have counted it in: then every survivor must
    # fail, saying which rank failed during the shrink. If every survivor saw the death
    # first, they agree on a group without it: then all of them must have it right.
    if all(codes[r] == 0 for r in survivors):
        for new_rank, r in enumerate(survivors):
            rep = reports[r]
            assert rep["ok"] is True and rep["rank"] == new_rank, rep
            assert rep["world_size"] == world - 2, rep
        return
    for r in survivors:
        rep = reports.get(r, {})
        assert codes[r] == 3, (r, codes, rep)
        text = rep.get("shrink_text") or ""
        assert rep["shrink_error"] in ("PeerFailedError", "CommTimeoutError"), rep
        assert "shrink" in text, text
        named = re.search(r"ranks? ((?:\d+, )*\d+) failed", text)
        assert named is not None and str(second) in named[1].split(", "), text


def test_a_reaped_process_counts_as_ended() -> None:
    # A killed peer that its parent (a launcher) already reaped has no pid left: it ended.
    from ringcomm.core.group_core import wait_for_exit

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert wait_for_exit(child.pid, 0.0) is True
    alive = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert wait_for_exit(alive.pid, 0.0) is False
    finally:
        alive.communicate(b"")
