"""Standalone servers (``ringcomm ps-server``): kill -9 one mid-run, restart it from its
checkpoint; the workers reconnect and finish, losing at most one checkpoint interval."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm.ps import HashSlicer, PSConfig
from ringcomm.ps.membership import connect_worker
from ringcomm.ps.state import ServerState, load_checkpoint
from ringcomm.rendezvous import StoreServer

STEPS, EVERY, WORKERS, SERVERS, DIM = 60, 10, 2, 2, 64
LR = 0.01


def _worker(pg: Any, coord: tuple[str, int]) -> dict[str, Any]:
    kv = connect_worker(
        coord,
        pg.rank,
        WORKERS,
        SERVERS,
        timeout_s=90,
        join_timeout_s=15,
        slicer=HashSlicer(split_min_bytes=64),
    )
    w = np.zeros(DIM)
    kv.init(0, w).wait()
    for _ in range(STEPS):
        kv.push_pull(0, np.ones(DIM), w).wait()  # every step: w -= LR * 1
        kv.advance()
        time.sleep(0.03)  # long enough a run to kill a server in the middle
    stats = kv.stats()
    kv.close()
    return {"reconnects": kv.reconnects, "clock": kv.clock, "w": w, "stats": stats}


def _server_cmd(i: int, coord: tuple[str, int], ckpt: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ringcomm",
        "ps-server",
        "--coordinator",
        f"{coord[0]}:{coord[1]}",
        "--index",
        str(i),
        "--ps-servers",
        str(SERVERS),
        "--num-workers",
        str(WORKERS),
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        str(EVERY),
        "--lr",
        str(LR),
        "--timeout",
        "90",
        "--join-timeout",
        "15",
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_a_server_restart_it_and_the_workers_continue(
    tmp_path: Any, no_child_processes: None
) -> None:
    ckpt = str(tmp_path / "ckpt")
    procs: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {}
    with StoreServer("127.0.0.1", 0).start() as coordinator:
        coord = ("127.0.0.1", coordinator.port)
        try:
            procs = [subprocess.Popen(_server_cmd(i, coord, ckpt)) for i in range(SERVERS)]

            def run() -> None:
                try:
                    result["workers"] = rc.spawn(_worker, WORKERS, args=(coord,), timeout_s=200)
                except BaseException as exc:  # noqa: BLE001 (re-raised below)
                    result["error"] = exc

            thread = threading.Thread(target=run)
            thread.start()
            # kill server 1 once it has checkpointed (at EVERY steps), before the next one
            path = os.path.join(ckpt, "ps-server-1.npz")
            deadline = time.monotonic() + 120
            while not os.path.exists(path) and time.monotonic() < deadline and thread.is_alive():
                time.sleep(0.02)
            assert os.path.exists(path), result.get("error")
            time.sleep(0.1)
            procs[1].send_signal(signal.SIGKILL)
            assert procs[1].wait(timeout=30) == -signal.SIGKILL
            procs[1] = subprocess.Popen(_server_cmd(1, coord, ckpt))
            thread.join(timeout=220)
            assert not thread.is_alive()
            if "error" in result:
                raise result["error"]
            assert [p.wait(timeout=60) for p in procs] == [0, 0]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    workers = result["workers"]
    for res in workers:
        assert res["clock"] == STEPS and res["reconnects"] >= 1
    stats = {s["server"]: s for s in workers[0]["stats"]}
    assert stats[0]["restored_progress"] is None  # server 0 ran throughout
    restored = stats[1]["restored_progress"]
    assert restored is not None and restored >= EVERY
    for s in stats[0]["shards"]:
        assert s["applied"] == STEPS
    for s in stats[1]["shards"]:
        lost = STEPS - s["applied"]
        assert 0 <= lost <= EVERY, f"server 1 lost {lost} updates, more than one interval ({EVERY})"
        # the parameters say the same: each lost step is one LR missing from them
        piece = workers[0]["w"][s["start"] : s["stop"]]
        np.testing.assert_allclose(piece, -LR * s["applied"], rtol=1e-9)
    assert np.array_equal(workers[0]["w"], workers[1]["w"])

    # clean shutdown flushed: the final checkpoint holds the final state
    back = ServerState(PSConfig(num_workers=WORKERS), 1)
    assert load_checkpoint(back, ckpt)
    assert back.restored_progress == STEPS
    assert sorted(sh.applied for sh in back.shards.values()) == sorted(
        s["applied"] for s in stats[1]["shards"]
    )


def test_ps_server_usage_errors() -> None:
    base = [
        sys.executable,
        "-m",
        "ringcomm",
        "ps-server",
        "--coordinator",
        "127.0.0.1:1",
        "--num-workers",
        "2",
    ]
    bad_index = subprocess.run(
        [*base, "--index", "3", "--ps-servers", "2"], capture_output=True, timeout=60, check=False
    )
    assert bad_index.returncode == 2 and b"--index" in bad_index.stderr
    no_dir = subprocess.run(
        [*base, "--index", "0", "--checkpoint-every", "5"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert no_dir.returncode == 2 and b"checkpoint_dir" in no_dir.stderr
    bad_addr = subprocess.run(
        [*base[:4], "nowhere", "--num-workers", "2", "--index", "0"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert bad_addr.returncode == 2 and b"HOST:PORT" in bad_addr.stderr
