"""Fuzzing live sockets: random and mutated frames at a rank's data socket and the store.

A job of two ranks runs checked all_reduces in a sub-group, back to back, while this
process throws hypothesis-generated frames at rank 1's data endpoint (as an insider: it
presents the job's credential, so the frames reach ringcomm's parser rather than being
refused by the handshake) and at the rendezvous store. Afterwards:

* both ranks are alive and every all_reduce they computed was correct;
* every fuzzed message is accounted for on rank 1: dropped and counted (malformed, from
  an unknown rank, or otherwise unusable) or, when it happens to be a well-formed message
  from a rank of the job, parked in the unexpected queue (nothing receives it: its group
  or tag is used by nobody), never delivered to a user buffer;
* the store server is alive, answers, and counted every fuzzed request as dropped
  (malformed) or refused (no token).

Out of scope: a holder of the token can forge well-formed control messages (goodbye,
peer-failed) in another rank's name, since the data plane has one job credential, not
per-rank keys; the generator turns such frames into ones from an unknown rank.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringcomm as rc
from ringcomm.rendezvous import Store, StoreServer
from ringcomm.transport.session import plain_login
from ringcomm.transport.wire import KIND_CTRL, WireError, unpack_header
from ringcomm.transport.zmq_transport import data_plane_credentials

DATA_EXAMPLES = 300
STORE_EXAMPLES = 120
BATCH = 40  # messages per example: 300 x 40 = 12k at the data socket, 4.8k at the store


def _rank_main(rank: int, port: int, token: str, ctl: Connection) -> None:
    pg = rc.init_process_group(
        rank,
        2,
        master_addr="127.0.0.1",
        master_port=port,
        token=token,
        timeout_s=60,
        host_store=False,
    )
    sub = pg.new_group([0, 1])
    assert sub is not None
    transport = pg.core.progress.transport
    ctl.send(("ready", (transport.ipc_endpoint, transport.auth_salt)))
    before = pg.stats()
    good = bad = 0
    go = np.ones(1, np.int64)
    sizes = (1, 7, 1000, 70_000)
    i = 0
    while go[0]:
        n = sizes[i % len(sizes)]
        x = np.arange(n, dtype=np.float32) + rank
        sub.all_reduce(x)
        expected = 2 * np.arange(n, dtype=np.float32) + 1
        if np.array_equal(x, expected):
            good += 1
        else:
            bad += 1
        i += 1
        go[0] = rank != 0 or not ctl.poll(0)  # rank 0 says when to stop
        sub.all_reduce(go, op="min")
    after = pg.stats()
    ctl.send(("done", good, bad, before, after, pg.failed_peers()))
    pg.close()


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=24),
)
_value = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4), max_leaves=8)


def _valid_fields(kind: int, src: int) -> list[Any]:
    return [1, kind, src, 0, 3, 0, 0, 1, "<f4", 4, 0, None, None, None, b"\0\0\0\0"]


@st.composite
def _data_message(draw: st.DrawFn) -> list[bytes]:
    """One ZeroMQ message: random frames, a valid header with fields replaced, or the
    bytes of a valid header mutated (flipped, cut, extended)."""
    how = draw(st.sampled_from(("random", "fields", "bytes")))
    if how == "random":
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    fields = _valid_fields(draw(st.sampled_from((1, 2, 3))), draw(st.sampled_from((0, 1, 7))))
    if how == "fields":
        for i in draw(st.lists(st.integers(0, len(fields) - 1), min_size=1, max_size=4)):
            fields[i] = draw(_value)
        if draw(st.booleans()):
            fields = fields[: draw(st.integers(0, len(fields)))]
        head = msgpack.packb(fields, use_bin_type=True)
    else:
        head = bytearray(msgpack.packb(fields, use_bin_type=True))
        for pos, byte in draw(
            st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=4)
        ):
            if pos < len(head):
                head[pos] = byte
        head = bytes(head[: draw(st.integers(0, len(head) + 4))]) + draw(st.binary(max_size=4))
    frames = [_no_forged_control(head)]
    if draw(st.booleans()):
        frames.append(draw(st.binary(max_size=64)))
    return frames


def _no_forged_control(head: bytes) -> bytes:
    """A well-formed control message from a job rank becomes one from rank 1000 (see the
    module docstring)."""
    try:
        header, _ = unpack_header(head)
    except WireError:
        return head
    if header.kind == KIND_CTRL and header.src in (0, 1):
        fields = msgpack.unpackb(head, raw=False)
        fields[2] = 1000
        return bytes(msgpack.packb(fields, use_bin_type=True))
    return head


@st.composite
def _store_message(draw: st.DrawFn) -> list[bytes]:
    """A request to the store without the token: random bytes, or a mutated request,
    unsigned or with a signature of random bytes."""
    if draw(st.booleans()):
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    body: dict[str, Any] = {
        "op": draw(st.sampled_from(("set", "get", "wait", "add", "x"))),
        "key": draw(_value),
        "value": draw(_value),
    }
    if draw(st.booleans()):
        body["token"] = draw(st.text(max_size=8))
    request: Any = {"id": draw(_value), "body": body} if draw(st.booleans()) else draw(_value)
    head = draw(st.one_of(st.just(b""), st.binary(min_size=56, max_size=56)))
    return [head, msgpack.packb(request, use_bin_type=True)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fuzzed_frames_are_dropped_and_the_rank_keeps_computing(no_child_processes: None) -> None:
    ctx = mp.get_context("spawn")
    token = secrets.token_hex(16)
    creds = data_plane_credentials(token)
    zctx = zmq.Context()
    with StoreServer("127.0.0.1", 0, token=token) as server:
        pipes, procs = [], []
        for r in range(2):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, server.port, token, theirs))
            p.start()
            theirs.close()
            pipes.append(ours)
            procs.append(p)
        try:
            endpoints = []
            for pipe in pipes:
                assert pipe.poll(60)
                tag, endpoint = pipe.recv()
                endpoints.append(endpoint)
            data = zctx.socket(zmq.PUSH)
            data.setsockopt(zmq.LINGER, 10_000)
            # An insider's login to rank 1 (made as rank 0 makes its own: rank 1's salt).
            username, password = plain_login(creds["plain_key"], bytes.fromhex(endpoints[1][1]), 0)
            data.setsockopt(zmq.PLAIN_USERNAME, username)
            data.setsockopt(zmq.PLAIN_PASSWORD, password)
            data.connect(endpoints[1][0])
            store_sock = zctx.socket(zmq.DEALER)
            store_sock.setsockopt(zmq.LINGER, 0)
            store_sock.connect(f"tcp://127.0.0.1:{server.port}")
            store_base = server.dropped + server.rejected
            sent = {"data": 0, "store": 0}

            @settings(
                max_examples=DATA_EXAMPLES,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(st.lists(_data_message(), min_size=BATCH, max_size=BATCH))
            def fuzz_data(messages: list[list[bytes]]) -> None:
                for frames in messages:
                    data.send_multipart(frames)
                sent["data"] += len(messages)

            @settings(
                max_examples=STORE_EXAMPLES,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(st.lists(_store_message(), min_size=BATCH, max_size=BATCH))
            def fuzz_store(messages: list[list[bytes]]) -> None:
                for frames in messages:
                    store_sock.send_multipart(frames)
                sent["store"] += len(messages)

            fuzz_data()
            fuzz_store()
            time.sleep(1.0)  # let the ranks drain what is in flight while they compute
            pipes[0].send("stop")
            results = []
            for pipe in pipes:
                assert pipe.poll(120)
                results.append(pipe.recv())
            data.close()
            store_sock.close()
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        # The store: alive, answers, and counted every fuzzed request.
        with Store("127.0.0.1", server.port, token=token, timeout_s=10) as client:
            client.set("after-fuzz", b"ok")
            assert client.get("after-fuzz") == b"ok"
        deadline = time.monotonic() + 10
        while server.dropped + server.rejected - store_base < sent["store"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert server.dropped + server.rejected - store_base == sent["store"]
    zctx.term()

    assert sent["data"] >= 10_000 and sent["store"] >= 4_000, sent
    for rank, (tag, good, bad, _, _, failed) in enumerate(results):
        assert tag == "done" and bad == 0 and good > 0, (rank, good, bad)
        assert failed == [], (rank, failed)
    _, _, _, before, after, _ = results[1]
    dropped = after["dropped_frames"] - before["dropped_frames"]
    parked = after["unexpected_messages"] - before["unexpected_messages"]
    assert dropped + parked == sent["data"], (dropped, parked, sent)
    assert dropped > sent["data"] // 2, (dropped, parked, sent)
    print(
        f"\nfuzz: {sent['data']} data messages: {dropped} dropped, {parked} parked; "
        f"{sent['store']} store requests dropped/refused; rank 1 computed "
        f"{results[1][1]} correct all_reduces meanwhile"
    )
