"""Large payloads through shared memory between ranks on one host (transport/shm_lane.py).

Unit tests of the slots (a reference, the view it gives, the slot freed with the last view,
no free slot or a piece too large: nothing done), then jobs: collectives and point-to-point
over the slots give the same results as over the socket, and a receiver that holds many
pieces (unexpected messages) makes the sender fall back to the socket, in order.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm.transport import shm_lane
from ringcomm.transport.shm_lane import REF_BYTES, ShmSegments, is_ref

pytestmark = pytest.mark.skipif(not shm_lane.AVAILABLE, reason="shared-memory lane: x86-64 Linux")


def _pair(slots: int = 2, slot_bytes: int = 1 << 16) -> tuple[ShmSegments, ShmSegments]:
    a, b = ShmSegments(0, slots, slot_bytes), ShmSegments(1, slots, slot_bytes)
    assert b.attach(0, os.dup(a.outgoing_fd(1)), a.segment_bytes())
    return a, b


def test_a_piece_goes_through_a_slot_and_the_slot_comes_back() -> None:
    a, b = _pair()
    try:
        x = np.arange(4000, dtype=np.float32)
        ref = a.put(1, memoryview(x), x.nbytes)
        assert ref is not None and len(ref) == REF_BYTES and is_ref(ref)
        x[:] = -1  # the sender's buffer is free at once: the slot holds a copy
        view = b.take(ref, 0)
        assert view is not None and view.readonly
        got = np.frombuffer(view, np.float32)
        assert np.array_equal(got, np.arange(4000, dtype=np.float32))
        assert a.put(1, x, x.nbytes) is not None  # the second slot
        assert a.put(1, x, x.nbytes) is None and a.full == 1  # both taken
        del view, got
        gc.collect()
        assert a.put(1, x, x.nbytes) is not None  # the first one is free again
        assert a.sent == 3
    finally:
        a.close()
        b.close()


def test_what_is_not_done() -> None:
    a, b = _pair(slot_bytes=1 << 12)
    try:
        big = np.zeros(1 << 13, np.uint8)
        assert a.put(1, big, big.nbytes) is None  # larger than a slot
        assert a.put(2, big[:10], 10) is None  # no segment towards rank 2
        ref = a.put(1, big[:100], 100)
        assert ref is not None
        assert b.take(ref, 5) is None  # claims another sender
        assert b.take(ref[:-1], 0) is None  # truncated
        assert b.take(b"RCS1" + bytes(8) + (1 << 20).to_bytes(4, "little"), 0) is None
        assert b.take(ref[:10] + bytes(2) + ref[12:], 0) is None  # generation 0
        assert b.take(b"XXXX" + ref[4:], 0) is None
        assert not is_ref(b"x" * REF_BYTES) and not is_ref(bytes(4096))
        view = b.take(ref, 0)
        assert view is not None
        assert b.take(ref, 0) is None  # the same reference twice
        del view
        gc.collect()
        assert b.take(ref, 0) is None  # a stale reference to a freed slot
        again = a.put(1, big[:100], 100)
        assert again is not None and again != ref  # same slot, next generation
        assert b.take(ref, 0) is None and b.take(again, 0) is not None
        assert not b.attach(0, os.dup(a.outgoing_fd(1)), a.segment_bytes())  # twice
        assert not b.attach(3, os.dup(a.outgoing_fd(1)), 12345)  # another layout
    finally:
        a.close()
        b.close()


def test_close_with_a_payload_still_viewed() -> None:
    a, b = _pair()
    ref = a.put(1, b"z" * 5000, 5000)
    assert ref is not None
    view = b.take(ref, 0)
    a.close()
    b.close()  # the view keeps the mapping alive until it goes
    assert view is not None and bytes(view[:3]) == b"zzz"
    del view
    gc.collect()


def test_transports_set_up_segments_and_a_piece_goes_through_one() -> None:
    from ringcomm.transport.zmq_transport import ZmqTransport

    ts = [ZmqTransport(r, lane=True, shm=r < 2) for r in range(3)]  # rank 2: no shm
    try:
        for t in ts:
            for peer in ts:
                if peer is not t:
                    t.set_peer_endpoint(peer.rank, peer.ipc_endpoint or "")
                    assert t.set_peer_lane(peer.rank, peer.lane_endpoint or "")
        assert [t.shm_enabled for t in ts] == [True, True, False]
        takers = [r for r, t in enumerate(ts) if t.shm_enabled]  # what ranks publish
        done: dict[int, list[int]] = {}
        threads = [
            threading.Thread(target=lambda t=t: done.update({t.rank: t.setup_shm(takers, 10)}))
            for t in ts
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(15)
        assert done == {0: [1], 1: [0], 2: []}  # rank 2 is left out, nobody waits for it
        x = np.arange(1 << 16, dtype=np.float32)
        assert ts[0].send(1, None, b"hdr", memoryview(x), x.nbytes) is None  # no tracker: copied
        assert ts[0].send(2, None, b"hdr", memoryview(x), x.nbytes) is not None  # zmq, zero-copy
        assert ts[0].shm_pieces == 1
        assert ts[1].poll(5)
        first = ts[1].recv_first(True)
        assert first == (b"hdr", True)
        payload = ts[1].recv_payload(False, src=0)
        assert isinstance(payload, memoryview) and payload.readonly
        assert np.array_equal(np.frombuffer(payload, np.float32), x)
    finally:
        for t in ts:
            t.close(0.0)


# -- jobs ----------------------------------------------------------------------------------


def job_large_transfers(pg: rc.ProcessGroup) -> dict[str, Any]:
    r, n = pg.rank, pg.world_size
    before = pg.stats()
    out: dict[str, Any] = {}
    x = np.arange(3 << 20, dtype=np.float32) + r  # 12 MiB: pieces of 4 MiB
    pg.all_reduce(x, algo="ring")
    out["all_reduce"] = bool(
        np.array_equal(x, np.arange(3 << 20, dtype=np.float32) * n + n * (n - 1) / 2)
    )
    g = pg.all_gather(np.full(300_000, r, np.int64))
    out["all_gather"] = [int(v) for v in g[:, 0]] == list(range(n)) and bool((g == g[:, :1]).all())
    rs = pg.reduce_scatter(np.ones((n, 200_000), np.float64) * (r + 1))
    out["reduce_scatter"] = bool((rs == n * (n + 1) / 2).all())
    b = np.full(500_000, r, np.int32)
    pg.broadcast(b, src=n - 1)
    out["broadcast"] = bool((b == n - 1).all())
    # Point-to-point: rank 0 sends 10 pieces of 1 MiB before rank 1 posts a receive, so
    # the slots fill (the pieces wait as unexpected messages) and the rest go by socket.
    if r == 0:
        for i in range(10):
            pg.send(np.full(1 << 18, i, np.int32), dst=1, tag=5)
        pg.recv(np.zeros(1, np.uint8), src=1, tag=6)
    elif r == 1:
        time.sleep(0.5)  # the ten sends are all in by now
        got = []
        for _ in range(10):
            buf = np.empty(1 << 18, np.int32)
            pg.recv(buf, src=0, tag=5)
            got.append(int(buf[0]) if (buf == buf[0]).all() else -1)
        out["p2p"] = got
        pg.send(np.zeros(1, np.uint8), dst=0, tag=6)
    after = pg.stats()
    shm = pg.core.progress.transport._shm
    out["no_free_slot"] = 0 if shm is None else shm.full
    out["shm_pieces"] = after["shm_pieces"] - before["shm_pieces"]
    out["sent"] = after["sent_messages"] - before["sent_messages"]
    out["dropped"] = after["dropped_frames"] - before["dropped_frames"]
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shm", ["1", "0"])
def test_large_transfers_through_slots_or_the_socket(
    shm: str, monkeypatch: pytest.MonkeyPatch, no_child_processes: None
) -> None:
    monkeypatch.setenv("RINGCOMM_SHM", shm)
    results = rc.spawn(job_large_transfers, 3, timeout_s=160)
    for rank, res in enumerate(results):
        for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            assert res[name], (rank, name)
        assert res["dropped"] == 0
        if shm == "1":
            assert res["shm_pieces"] > 0, rank
        else:
            assert res["shm_pieces"] == 0, rank
    assert results[1]["p2p"] == list(range(10))  # in order, slots or socket
    if shm == "1":  # rank 1 held the first pieces: rank 0 found the slots taken
        assert results[0]["no_free_slot"] >= 1
