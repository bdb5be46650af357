"""Fault injection: kill -9 a rank in the middle of a loop of mixed collectives.

Every trial starts a fresh job of W ranks (W from 3 to 6) that run random collectives of
random sizes back to back; the test process kills one rank, chosen at random, at a random
moment, and every survivor must raise PeerFailedError naming the killed rank within 5 s
of the kill (measured from the kill to the moment each survivor's error was raised, both
on this host's wall clock), then see its next call fail the same way (the group stays
failed) and close its group in bounded time. No process may be left behind.

The rendezvous store is served by the test process (as ``ringcomm run`` does), so killing
rank 0 is one of the cases.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import random
import secrets
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm.rendezvous import StoreServer

DETECTION_BOUND_S = 5.0
TRIALS = 20
GROUP_TIMEOUT_S = 60.0  # far above the bound: a detection never comes from a deadline


def _rank_main(rank: int, world: int, port: int, token: str, seed: int, out: Connection) -> None:
    """One rank: loop over random collectives until something fails; report what and when."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test dumps stacks on a hang
    pg = rc.init_process_group(
        rank,
        world,
        master_addr="127.0.0.1",
        master_port=port,
        token=token,
        timeout_s=GROUP_TIMEOUT_S,
        host_store=False,
    )
    rng = random.Random(seed)  # the same sequence of calls on every rank
    pg.barrier()
    out.send(("ready", rank))
    calls = 0
    try:
        while True:
            kind = rng.choice(
                (
                    "all_reduce",
                    "all_reduce",
                    "broadcast",
                    "all_gather",
                    "reduce_scatter",
                    "barrier",
                    "all_to_all",
                )
            )
            count = rng.choice((1, 3, 1000, 30_000, 300_000))
            if kind == "all_reduce":
                pg.all_reduce(np.ones(count, np.float32))
            elif kind == "broadcast":
                pg.broadcast(np.ones(count, np.float32), src=rng.randrange(world))
            elif kind == "all_gather":
                pg.all_gather(np.ones(count, np.float32))
            elif kind == "reduce_scatter":
                pg.reduce_scatter(np.ones((world, count), np.float32))
            elif kind == "all_to_all":
                pg.all_to_all(np.ones((world, max(1, count // world)), np.float32))
            else:
                pg.barrier()
            calls += 1
    except rc.PeerFailedError as exc:
        t_detect = time.time()
        report: dict[str, Any] = {
            "rank": rank,
            "t": t_detect,
            "peer": exc.peer,
            "msg": str(exc),
            "calls": calls,
        }
    except BaseException as exc:  # noqa: BLE001 (reported and asserted on by the test)
        out.send(("error", rank, f"{type(exc).__name__}: {exc}"))
        pg.close()
        return
    try:  # the group stays failed: the next call raises at once, naming the same peer
        pg.all_reduce(np.ones(4, np.float32))
        report["next"] = "no error"
    except rc.PeerFailedError as exc:
        report["next"] = ("PeerFailedError", exc.peer)
    except BaseException as exc:  # noqa: BLE001
        report["next"] = f"{type(exc).__name__}: {exc}"
    t0 = time.monotonic()
    pg.close()
    report["close_s"] = time.monotonic() - t0
    out.send(("failed", report))


def _trial(world: int, seed: int) -> tuple[int, float, dict[int, Any]]:
    """Run one trial; return (killed rank, kill time, survivor reports by rank)."""
    ctx = mp.get_context("spawn")
    token = secrets.token_hex(16)
    rng = random.Random(seed)
    victim = rng.randrange(world)
    reports: dict[int, Any] = {}
    with StoreServer("127.0.0.1", 0, token=token) as store:
        pipes, procs = [], []
        for r in range(world):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(r, world, store.port, token, seed, send_end),
                daemon=True,
            )
            p.start()
            send_end.close()
            pipes.append(recv_end)
            procs.append(p)
        try:
            for r, pipe in enumerate(pipes):
                assert pipe.poll(60), f"rank {r} did not start"
                assert pipe.recv() == ("ready", r)
            time.sleep(rng.uniform(0.0, 0.4))  # somewhere inside the loop of collectives
            t_kill = time.time()
            os.kill(procs[victim].pid, signal.SIGKILL)
            for r, pipe in enumerate(pipes):
                if r == victim:
                    continue
                if not pipe.poll(DETECTION_BOUND_S + GROUP_TIMEOUT_S / 4):
                    os.kill(procs[r].pid, signal.SIGUSR1)  # its stacks, on stderr
                    time.sleep(1.0)
                    raise AssertionError(
                        f"W={world} seed={seed}: rank {r} never reported (killed rank {victim})"
                    )
                msg = pipe.recv()
                assert msg[0] == "failed", f"W={world} seed={seed}: rank {r}: {msg}"
                reports[r] = msg[1]
            for p in procs:
                p.join(30)
                assert not p.is_alive()
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
            for pipe in pipes:
                pipe.close()
    return victim, t_kill, reports


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_9_every_survivor_raises_peer_failed_within_bound(no_child_processes: None) -> None:
    worlds = [3 + (i % 4) for i in range(TRIALS)]  # 3, 4, 5, 6, 3, ... (5 trials each)
    latencies: list[float] = []
    for i, world in enumerate(worlds):
        seed = 1000 + i
        victim, t_kill, reports = _trial(world, seed)
        assert sorted(reports) == [r for r in range(world) if r != victim]
        for r, rep in reports.items():
            where = f"trial {i} (W={world}, seed={seed}, killed rank {victim}), rank {r}"
            assert rep["peer"] == victim, f"{where}: names peer {rep['peer']}: {rep['msg']}"
            assert f"peer rank {victim} failed" in rep["msg"], f"{where}: {rep['msg']}"
            latency = rep["t"] - t_kill
            latencies.append(latency)
            assert latency <= DETECTION_BOUND_S, f"{where}: detected after {latency:.2f} s"
            assert rep["next"] == ("PeerFailedError", victim), f"{where}: {rep['next']}"
            assert rep["close_s"] < 10.0, f"{where}: close took {rep['close_s']:.1f} s"
    latencies.sort()
    print(
        f"\n{len(latencies)} detections over {TRIALS} trials: median "
        f"{latencies[len(latencies) // 2]:.3f} s, max {latencies[-1]:.3f} s"
    )


def _graceful(rank: int, world: int, port: int, token: str, out: Connection) -> None:
    """Rank 1 closes early (a goodbye, not a failure); ranks 0 and 2 carry on."""
    pg = rc.init_process_group(
        rank,
        world,
        master_addr="127.0.0.1",
        master_port=port,
        token=token,
        timeout_s=30,
        host_store=False,
    )
    sub = pg.new_group([0, 2])
    pg.barrier()
    try:
        if rank == 1:
            pg.close()
            out.send(("ok", rank, 0))
            return
        end = time.monotonic() + 1.5  # well past the failure detector's grace period
        n = 0
        go = np.ones(1, np.int64)
        assert sub is not None
        while go[0]:
            x = np.full(3, rank + 1.0)
            sub.all_reduce(x)
            assert x.tolist() == [4.0, 4.0, 4.0]
            n += 1
            go[0] = rank != 0 or time.monotonic() < end  # rank 0 says when to stop
            sub.all_reduce(go, op="min")
        out.send(("ok", rank, n if not pg.failed_peers() else -1))
    except BaseException as exc:  # noqa: BLE001
        out.send(("error", rank, f"{type(exc).__name__}: {exc}"))
    finally:
        pg.close()


@pytest.mark.timeout(120)
def test_a_rank_that_closes_is_not_a_failure(no_child_processes: None) -> None:
    ctx = mp.get_context("spawn")
    token = secrets.token_hex(16)
    with StoreServer("127.0.0.1", 0, token=token) as store:
        pipes, procs = [], []
        for r in range(3):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_graceful, args=(r, 3, store.port, token, send_end))
            p.start()
            send_end.close()
            pipes.append(recv_end)
            procs.append(p)
        try:
            results = []
            for pipe in pipes:
                assert pipe.poll(90)
                results.append(pipe.recv())
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    assert all(res[0] == "ok" for res in results), results
    assert results[0][2] > 0 and results[2][2] > 0, results
