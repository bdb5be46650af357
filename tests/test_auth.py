"""Authentication: the job token guards the rendezvous store and the data plane.

* A process without the token, or with a wrong one, cannot join rendezvous
  (:class:`AuthenticationError`, before it learns anything about the job).
* A process that knows a rank's data endpoint but not the token cannot deliver a frame:
  its connection is refused at the handshake (counted in ``pg.stats()["auth_failures"]``),
  and a perfectly well-formed message it sends never reaches a posted receive. Both
  mechanisms (``RINGCOMM_SECURITY=handshake`` and ``curve``) are checked, and collectives
  still compute under each.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from conftest import free_port

import ringcomm as rc
from ringcomm.rendezvous import StoreServer
from ringcomm.transport.endpoints import local_address_towards
from ringcomm.transport.session import plain_login
from ringcomm.transport.wire import KIND_P2P, Header, pack_header
from ringcomm.transport.zmq_transport import data_plane_credentials


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_rendezvous_refuses_a_missing_or_wrong_token(token: str | None) -> None:
    with StoreServer("127.0.0.1", 0, token="the-job-token") as server:
        with pytest.raises(rc.AuthenticationError, match="refused this process"):
            rc.init_process_group(
                1,
                2,
                master_addr="127.0.0.1",
                master_port=server.port,
                token=token,
                timeout_s=10,
                host_store=False,
            )
        assert server.rejected >= 1


def test_credentials_are_derived_not_the_token() -> None:
    a, b = data_plane_credentials("token-a"), data_plane_credentials("token-b")
    assert a == data_plane_credentials("token-a")  # every rank derives the same
    assert all(a[k] != b[k] for k in a)
    assert all(b"token-a" not in v for v in a.values())
    # A PLAIN login is made per connection: never the same twice, never the token.
    logins = {plain_login(a["plain_key"], b"s" * 16, 0) for _ in range(3)}
    assert len(logins) == 3 and all(b"token-a" not in u + p for u, p in logins)
    assert zmq.curve_public(a["server_secret"]) == a["server_public"]


def _forged(payload: np.ndarray) -> list[bytes]:
    """A well-formed p2p message "from rank 0, tag 9" (what an outsider would forge)."""
    h = Header(KIND_P2P, 0, 0, 9, 0, 0, 1, payload.dtype.str, payload.nbytes, 0, payload.shape)
    return [pack_header(h, payload.tobytes())]


def _outsiders(
    ctx: zmq.Context,
    endpoint: str,
    replay: tuple[bytes, bytes] | None,  # type: ignore[type-arg]
) -> list[zmq.Socket]:  # type: ignore[type-arg]
    """Sockets that try to get in: no credential, a wrong one, wrong CURVE keys, and (with
    ``replay``) a login that a rank of the job already used, as a sniffer saw it."""
    socks = []
    wrong = data_plane_credentials("not-the-token")
    for how in ("null", "plain", "curve", "replay"):
        if how == "replay" and replay is None:
            continue
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        if how == "plain":
            username, password = plain_login(wrong["plain_key"], b"0" * 16, 0)
            s.setsockopt(zmq.PLAIN_USERNAME, username)
            s.setsockopt(zmq.PLAIN_PASSWORD, password)
        elif how == "replay":
            assert replay is not None
            s.setsockopt(zmq.PLAIN_USERNAME, replay[0])
            s.setsockopt(zmq.PLAIN_PASSWORD, replay[1])
        elif how == "curve":
            s.setsockopt(zmq.CURVE_SERVERKEY, wrong["server_public"])
            s.setsockopt(zmq.CURVE_PUBLICKEY, wrong["client_public"])
            s.setsockopt(zmq.CURVE_SECRETKEY, wrong["client_secret"])
        s.connect(endpoint)
        socks.append(s)
    return socks


def _used_login(pg: rc.ProcessGroup, peer: int) -> tuple[bytes, bytes] | None:
    """The PLAIN login this rank's connection to ``peer`` presented (sent in the clear:
    what a sniffer of the network saw), or None under curve."""
    transport = pg.core.progress.transport
    if transport.security != "handshake":
        return None
    sock = transport._tx[peer]  # the test plays the sniffer: the login this socket sent
    return sock.getsockopt(zmq.PLAIN_USERNAME), sock.getsockopt(zmq.PLAIN_PASSWORD)


def job_outsider_cannot_deliver(pg: rc.ProcessGroup) -> dict[str, object]:
    x = np.full(3, pg.rank + 1.0)
    pg.all_reduce(x)  # the job itself works under this mechanism
    assert x.tolist() == [3.0, 3.0, 3.0]
    if pg.rank == 1:
        endpoint = pg.core.progress.transport.ipc_endpoint or ""
        before = pg.stats()
        buf = np.full(2, -1, np.int64)
        work = pg.irecv(buf, src=0, tag=9)
        pg.send(np.frombuffer(endpoint.encode().ljust(256, b"\0"), np.uint8), dst=0, tag=1)
        pg.recv(np.zeros(1, np.uint8), src=0, tag=2)  # rank 0's outsiders have sent
        deadline = time.monotonic() + 15
        expected = 3 if pg.core.progress.transport.security == "curve" else 4
        while pg.stats()["auth_failures"] - before["auth_failures"] < expected:
            assert time.monotonic() < deadline, pg.stats()
            work.done()  # drive the engine meanwhile: a forged frame must not complete it
            time.sleep(0.02)
        time.sleep(0.2)
        assert not work.done() and (buf == -1).all(), buf
        after = pg.stats()
        pg.send(np.zeros(1, np.uint8), dst=0, tag=3)
        work.wait(timeout_s=30)
        return {
            "auth_failures": after["auth_failures"] - before["auth_failures"],
            "buf": buf.tolist(),
            "unexpected": after["unexpected_messages"],
            "security": pg.core.progress.transport.security,
        }
    raw = np.zeros(256, np.uint8)
    pg.recv(raw, src=1, tag=1)
    endpoint = raw.tobytes().rstrip(b"\0").decode()
    ctx = zmq.Context()
    try:
        socks = _outsiders(ctx, endpoint, _used_login(pg, 1))
        for s in socks:
            s.send_multipart(_forged(np.array([666, 666], np.int64)), zmq.NOBLOCK)
        pg.send(np.zeros(1, np.uint8), dst=1, tag=2)
        pg.recv(np.zeros(1, np.uint8), src=1, tag=3)
        for s in socks:
            s.close()
    finally:
        ctx.term()
    pg.send(np.array([12345, 54321], np.int64), dst=1, tag=9)
    return {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("security", ["handshake", "curve"])
def test_outsider_without_the_token_cannot_deliver_a_frame(
    security: str, monkeypatch: pytest.MonkeyPatch, no_child_processes: None
) -> None:
    monkeypatch.setenv("RINGCOMM_SECURITY", security)
    res = rc.spawn(job_outsider_cannot_deliver, 2, timeout_s=100)[1]
    assert res["security"] == security
    assert res["auth_failures"] >= (3 if security == "curve" else 4)  # a replay too
    assert res["buf"] == [12345, 54321]  # the real message, not the forged one
    assert res["unexpected"] == 0  # the forged message was not even queued


def test_data_socket_binds_the_interface_peers_use() -> None:
    """Not every interface: the address that routes to the master (loopback here)."""
    assert local_address_towards("127.0.0.1", free_port()) == "127.0.0.1"
    port = free_port()
    with StoreServer("127.0.0.1", port, token="t") as server:
        pg = rc.init_process_group(
            0,
            1,
            master_addr="127.0.0.1",
            master_port=server.port,
            token="t",
            timeout_s=10,
            host_store=False,
        )
        try:
            tcp = pg.core.progress.transport.tcp_endpoint
            assert tcp is not None and tcp.startswith("tcp://127.0.0.1:"), tcp
        finally:
            pg.close()


def test_no_pickle_on_the_wire() -> None:
    """Only the local launcher (parent <-> child pipes of one host) may use pickle; nothing
    that reads from a socket does (wire: msgpack and raw buffers)."""
    import pathlib

    root = pathlib.Path(rc.__file__).parent
    words = ("import pickle", "cPickle", "ForkingPickler", "recv_pyobj", "send_pyobj", "dill")
    users = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if any(w in p.read_text() for w in words)
    )
    assert all(u.startswith("launch/") for u in users), users
