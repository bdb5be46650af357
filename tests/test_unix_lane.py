"""The same-host lane (transport/unix_lane.py): one-frame messages as AF_UNIX datagrams.

Unit tests of the lane and of its order rule in the transport (a datagram sent before a
zmq message is handed out before it), then jobs: the lane carries small collectives, it is
off with RINGCOMM_LOCAL_LANE=0 and under curve, and junk datagrams are dropped and counted.
"""

from __future__ import annotations

import os
import random
import socket
import stat
import threading
import time
from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm.config import resolve_init_config
from ringcomm.errors import RendezvousError
from ringcomm.transport.base import Stream
from ringcomm.transport.unix_lane import PARTS_TAG, UnixLane
from ringcomm.transport.wire import KIND_COLL, Header, pack_header, unpack_header
from ringcomm.transport.zmq_transport import ZmqTransport

# The message path on one host (collectives would take the shared workspace).
pytestmark = pytest.mark.usefixtures("no_workspace")

# -- the lane alone ------------------------------------------------------------------------


def test_datagrams_arrive_whole_and_in_order() -> None:
    a, b = UnixLane(0), UnixLane(1)
    try:
        assert a.connect(1, b.path) and a.has(1)
        assert b.recv() is None  # nothing waiting: never blocks
        frames = [bytes([i]) * (i * 37 % 4200 + 1) for i in range(9)]
        for f in frames:
            assert a.send(1, f)
        assert [b.recv() for _ in frames] == frames
        assert b.recv() is None
        assert (a.sent, a.fallbacks) == (9, 0)
        assert not a.send(0, b"x") and a.fallbacks == 0  # no lane to 0: not a fallback
    finally:
        a.close()
        b.close()


def test_a_header_and_its_payload_travel_as_one_datagram() -> None:
    a, b = UnixLane(0), UnixLane(1)
    try:
        a.connect(1, b.path)
        payload = np.arange(5000, dtype=np.int32)
        assert a.send_parts(1, b"\x9fheader", memoryview(payload))
        got = b.recv()
        assert got is not None and got[0] == PARTS_TAG
        parts = UnixLane.split(got)
        assert parts is not None and parts[0] == b"\x9fheader"
        assert np.array_equal(np.frombuffer(parts[1], np.int32), payload)
        assert UnixLane.split(b"\x9f" + bytes(10)) is None  # a one-frame message
        assert UnixLane.split(bytes([PARTS_TAG]) + (99).to_bytes(4, "little") + b"x") is None
    finally:
        a.close()
        b.close()


def test_socket_lives_in_a_private_directory_removed_at_close() -> None:
    lane = UnixLane(3)
    folder = os.path.dirname(lane.path)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(lane.path).st_mode)
    lane.close()
    lane.close()  # idempotent
    assert not os.path.exists(folder)


def test_a_full_queue_refuses_a_datagram_without_blocking() -> None:
    a, b = UnixLane(0), UnixLane(1)
    try:
        a.connect(1, b.path)
        sent = 0
        while a.send(1, sent.to_bytes(4, "little")):
            sent += 1
            assert sent < 100_000, "the receiving queue never filled"
        assert sent >= 1 and a.full == 1 and a.fallbacks == 0 and a.has(1)
        got = [b.recv() for _ in range(sent)]
        assert got == [i.to_bytes(4, "little") for i in range(sent)]
        assert b.recv() is None
        assert a.send(1, b"room again") and b.recv() == b"room again"
    finally:
        a.close()
        b.close()


def test_a_closed_peer_sends_it_off_the_lane() -> None:
    a, b = UnixLane(0), UnixLane(1)
    try:
        assert a.connect(1, b.path)
        b.close()
        assert not a.send(1, b"x")
        assert a.fallbacks == 1 and not a.has(1)
        assert not a.connect(2, b.path)  # gone: no lane to it at all
    finally:
        a.close()


# -- the order rule in the transport -------------------------------------------------------


def _receive(
    t: ZmqTransport, count: int, out: list[int], seen: threading.Condition, deadline: float
) -> None:
    """Read ``count`` messages; record their tags (each message's name) in arrival order,
    notifying ``seen`` after each."""
    while len(out) < count and time.monotonic() < deadline:
        if not t.poll(0.05):
            continue
        while True:
            first = t.recv_first(True)
            if first is None:
                break
            frame, more = first
            header, inline = unpack_header(frame)
            if more:
                payload = t.recv_payload(copy=True)
                assert isinstance(payload, memoryview) and len(payload) == header.nbytes
            else:
                assert inline is not None and len(inline) == header.nbytes
            with seen:
                out.append(header.tag)
                seen.notify_all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_datagram_sent_before_a_zmq_message_is_received_before_it(seed: int) -> None:
    """Random mixes of lane and zmq messages (two-frame ones too), received while they are
    sent (the queue fills now and then: those go over zmq): every datagram comes before
    every zmq message sent after it, and each channel keeps its own order. Sent in batches:
    the next batch starts once the reader has every message so far (its empty queue lets
    datagrams through again)."""
    rx, tx = ZmqTransport(1, lane=True), ZmqTransport(0, lane=True)
    try:
        assert rx.lane_endpoint is not None
        tx.set_peer_endpoint(1, rx.ipc_endpoint or "")
        assert tx.set_peer_lane(1, rx.lane_endpoint)
        rng = random.Random(seed)
        # Per message: its stream (None: never the lane) and payload size: one frame
        # (below the inline size) or a header with its payload (3000 or 5000 bytes).
        kinds = [rng.choice(("lane1", "lane2", "zmq1", "zmq2")) for _ in range(600)]
        plan: list[bool] = []
        got: list[int] = []
        seen = threading.Condition()
        reader = threading.Thread(
            target=_receive, args=(rx, len(kinds), got, seen, time.monotonic() + 40)
        )
        reader.start()
        for i, kind in enumerate(kinds):
            nbytes = 100 if kind.endswith("1") else 5000 if i % 2 else 3000
            # A fresh stream per lane message (nothing of its own to keep order with); a
            # full queue sends it over zmq (then it is ordered as one).
            stream = Stream() if kind.startswith("lane") else None
            before = tx.lane_messages
            tx.send(
                1,
                stream,
                pack_header(Header(KIND_COLL, 0, 0, i, nbytes=nbytes)),
                b"p" * nbytes,
                nbytes,
            )
            plan.append(tx.lane_messages > before)  # True: it went through the lane
            if i % 50 == 49:  # the batch is out: wait for the reader to have all of it
                with seen:
                    assert seen.wait_for(lambda: len(got) == len(plan), 10), (i, len(got))
        reader.join(40)
        assert len(got) == len(plan), len(got)
        where = {tag: pos for pos, tag in enumerate(got)}
        lanes = [i for i, lane in enumerate(plan) if lane is True]
        zmqs = [i for i, lane in enumerate(plan) if lane is not True]
        assert len(lanes) > 20 and len(zmqs) > 100
        assert [where[i] for i in lanes] == sorted(where[i] for i in lanes)
        assert [where[i] for i in zmqs] == sorted(where[i] for i in zmqs)
        for z in zmqs:  # every datagram sent before z arrived before it
            before = [i for i in lanes if i < z]
            if before:
                assert where[before[-1]] < where[z], (before[-1], z)
    finally:
        tx.close(0.0)
        rx.close(0.0)


def test_curve_and_tcp_only_transports_have_no_lane() -> None:
    for kwargs in ({"token": "t", "security": "curve"}, {"use_ipc": False}):
        t = ZmqTransport(0, lane=True, **kwargs)  # type: ignore[arg-type]
        try:
            assert t.lane_endpoint is None and not t.set_peer_lane(1, "/nonexistent")
        finally:
            t.close(0.0)


def test_local_lane_setting() -> None:
    assert resolve_init_config(env={}).local_lane is True
    assert resolve_init_config(env={"RINGCOMM_LOCAL_LANE": "0"}).local_lane is False
    assert resolve_init_config(env={"RINGCOMM_LOCAL_LANE": "on"}).local_lane is True
    with pytest.raises(RendezvousError, match="RINGCOMM_LOCAL_LANE"):
        resolve_init_config(env={"RINGCOMM_LOCAL_LANE": "sometimes"})


# -- jobs ----------------------------------------------------------------------------------


def job_small_collectives(pg: rc.ProcessGroup, junk: bool) -> dict[str, Any]:
    r, n = pg.rank, pg.world_size
    transport = pg.core.progress.transport
    before = pg.stats()
    if junk and r == 0 and transport.lane_endpoint:
        # A stranger with access to the path (same user): datagrams that are not
        # ringcomm messages, and one claiming to be from a rank that does not exist.
        forged = pack_header(
            Header(KIND_COLL, 99, 0, 0, 0, 0, 1, "<i8", 8, 0, None, None), b"8bytes!!"
        )
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for frame in (b"", b"\x00garbage", b"\x9f" * 40, os.urandom(5000), forged):
                s.sendto(frame, transport.lane_endpoint)
    pg.barrier()
    results = []
    for i in range(30):
        x = np.arange(5, dtype=np.int64) * (r + 1) + i
        pg.all_reduce(x)  # the fast lane
        y = np.full(3, float(r + i))
        w = pg.all_reduce(y, op="max", async_op=True)  # the regular path
        b = np.array([i, r], np.int32)
        pg.broadcast(b, src=i % n)
        w.wait()
        results.append((x.tolist(), y.tolist(), b.tolist()))
    big = np.full(70_000, r + 1.0, np.float32)  # zmq, zero-copy pieces
    pg.all_reduce(big, algo="ring")
    after = pg.stats()
    return {
        "results": results,
        "big": float(big[0]) if (big == big[0]).all() else None,
        "lane": transport.lane_endpoint,
        "lane_messages": after["lane_messages"] - before["lane_messages"],
        "sent": after["sent_messages"] - before["sent_messages"],
        "dropped": after["dropped_frames"] - before["dropped_frames"],
        "fallbacks": after["lane_fallbacks"],
    }


def _expected(n: int) -> list[Any]:
    out = []
    for i in range(30):
        x = (np.arange(5, dtype=np.int64) * sum(range(1, n + 1)) + n * i).tolist()
        y = [float(n - 1 + i)] * 3
        out.append((x, y, [i, i % n]))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["on", "off", "curve"])
def test_small_collectives_over_the_lane_or_not(
    setting: str, monkeypatch: pytest.MonkeyPatch, no_child_processes: None
) -> None:
    n = 3
    if setting == "off":
        monkeypatch.setenv("RINGCOMM_LOCAL_LANE", "0")
    if setting == "curve":
        monkeypatch.setenv("RINGCOMM_SECURITY", "curve")
    results = rc.spawn(job_small_collectives, n, (setting == "on",), timeout_s=100)
    for r, res in enumerate(results):
        assert res["results"] == _expected(n), r
        assert res["big"] == n * (n + 1) / 2
        assert res["fallbacks"] == 0
        if setting == "on":
            # Everything but the ring's zero-copy pieces (and the fingerprint messages
            # before them) went through the lane.
            assert res["lane"] is not None and res["lane_messages"] >= 30 * 4
            assert res["sent"] - res["lane_messages"] < 30
        else:
            assert res["lane"] is None and res["lane_messages"] == 0
    if setting == "on":
        assert results[0]["dropped"] == 5  # the junk, counted and dropped
    assert all(res["dropped"] == 0 for res in results[1:])
