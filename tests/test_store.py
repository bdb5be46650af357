"""The rendezvous store and its RPC transport: ops, waits, deadlines, auth, bad input, processes.

Every test is bounded (pytest-timeout plus explicit deadlines), takes ports from the OS and
checks that no ringcomm thread outlives it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringcomm
from ringcomm.errors import (
    AuthenticationError,
    CommTimeoutError,
    RendezvousError,
    RingcommError,
)
from ringcomm.rendezvous import Store, StoreServer
from ringcomm.transport.rpc import (
    RpcAuthError,
    RpcCall,
    RpcClient,
    RpcConnectionLost,
    RpcRemoteError,
    RpcServer,
    RpcTimeoutError,
    tcp_endpoint,
)
from ringcomm.transport.session import job_key, session_key

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"


def _ringcomm_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("ringcomm-")}


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every server/client thread a test starts is gone when it ends (sockets closed)."""
    before = _ringcomm_threads()
    yield
    deadline = time.monotonic() + 5.0
    while _ringcomm_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    leaked = _ringcomm_threads() - before
    assert not leaked, f"leaked threads: {leaked}"


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(HOST, 0) as srv:
        yield srv


@pytest.fixture
def store(server: StoreServer) -> Iterator[Store]:
    with Store(HOST, server.port, timeout_s=10, label="rank 0") as client:
        yield client


def _eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def _free_port() -> int:
    """A port nothing listens on (bound and released at once)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[RingcommError]]:
    """Run ``fn`` in a started thread; the RingcommError it raises lands in the list."""
    errors: list[RingcommError] = []

    def run() -> None:
        try:
            fn()
        except RingcommError as exc:  # reported to the test thread
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, errors


def _lost_message(label: str, what: str, port: int) -> str:
    return (
        f"{label}, {what}: lost the connection to the store at {HOST}:{port} "
        "(its host closed or died)"
    )


# -- basic operations ----------------------------------------------------------------------


def test_set_get_try_get(store: Store) -> None:
    store.set("a", b"hello")
    assert store.get("a") == b"hello"
    assert store.try_get("a") == b"hello"
    assert store.try_get("missing") is None
    store.set("a", bytearray(b"again"))
    assert store.get("a") == b"again"
    store.set("s", "text")  # str values are stored as UTF-8
    assert store.get("s") == b"text"
    store.set("empty", b"")
    assert store.get("empty") == b""


def test_bad_argument_types(store: Store) -> None:
    with pytest.raises(TypeError):
        store.set(1, b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.set("k", 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.wait("abc")
    with pytest.raises(TypeError):
        store.add("n", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.get("k", timeout_s=-1)


def test_add(store: Store) -> None:
    assert store.add("n") == 1
    assert store.add("n", 41) == 42
    assert store.add("n", -50) == -8
    assert store.get("n") == b"-8"  # decimal ASCII, like torch
    store.set("m", b"10")
    assert store.add("m", 5) == 15
    store.set("text", b"not a number")
    with pytest.raises(ValueError, match="not an integer"):
        store.add("text")


def test_concurrent_adds_sum_exactly(server: StoreServer) -> None:
    threads_n, adds_n = 8, 50
    clients = [Store(HOST, server.port, timeout_s=10) for _ in range(threads_n // 2)]
    shared = clients[0]  # half the threads share one client: it must be thread-safe
    results: list[int] = []
    lock = threading.Lock()

    def worker(client: Store) -> None:
        mine = [client.add("counter", 1) for _ in range(adds_n)]
        with lock:
            results.extend(mine)

    targets = clients + [shared] * (threads_n - len(clients))
    threads = [threading.Thread(target=worker, args=(c,)) for c in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert shared.get("counter") == str(threads_n * adds_n).encode()
    assert sorted(results) == list(range(1, threads_n * adds_n + 1))  # each value seen once
    for c in clients:
        c.close()


def test_delete_and_check(store: Store) -> None:
    store.set("x", b"1")
    store.set("y", b"2")
    assert store.check(["x", "y"])
    assert store.check([])
    assert store.delete("x") is True
    assert store.delete("x") is False
    assert not store.check(["x", "y"])
    assert store.check(["y"])
    assert store.try_get("x") is None


def test_compare_set(store: Store) -> None:
    # Missing key with expected None (or b""): swap; the value now stored comes back.
    assert store.compare_set("k", None, b"v1") == b"v1"
    assert store.compare_set("k", b"wrong", b"v2") == b"v1"  # mismatch: current value
    assert store.compare_set("k", None, b"v2") == b"v1"  # key exists, None does not match
    assert store.compare_set("k", b"v1", b"v2") == b"v2"  # match: swapped
    assert store.get("k") == b"v2"
    assert store.compare_set("e", b"", b"x") == b"x"  # torch's "" means "absent"
    # torch: missing key and a non-empty expected value -> expected returned, nothing stored.
    assert store.compare_set("m", b"exp", b"des") == b"exp"
    assert store.try_get("m") is None


def test_prefixes_isolate_keys(store: Store) -> None:
    a = store.prefixed("pg1")
    b = store.prefixed("pg2")
    nested = a.prefixed("sub")
    a.set("k", b"a")
    b.set("k", b"b")
    nested.set("k", b"n")
    assert (a.get("k"), b.get("k"), nested.get("k")) == (b"a", b"b", b"n")
    assert store.try_get("k") is None
    assert store.get("pg1/k") == b"a"
    assert store.get("pg1/sub/k") == b"n"
    assert nested.prefix == "pg1/sub"
    assert a.add("n") == 1 and b.add("n") == 1
    a.wait(["k"], timeout_s=1)
    assert not b.check(["missing"])
    a.close()  # a view's close leaves the shared connection open
    with pytest.raises(RendezvousError, match="closed"):
        a.get("k")
    assert b.get("k") == b"b"


def test_prefix_given_at_construction(server: StoreServer) -> None:
    with (
        Store(HOST, server.port, prefix="job7", timeout_s=5) as s,
        Store(HOST, server.port, timeout_s=5) as root,
    ):
        s.set("x", b"1")
        assert root.get("job7/x") == b"1"
        assert s.prefixed("g").prefix == "job7/g"


# -- waiting ---------------------------------------------------------------------------------


def test_get_waits_for_a_later_set_on_the_same_client(store: Store) -> None:
    """One thread blocked in get must not hold up another thread using the same client."""

    def later() -> None:
        time.sleep(0.2)
        store.set("late", b"value")

    t = threading.Thread(target=later)
    t.start()
    start = time.monotonic()
    assert store.get("late", timeout_s=10) == b"value"
    assert time.monotonic() - start < 5
    t.join(10)


def test_wait_released_by_sets_from_other_threads(server: StoreServer) -> None:
    keys = [f"k{i}" for i in range(4)]
    released = threading.Event()
    errors: list[RingcommError] = []

    def waiter() -> None:
        with Store(HOST, server.port, timeout_s=10, label="waiter") as s:
            try:
                s.wait(keys, timeout_s=10)
                released.set()
            except RingcommError as exc:  # reported to the test thread
                errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    with Store(HOST, server.port, timeout_s=10) as setter:
        for k in keys[:-1]:
            setter.set(k, b"1")
        assert _eventually(lambda: server.num_waiters == 1)
        assert not released.wait(0.1)  # still one key missing
        setter.add(keys[-1], 1)  # add also releases waiters
    t.join(10)
    assert released.is_set(), errors
    assert server.num_waiters == 0


def test_wait_rechecks_keys_deleted_meanwhile(store: Store, server: StoreServer) -> None:
    store.set("a", b"1")
    done = threading.Event()

    def waiter() -> None:
        store.wait(["a", "b"], timeout_s=10)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert _eventually(lambda: server.num_waiters == 1)
    store.delete("a")
    store.set("b", b"1")  # "a" is gone again: the waiter must keep waiting
    assert not done.wait(0.2)
    store.set("a", b"2")
    assert done.wait(5)
    t.join(5)


def test_many_waiters_on_one_key(server: StoreServer) -> None:
    got: queue.Queue[bytes] = queue.Queue()
    clients = [Store(HOST, server.port, timeout_s=10) for _ in range(3)]

    def waiter(client: Store) -> None:
        got.put(client.get("go", timeout_s=10))

    threads = [threading.Thread(target=waiter, args=(c,)) for c in clients for _ in range(2)]
    for t in threads:
        t.start()
    assert _eventually(lambda: server.num_waiters == len(threads))
    clients[0].set("go", b"now")
    for t in threads:
        t.join(10)
    assert [got.get_nowait() for _ in threads] == [b"now"] * len(threads)
    for c in clients:
        c.close()


def test_get_timeout(store: Store, server: StoreServer) -> None:
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        store.get("never", timeout_s=0.3)
    elapsed = time.monotonic() - start
    assert 0.25 <= elapsed < 3
    message = str(info.value)
    assert "rank 0" in message and "store.get" in message and "'never'" in message
    assert "0.3 s" in message
    assert isinstance(info.value, TimeoutError)
    assert server.num_waiters == 0  # the server forgot the waiter at its deadline
    store.set("never", b"now")  # the store still works after a timeout
    assert store.get("never", timeout_s=1) == b"now"


def test_wait_timeout_names_missing_keys(store: Store, server: StoreServer) -> None:
    store.set("here", b"1")
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"store\.wait.*missing \['gone'\]"):
        store.wait(["here", "gone"], timeout_s=0.2)
    assert time.monotonic() - start < 3
    assert server.num_waiters == 0


def test_zero_timeout_is_a_check(store: Store) -> None:
    store.set("k", b"v")
    assert store.get("k", timeout_s=0) == b"v"
    with pytest.raises(CommTimeoutError):
        store.get("absent", timeout_s=0)


def test_default_timeout_applies_to_get(server: StoreServer) -> None:
    with Store(HOST, server.port, timeout_s=0.3, label="rank 5") as s:
        start = time.monotonic()
        with pytest.raises(CommTimeoutError, match="rank 5"):
            s.get("nothing")
        assert time.monotonic() - start < 3


# -- connection failures, auth, shutdown -----------------------------------------------------


def test_unreachable_server_is_a_rendezvous_error() -> None:
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=f"{HOST}:{port}") as info:
        Store(HOST, port, timeout_s=0.5, label="rank 2")
    assert time.monotonic() - start < 3
    assert "rank 2" in str(info.value)


def test_client_waits_for_a_server_that_starts_late() -> None:
    """Ranks often start before rank 0 serves the store: the first contact waits for it."""
    port = _free_port()
    result: list[bytes] = []

    def client() -> None:
        with Store(HOST, port, timeout_s=10) as s:
            result.append(s.get("hello", timeout_s=10))

    t = threading.Thread(target=client)
    t.start()
    time.sleep(0.3)
    with StoreServer(HOST, port) as srv, Store(HOST, srv.port, timeout_s=5) as s:
        s.set("hello", b"world")
        t.join(10)
    assert result == [b"world"]


@pytest.mark.parametrize("client_token", ["wrong", None, ""])
def test_bad_token_is_refused(client_token: str | None) -> None:
    with StoreServer(HOST, 0, token="s3cret") as srv:
        with pytest.raises(AuthenticationError, match=f"{HOST}:{srv.port}"):
            Store(HOST, srv.port, token=client_token, timeout_s=5)
        assert srv.rejected == 1
        with Store(HOST, srv.port, token="s3cret", timeout_s=5) as good:
            good.set("k", b"secret value")
            assert good.get("k") == b"secret value"
        assert srv.rejected == 1


def _session_client(srv: StoreServer, token: str | None = None) -> RpcClient:
    """A raw RPC client with a session of the store's (or ``token``'s) key."""
    raw = RpcClient(f"tcp://{HOST}:{srv.port}")
    cn = os.urandom(16)
    reply = raw.call({"op": "hello", "cn": cn}, 5)
    token = token or srv.token
    assert token is not None
    raw.set_session(cn, session_key(job_key(token, b"store"), cn, reply["sn"]))
    return raw


def test_bad_token_never_gets_data() -> None:
    """Every request is checked, not just the first; the answer carries no data: unsigned
    requests, requests signed with another token's key, and a replayed signed request."""
    with StoreServer(HOST, 0, token="s3cret") as srv:
        with Store(HOST, srv.port, token="s3cret", timeout_s=5) as good:
            good.set("k", b"secret value")
        with RpcClient(f"tcp://{HOST}:{srv.port}") as raw:
            for body in (
                {"op": "get", "key": "k", "timeout_s": 1.0, "token": "s3cret"},
                {"op": "try_get", "key": "k"},
                {"op": "set", "key": "k", "value": b"evil", "token": 5},
            ):
                assert raw.call(body, 5)["status"] == "auth"
        assert srv.rejected == 3
        with (
            _session_client(srv, token="wrong") as raw,
            pytest.raises(RpcAuthError, match="token mismatch"),
        ):
            raw.call({"op": "try_get", "key": "k"}, 5)
        assert srv.rejected == 4 and srv.refused == 1
        # A signed request replayed as it was seen on the wire (same id, same signature).
        with _session_client(srv) as raw:
            assert raw.call({"op": "try_get", "key": "k"}, 5)["value"] == b"secret value"
            ctx = zmq.Context()
            spy = ctx.socket(zmq.DEALER)
            spy.setsockopt(zmq.LINGER, 0)
            try:
                spy.connect(f"tcp://{HOST}:{srv.port}")
                head_payload = _last_request(raw)
                spy.send_multipart(head_payload)
                assert spy.poll(5000)
                reply = msgpack.unpackb(spy.recv_multipart()[1])
                assert reply.get("refused") == "replayed request" and "body" not in reply
            finally:
                spy.close()
                ctx.term()
        assert srv.refused == 2
        with Store(HOST, srv.port, token="s3cret", timeout_s=5) as good:
            assert good.get("k") == b"secret value"


def _last_request(raw: RpcClient) -> list[bytes]:
    """The frames of a signed request ``raw`` would send (what a sniffer copies): built the
    way the client signs, for the id the client used last."""
    from ringcomm.transport.session import mac

    cn, key = raw._session  # type: ignore[misc]  # the test plays the sniffer
    request_id = next(raw._ids) - 1  # type: ignore[attr-defined]
    payload = msgpack.packb({"id": request_id, "body": {"op": "try_get", "key": "k"}})
    signed = request_id.to_bytes(8, "little")
    return [cn + signed + mac(key, b"request", signed, payload), payload]


def test_server_without_auth_accepts_anyone() -> None:
    with StoreServer(HOST, 0, auth=False) as srv:
        with Store(HOST, srv.port, auth=False, timeout_s=5) as s:
            s.set("k", b"v")
            assert s.get("k") == b"v" and s.token is None
        with pytest.raises(AuthenticationError, match="token mismatch"):
            Store(HOST, srv.port, token="anything", timeout_s=5)


def test_minted_token_is_handed_out_and_checked(server: StoreServer) -> None:
    """A server made without a token mints one and hands it to a client without one (a
    sealed key exchange); a client with another token is told of the mismatch, and so
    is the server (counted, with the address)."""
    assert server.token is not None and len(server.token) == 64
    with Store(HOST, server.port, timeout_s=5, label="rank 1") as s:
        assert s.token == server.token
        s.set("k", b"v")
    with pytest.raises(AuthenticationError, match="token mismatch"):
        Store(HOST, server.port, token="another job's", timeout_s=5)
    assert server.refused == 1 and server.refused_from == HOST
    assert "token mismatch" in server.refusals()
    with pytest.raises(AuthenticationError, match="RINGCOMM_SECURITY=none"):
        Store(HOST, server.port, auth=False, timeout_s=5)


def test_claims_get_the_token_once() -> None:
    """``issue={claims}``: each claim receives the minted token once, nobody else does."""
    with StoreServer(HOST, 0, issue={"rank 1", "rank 2"}) as srv:
        with Store(HOST, srv.port, timeout_s=5, claim="rank 1") as s:
            assert s.token == srv.token
        with pytest.raises(AuthenticationError, match="rank 1 already received"):
            Store(HOST, srv.port, timeout_s=5, claim="rank 1")
        with pytest.raises(AuthenticationError, match="not a member still to join"):
            Store(HOST, srv.port, timeout_s=5, claim="rank 7")
        with pytest.raises(AuthenticationError, match="not a member"):
            Store(HOST, srv.port, timeout_s=5)
        with Store(HOST, srv.port, timeout_s=5, claim="rank 2") as s:
            assert s.token == srv.token
    with (
        StoreServer(HOST, 0, token="given") as srv,  # a given token is never handed out
        pytest.raises(AuthenticationError, match="hands out no token"),
    ):
        Store(HOST, srv.port, timeout_s=5, claim="rank 1")


def test_no_token_bytes_on_the_wire() -> None:
    """What a client sends for a whole session (hello, sets, gets) never holds the token,
    in any encoding, whether the client had it or received it (a sniffer's view)."""
    with StoreServer(HOST, 0) as srv:
        token = srv.token
        assert token is not None
        with _Recorder(srv.port) as rec:
            with Store(HOST, rec.port, timeout_s=5) as s:  # receives it
                s.set("a", b"1")
                assert s.get("a") == b"1"
            with Store(HOST, rec.port, token=token, timeout_s=5) as s:  # has it
                s.set("b", b"2")
                assert s.check(["a", "b"])
        wire = rec.bytes()
        assert len(wire) > 200  # the capture saw the traffic
        for form in (token.encode(), bytes.fromhex(token), token.upper().encode()):
            assert form not in wire


class _Recorder:
    """A TCP relay on a port of its own that keeps every byte passing either way."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._listener = socket.create_server((HOST, 0))
        self.port = int(self._listener.getsockname()[1])
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((HOST, self._target))
            self._socks += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                with self._lock:
                    self._chunks.append(data)
                dst.sendall(data)
            except OSError:
                break
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def bytes(self) -> bytes:
        with self._lock:
            return b"".join(self._chunks)

    def __enter__(self) -> _Recorder:  # noqa: PYI034 (a test helper, never subclassed)
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for t in self._threads:
            t.join(5)
        self._accept.join(5)


@pytest.mark.timeout(30)
def test_server_close_fails_a_parked_wait_at_once() -> None:
    """A wait parked on a server that closes fails at once, not after its 60 s deadline."""
    srv = StoreServer(HOST, 0).start()
    client = Store(HOST, srv.port, timeout_s=60, label="rank 1")
    t, errors = _in_thread(lambda: client.wait(["never"], timeout_s=60))
    try:
        assert _eventually(lambda: srv.num_waiters == 1)
        start = time.monotonic()
        srv.close()
        t.join(10)
        elapsed = time.monotonic() - start
        assert not t.is_alive()
        assert elapsed < 1.5, f"the parked wait failed only after {elapsed:.2f} s"
        assert len(errors) == 1
        assert isinstance(errors[0], RendezvousError)
        assert str(errors[0]) == _lost_message("rank 1", "op store.wait, keys ['never']", srv.port)
    finally:
        client.close()
        srv.close()
        t.join(10)


@pytest.mark.timeout(30)
def test_calls_after_the_server_closed_fail_at_once() -> None:
    """Nothing is queued while the connection is down: each call fails at once."""
    srv = StoreServer(HOST, 0).start()
    try:
        with Store(HOST, srv.port, timeout_s=60, label="rank 1") as client:
            client.set("k", b"v")
            srv.close()
            calls: list[tuple[str, Callable[[], object]]] = [
                ("op store.add, key '__closed__'", lambda: client.add("__closed__", 1)),
                ("op store.get, key 'k'", lambda: client.get("k")),
                ("op store.wait, keys ['k']", lambda: client.wait(["k"], timeout_s=60)),
                ("op store.set, key 'k'", lambda: client.set("k", b"w")),
            ]
            for what, call in calls:
                start = time.monotonic()
                with pytest.raises(RendezvousError) as info:
                    call()
                elapsed = time.monotonic() - start
                assert elapsed < 1.5, f"{what} failed only after {elapsed:.2f} s"
                assert str(info.value) == _lost_message("rank 1", what, srv.port)
    finally:
        srv.close()


def test_close_is_idempotent(server: StoreServer) -> None:
    s = Store(HOST, server.port, timeout_s=5)
    view = s.prefixed("p")
    view.close()
    view.close()
    s.close()
    s.close()
    with pytest.raises(RendezvousError, match="closed"):
        s.set("k", b"v")
    server.close()
    server.close()
    never_started = StoreServer(HOST, 0)
    never_started.close()
    never_started.close()


def test_bind_failure_is_a_rendezvous_error(server: StoreServer) -> None:
    with pytest.raises(RendezvousError, match=str(server.port)):
        StoreServer(HOST, server.port)


def test_port_validation() -> None:
    with pytest.raises(ValueError):
        Store(HOST, 0)
    with pytest.raises(ValueError):
        Store(HOST, 70000)


# -- malformed input -------------------------------------------------------------------------

MALFORMED: list[list[bytes]] = [
    [b"\xc1"],  # not msgpack (0xc1 is never used)
    [b""],  # empty frame
    [msgpack.packb({"id": 1, "body": {"op": "ping"}}), b"extra"],  # wrong frame count
    [msgpack.packb([1, 2, 3])],  # not a map
    [msgpack.packb({"id": "1", "body": {"op": "ping"}})],  # id not an int
    [msgpack.packb({"id": True, "body": {"op": "ping"}})],  # bool is not an id
    [msgpack.packb({"id": 1, "body": [1]})],  # body not a map
    [msgpack.packb({"id": 1})],  # no body
    [msgpack.packb({"id": 1, "body": {}, "x": 0})],  # unknown envelope field
    [msgpack.packb({"id": 1, "body": {1: 2}}, strict_types=False)],  # non-str body key
    [msgpack.packb({"id": 1, "body": {}}) + b"trailing"],  # extra data
    [b"\x92" + b"\x91" * 10000],  # deep nesting
]


def test_malformed_frames_are_dropped_and_counted(server: StoreServer, store: Store) -> None:
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(f"tcp://{HOST}:{server.port}")
        for frames in MALFORMED:
            raw.send_multipart(frames)
        assert _eventually(lambda: server.dropped == len(MALFORMED))
        assert raw.poll(200) == 0  # nothing is answered
    finally:
        raw.close()
        ctx.term()
    store.set("still", b"serving")
    assert store.get("still") == b"serving"


def test_bad_request_with_valid_envelope_gets_an_error(server: StoreServer) -> None:
    with _session_client(server) as raw:
        for body in (
            {"op": "nope"},
            {"op": "set", "key": 1, "value": b"x"},
            {"op": "get", "key": "k", "timeout_s": "soon"},
            {"op": "get", "key": "k", "timeout_s": float("inf")},
            {"op": "wait", "keys": "k", "timeout_s": 1.0},
            {"op": "add", "key": "k", "delta": True},
            {"op": "compare_set", "key": "k", "expected": 1, "desired": b"x"},
        ):
            reply = raw.call(body, 5)
            assert reply["status"] == "error", body
    assert server.bad_requests == 7
    assert server.num_waiters == 0


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_random_frames_never_break_the_server(
    server: StoreServer, store: Store, frames: list[bytes]
) -> None:
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(f"tcp://{HOST}:{server.port}")
        raw.send_multipart(frames)
        raw.poll(20)  # an answer is possible only for a (rare) well-formed request
    finally:
        raw.close()
        ctx.term()
    assert store.add("alive") >= 1


# -- the RPC layer itself ------------------------------------------------------------------


def test_rpc_stale_replies_are_discarded() -> None:
    """A reply that arrives after its caller gave up is dropped, not given to the next call."""
    servers: list[RpcServer] = []

    def handler(call: RpcCall) -> dict[str, object] | None:
        if call.body.get("slow"):
            srv = servers[0]
            srv.call_later(0.3, lambda: srv.reply(call, {"answer": "late"}))
            return None
        return {"answer": call.body["n"]}

    servers.append(RpcServer(handler, HOST, 0, name="ringcomm-test-rpc"))
    with servers[0] as server, RpcClient(server.endpoint, name="ringcomm-test-client") as client:
        with pytest.raises(RpcTimeoutError):
            client.call({"slow": True}, 0.05)
        time.sleep(0.4)  # the late reply arrives now
        assert client.call({"n": 1}, 5) == {"answer": 1}
        assert client.stale == 1


def test_rpc_handler_exception_is_reported_and_server_survives() -> None:
    def handler(call: RpcCall) -> dict[str, object] | None:
        if call.body.get("boom"):
            raise RuntimeError("kaboom")
        return {"ok": True}

    with (
        RpcServer(handler, HOST, 0, name="ringcomm-test-rpc") as server,
        RpcClient(server.endpoint, name="ringcomm-test-client") as client,
    ):
        with pytest.raises(RpcRemoteError, match="RuntimeError: kaboom"):
            client.call({"boom": True}, 5)
        assert client.call({}, 5) == {"ok": True}
        assert server.errors == 1


def test_rpc_reply_from_another_thread() -> None:
    parked: queue.Queue[RpcCall] = queue.Queue()
    with (
        RpcServer(parked.put, HOST, 0, name="ringcomm-test-rpc") as server,
        RpcClient(server.endpoint, name="ringcomm-test-client") as client,
    ):
        replier = threading.Thread(
            target=lambda: server.reply(parked.get(timeout=5), {"from": "thread"})
        )
        replier.start()
        assert client.call({}, 5) == {"from": "thread"}
        replier.join(5)


def test_rpc_close_wakes_waiting_callers_and_is_quick() -> None:
    with RpcServer(lambda call: None, HOST, 0, name="ringcomm-test-rpc") as server:
        client = RpcClient(server.endpoint, name="ringcomm-test-client")
        errors: list[RingcommError] = []

        def caller() -> None:
            try:
                client.call({}, 30)
            except RingcommError as exc:  # reported to the test thread
                errors.append(exc)

        t = threading.Thread(target=caller)
        t.start()
        time.sleep(0.1)
        start = time.monotonic()
        client.close()
        t.join(5)
        assert time.monotonic() - start < 2
        assert errors and "closed" in str(errors[0])
        start = time.monotonic()
    assert time.monotonic() - start < 2  # server close does not wait out a poll timeout


@pytest.mark.timeout(30)
def test_rpc_connection_loss_fails_calls_until_reconnected() -> None:
    port = _free_port()
    parked: queue.Queue[RpcCall] = queue.Queue()

    def handler(call: RpcCall) -> dict[str, object] | None:
        if call.body.get("park"):
            parked.put(call)  # never answered
            return None
        return {"ok": True}

    server = RpcServer(handler, HOST, port, name="ringcomm-test-rpc").start()
    client = RpcClient(server.endpoint, name="ringcomm-test-client")
    t, errors = _in_thread(lambda: client.call({"park": True}, 60))
    try:
        assert client.call({}, 5) == {"ok": True}
        assert client.connected and client.losses == 0
        parked.get(timeout=5)
        start = time.monotonic()
        server.close()
        t.join(10)
        assert not t.is_alive() and time.monotonic() - start < 1.5
        assert len(errors) == 1 and isinstance(errors[0], RpcConnectionLost)
        assert str(errors[0]) == (
            f"ringcomm-test-client: lost the connection to tcp://{HOST}:{port} "
            "(the server closed or died)"
        )
        assert not client.connected and client.losses == 1
        start = time.monotonic()
        with pytest.raises(RpcConnectionLost):
            client.call({}, 60)  # while down: at once, not queued
        assert time.monotonic() - start < 0.5
        # libzmq keeps reconnecting: a server on the same port makes calls work again.
        with RpcServer(handler, HOST, port, name="ringcomm-test-rpc"):
            assert _eventually(lambda: client.connected, 10)
            assert client.call({}, 5) == {"ok": True}
            assert client.losses == 1
    finally:
        client.close()
        server.close()
        t.join(10)


def test_rpc_drops_before_any_handshake_are_not_a_loss() -> None:
    """First contact: a port that accepts TCP but never completes a ZMTP handshake (here: a
    listener that closes every connection) is "not up yet", so calls wait their deadline;
    a real server on that port later is reached."""
    listener = socket.create_server((HOST, 0))
    listener.settimeout(0.05)
    port = int(listener.getsockname()[1])
    stop = threading.Event()
    accepted: list[int] = []

    def refuse_zmtp() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            conn.close()

    refuser = threading.Thread(target=refuse_zmtp)
    refuser.start()
    client = RpcClient(tcp_endpoint(HOST, port), name="ringcomm-test-client")
    try:
        start = time.monotonic()
        with pytest.raises(RpcTimeoutError):
            client.call({}, 1.0)
        assert time.monotonic() - start >= 0.9
        assert accepted, "the client never connected"
        assert client.losses == 0 and not client.connected
        stop.set()
        refuser.join(5)
        listener.close()
        with RpcServer(lambda call: {"ok": True}, HOST, port, name="ringcomm-test-rpc"):
            assert client.call({}, 10) == {"ok": True}
            assert client.losses == 0
    finally:
        stop.set()
        refuser.join(5)
        listener.close()
        client.close()


def test_rpc_client_close_leaves_a_shared_context_free_to_terminate() -> None:
    """close() closes the monitor socket too; ctx.term() would hang on it otherwise."""
    ctx = zmq.Context()
    with RpcServer(lambda call: {"ok": True}, HOST, 0, name="ringcomm-test-rpc") as server:
        client = RpcClient(server.endpoint, context=ctx, name="ringcomm-test-client")
        assert client.call({}, 5) == {"ok": True}
        start = time.monotonic()
        client.close()
        client.close()
        assert time.monotonic() - start < 2
    terminator = threading.Thread(target=ctx.term, daemon=True)
    terminator.start()
    terminator.join(5)
    assert not terminator.is_alive(), "ctx.term() hangs: a socket of the client is still open"


# -- several processes -------------------------------------------------------------------------

# A store server in a process of its own: prints its port, then "parked" once a get/wait is
# parked on it, then serves until it is killed.
_SERVE_SCRIPT = """
import sys, time
from ringcomm.rendezvous import StoreServer
server = StoreServer("127.0.0.1", 0).start()
print(server.port, flush=True)
while server.num_waiters == 0:
    time.sleep(0.01)
print("parked", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _server_process() -> Iterator[tuple[subprocess.Popen[str], int, queue.Queue[str]]]:
    """(process, port, its later stdout lines); the process is killed on the way out."""
    env = dict(os.environ)
    root = str(Path(ringcomm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield proc, int(lines.get(timeout=20)), lines
    finally:
        proc.kill()  # also ends a stopped (SIGSTOP) process
        proc.wait(10)
        reader.join(5)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.mark.timeout(30)
def test_killed_server_process_fails_the_pending_call_fast() -> None:
    """The process hosting the store is SIGKILLed: its kernel closes the connection, the
    pending wait and later calls fail at once instead of waiting out 60 s."""
    with (
        _server_process() as (proc, port, lines),
        Store(HOST, port, timeout_s=60, label="rank 3") as client,
    ):
        t, errors = _in_thread(lambda: client.wait(["never"], timeout_s=60))
        try:
            assert lines.get(timeout=10) == "parked"
            start = time.monotonic()
            proc.kill()
            t.join(10)
            elapsed = time.monotonic() - start
            assert not t.is_alive()
            assert elapsed < 1.5, f"the pending wait failed only after {elapsed:.2f} s"
            assert len(errors) == 1
            assert str(errors[0]) == _lost_message("rank 3", "op store.wait, keys ['never']", port)
            start = time.monotonic()
            with pytest.raises(RendezvousError, match="lost the connection"):
                client.add("__closed__", 1)
            assert time.monotonic() - start < 1.5
        finally:
            proc.kill()
            t.join(10)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_silent_server_is_noticed_by_heartbeats() -> None:
    """A frozen server host (SIGSTOP: its kernel keeps the TCP connection open, so only the
    ZMTP heartbeats can tell) fails the pending wait after the 4 s heartbeat timeout."""
    with (
        _server_process() as (proc, port, lines),
        Store(HOST, port, timeout_s=60, label="rank 3") as client,
    ):
        t, errors = _in_thread(lambda: client.wait(["never"], timeout_s=60))
        try:
            assert lines.get(timeout=10) == "parked"
            start = time.monotonic()
            proc.send_signal(signal.SIGSTOP)
            t.join(15)
            elapsed = time.monotonic() - start
            assert not t.is_alive()
            assert 2.0 < elapsed < 8.0, f"the pending wait failed after {elapsed:.2f} s"
            assert len(errors) == 1
            assert str(errors[0]) == _lost_message("rank 3", "op store.wait, keys ['never']", port)
        finally:
            proc.kill()
            t.join(10)


def _rank_main(port: int, rank: int, world_size: int, results: mp.Queue) -> None:  # type: ignore[type-arg]
    """One process of the multi-process test: arrive, publish, wait for everyone, read all."""
    with Store(HOST, port, timeout_s=30, label=f"rank {rank}") as store:
        arrival = store.add("arrived", 1)
        store.set(f"rank/{rank}", str(rank * 10).encode())
        store.wait([f"rank/{r}" for r in range(world_size)], timeout_s=30)
        seen = [int(store.get(f"rank/{r}")) for r in range(world_size)]
        results.put((rank, arrival, seen))


def test_multi_process_add_and_wait(server: StoreServer) -> None:
    world_size = 4
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(server.port, r, world_size, results), daemon=True)
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=45) for _ in range(world_size)]
        for p in procs:
            p.join(10)
        assert [p.exitcode for p in procs] == [0] * world_size
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
        results.join_thread()
    assert sorted(arrival for _, arrival, _ in got) == list(range(1, world_size + 1))
    for _, _, seen in got:
        assert seen == [r * 10 for r in range(world_size)]
    with Store(HOST, server.port, timeout_s=5) as s:
        assert s.get("arrived") == str(world_size).encode()
