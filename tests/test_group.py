"""ProcessGroup life cycle, sub-groups and init_process_group.

* closing: on an in-process singleton group (no other process needed) and in a spawned job;
* sub-groups: a 3-rank job, p2p with group ranks, separate tag spaces;
* ``init_process_group`` called directly in 2 processes of the multiprocessing spawn
  context, configured only through ``env=`` mappings (torchrun names, RINGCOMM_* names,
  a wrong token, ``RINGCOMM_TRANSPORT=tcp``).
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from conftest import free_port

import ringcomm as rc

pytestmark = pytest.mark.usefixtures("no_child_processes")


# --- closing (singleton group in this process) -----------------------------------------


def singleton(**kw: Any) -> rc.ProcessGroup:
    return rc.init_process_group(0, 1, env={}, **kw)


def assert_closed(pg: rc.ProcessGroup) -> None:
    x = np.zeros(2)
    for call in (
        lambda: pg.send(x, 0),
        lambda: pg.recv(x, 0),
        lambda: pg.isend(x, 0),
        lambda: pg.irecv(x, 0),
        lambda: pg.new_group([0]),
    ):
        with pytest.raises(rc.GroupClosedError):
            call()


@pytest.mark.timeout(30)
def test_singleton_p2p_and_close_is_idempotent() -> None:
    pg = singleton()
    assert (pg.rank, pg.world_size) == (0, 1)
    x, y = np.arange(5.0), np.zeros(5)
    pg.send(x, 0, tag=1)
    pg.recv(y, 0, tag=1)
    np.testing.assert_array_equal(x, y)
    pg.close()
    pg.close()
    assert "closed" in repr(pg)
    assert_closed(pg)


@pytest.mark.timeout(30)
def test_context_manager_closes_even_on_error() -> None:
    with singleton() as pg:
        pass
    assert_closed(pg)
    with pytest.raises(KeyError), singleton() as pg2:
        raise KeyError("boom")
    assert_closed(pg2)
    pg2.close()  # still idempotent after __exit__


@pytest.mark.timeout(30)
def test_close_fails_outstanding_work() -> None:
    pg = singleton()
    buf = np.full(4, -1.0)
    w = pg.irecv(buf, 0, tag=9)
    pg.close()
    assert w.done()
    t0 = time.monotonic()
    with pytest.raises(rc.GroupClosedError, match="tag 9"):
        w.wait(timeout_s=5)
    assert time.monotonic() - t0 < 1.0
    assert (buf == -1).all()


@pytest.mark.timeout(30)
def test_subgroup_close_and_world_close() -> None:
    pg = singleton()
    sub = pg.new_group([0])
    assert sub is not None and sub.group_id != pg.group_id
    sub.close()
    sub.close()
    assert_closed(sub)
    x, y = np.ones(3), np.zeros(3)  # the world group is unaffected
    pg.send(x, 0)
    pg.recv(y, 0)
    np.testing.assert_array_equal(x, y)
    sub2 = pg.new_group([0])
    pg.close()
    assert_closed(sub2)  # closing the world closes its sub-groups


@pytest.mark.timeout(30)
def test_singleton_tcp_only() -> None:
    with singleton(transport="tcp") as pg:
        t = pg.core.progress.transport
        assert t.ipc_endpoint is None and t.tcp_endpoint.startswith("tcp://")
        x, y = np.arange(3), np.zeros(3, np.int64)
        pg.send(x, 0)
        pg.recv(y, 0)
        np.testing.assert_array_equal(x, y)
    with pytest.raises(rc.RendezvousError, match="RINGCOMM_TRANSPORT"):
        singleton(transport="udp")


# --- sub-groups in a 3-rank job ---------------------------------------------------------


def subgroup_job(pg: rc.ProcessGroup) -> dict[str, Any]:
    r = pg.rank
    x = np.zeros(2, np.int64)
    for bad in ([], [1, 1], [0, 3], [-1]):  # rejected before anything changes, on every rank
        with pytest.raises(ValueError):
            pg.new_group(bad)
    sub = pg.new_group([1, 2])
    other = pg.new_group([2, 1])  # same members, other order: another group
    if r == 0:
        assert sub is None and other is None
        pg.send(np.full(2, 100, np.int64), dst=1, tag=0)
    else:
        assert sub is not None and other is not None
        assert (sub.rank, sub.world_size, sub.ranks) == (r - 1, 2, (1, 2))
        assert (other.rank, other.world_size, other.ranks) == (2 - r, 2, (2, 1))
        assert len({pg.group_id, sub.group_id, other.group_id}) == 3
        assert (sub.chunk_bytes, sub.timeout_s) == (pg.chunk_bytes, pg.timeout_s)
        with pytest.raises(ValueError, match="out of range"):
            sub.send(x, dst=2)  # group ranks: only 0 and 1 exist
        with pytest.raises(ValueError):
            sub.recv(x, src=-1)
        sub.chunk_bytes = 64
        big = np.arange(100, dtype=np.float64)
        if r == 1:
            # Tag 0 in three groups: the world, sub and other.
            pg.send(np.full(2, 1, np.int64), dst=2, tag=0)
            sub.send(np.full(2, 2, np.int64), dst=1, tag=0)  # sub rank 1 = global 2
            other.send(np.full(2, 3, np.int64), dst=0, tag=0)  # other rank 0 = global 2
            sub.send(big, dst=1, tag=5)  # 13 pieces, all tagged with sub's group id
            pg.recv(x, src=0, tag=0)
            assert x.tolist() == [100, 100]
        else:
            # Received in the reverse order of sending: each tag 0 matches its own group only.
            other.recv(x, src=1, tag=0)
            assert x.tolist() == [3, 3]
            sub.recv(x, src=0, tag=0)
            assert x.tolist() == [2, 2]
            pg.recv(x, src=1, tag=0)
            assert x.tolist() == [1, 1]
            got = np.zeros(100)
            sub.recv(got, src=0, tag=5)
            np.testing.assert_array_equal(got, big)
        # A sub-group of a sub-group: only global rank 2 is in it.
        solo = sub.new_group([1])
        assert (solo is None) == (r == 1)
        if solo is not None:
            assert (solo.rank, solo.world_size, solo.ranks) == (0, 1, (2,))
            solo.send(np.full(2, 7, np.int64), dst=0)
            solo.recv(x, src=0)
            assert x.tolist() == [7, 7]
        sub.close()
        sub.close()
        with pytest.raises(rc.GroupClosedError):
            sub.send(x, dst=1 - sub.rank)
        # The world group and the other sub-group still work.
        peer = 3 - r
        w = pg.irecv(x, src=peer, tag=1)
        pg.send(np.full(2, r, np.int64), dst=peer, tag=1)
        w.wait()
        assert x.tolist() == [peer, peer]
        other.send(np.full(2, r, np.int64), dst=1 - other.rank, tag=1)
        other.recv(x, src=1 - other.rank, tag=1)
        assert x.tolist() == [peer, peer]
    # Closing the world group (spawn closes it again afterwards: idempotent).
    pg.close()
    pg.close()
    for g in (pg, other):
        if g is None:
            continue
        for method in (g.send, g.recv, g.irecv):
            with pytest.raises(rc.GroupClosedError):
                method(x, 0)
    return {"rank": r, "sub": None if sub is None else sub.rank}


@pytest.mark.timeout(60)
def test_subgroups() -> None:
    results = rc.spawn(subgroup_job, 3, timeout_s=40)
    assert results == [{"rank": 0, "sub": None}, {"rank": 1, "sub": 0}, {"rank": 2, "sub": 1}]


# --- init_process_group directly, configured through env= -------------------------------


def init_child(rank: int, env: Mapping[str, str], out: Connection) -> None:
    """Join the group from ``env`` only, exchange one message with the peer, report."""
    try:
        t0 = time.monotonic()
        with rc.init_process_group(env=env) as pg:
            transport = pg.core.progress.transport
            peer = 1 - pg.rank
            got = np.zeros(3, np.int64)
            w = pg.irecv(got, src=peer, tag=4)
            pg.send(np.full(3, 10 + pg.rank, np.int64), dst=peer, tag=4)
            w.wait()
            info = {
                "rank": pg.rank,
                "world_size": pg.world_size,
                "hosts_store": pg.core.state.server is not None,
                "store_port": None if pg.core.state.server is None else pg.core.state.server.port,
                "ipc": transport.ipc_endpoint,
                "peer_endpoint": transport._peer_endpoints[peer],
                "got": got.tolist(),
            }
        out.send(("ok", info))
    except Exception as exc:  # noqa: BLE001  report it to the parent instead of a traceback on stderr
        out.send(("err", type(exc).__name__, str(exc), time.monotonic() - t0))
    finally:
        out.close()


def run_pair(
    envs: list[dict[str, str]], timeout_s: float = 30.0, start_order: tuple[int, ...] = (0, 1)
) -> list[tuple[Any, ...]]:
    """Run ``init_child`` for rank 0 and 1 in spawned processes; every process is joined.

    Returns each rank's report, in rank order.
    """
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], [None] * len(envs)
    try:
        for rank in start_order:
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=init_child, args=(rank, envs[rank], send_end), daemon=True)
            p.start()
            send_end.close()
            procs.append(p)
            conns[rank] = recv_end
        deadline = time.monotonic() + timeout_s
        reports: list[tuple[Any, ...]] = []
        for c in conns:
            try:
                if c.poll(max(0.0, deadline - time.monotonic())):
                    reports.append(c.recv())
                else:
                    reports.append(("hung",))
            except EOFError:
                reports.append(("died",))
        return reports
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            if c is not None:
                c.close()


def torchrun_env(rank: int, port: int, **extra: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RINGCOMM_TIMEOUT_S": "20",
        **extra,
    }


def assert_pair_ok(reports: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    assert all(rep[0] == "ok" for rep in reports), reports
    infos = [rep[1] for rep in reports]
    for rank, info in enumerate(infos):
        assert (info["rank"], info["world_size"]) == (rank, 2)
        assert info["got"] == [11 - rank] * 3
    return infos


@pytest.mark.timeout(60)
def test_init_from_torchrun_env() -> None:
    port = free_port()
    infos = assert_pair_ok(run_pair([torchrun_env(r, port) for r in range(2)]))
    assert [i["hosts_store"] for i in infos] == [True, False]  # rank 0 hosts the store
    assert infos[0]["store_port"] == port
    assert all(i["peer_endpoint"].startswith("ipc://") for i in infos)  # same host


@pytest.mark.timeout(60)
def test_init_tcp_transport_from_ringcomm_env() -> None:
    port = free_port()
    envs = [
        {
            "RINGCOMM_RANK": str(r),
            "RINGCOMM_WORLD_SIZE": "2",
            "RINGCOMM_MASTER_ADDR": "127.0.0.1",
            "RINGCOMM_MASTER_PORT": str(port),
            "RINGCOMM_TIMEOUT_S": "20",
            "RINGCOMM_TRANSPORT": "tcp",
            "RINGCOMM_TOKEN": "s3cret",
        }
        for r in range(2)
    ]
    infos = assert_pair_ok(run_pair(envs))
    for i in infos:
        assert i["ipc"] is None, "tcp mode must not bind ipc://"
        assert i["peer_endpoint"].startswith("tcp://"), i


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad_token", ["wrong", None], ids=["wrong", "missing"])
def test_init_bad_token_is_refused(bad_token: str | None) -> None:
    port = free_port()
    good = torchrun_env(0, port, RINGCOMM_TOKEN="right-token", RINGCOMM_TIMEOUT_S="2")
    bad = torchrun_env(1, port)
    if bad_token is not None:
        bad["RINGCOMM_TOKEN"] = bad_token
    t0 = time.monotonic()
    # Rank 1 starts first: its first request waits for rank 0's store (zmq connects in the
    # background), so it is refused however slowly rank 0 comes up; rank 0's short deadline
    # then bounds how long it waits for rank 1.
    rank0, rank1 = run_pair([good, bad], start_order=(1, 0))
    assert rank1[:2] == ("err", "AuthenticationError"), rank1
    assert "token" in rank1[2]
    assert rank1[3] < 10.0
    # Rank 0 never hears from rank 1: it gives up at its deadline instead of hanging.
    assert rank0[0] == "err" and rank0[1] in ("CommTimeoutError", "RendezvousError"), rank0
    assert time.monotonic() - t0 < 20.0
