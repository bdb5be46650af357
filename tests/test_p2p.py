"""Point-to-point: send/recv/isend/irecv between real ranks (rc.spawn).

Most cases run in one spawned 3-rank job (``run_cases``: each case in its own sub-group,
so its own tag space) and are reported as one pytest test each; the ring over world sizes
1-8 and the 64 MiB transfer are jobs of their own. Every rank runs the same case body and
computes what it expects from its rank (the mpi4py habit); rank 2 idles in two-party cases.
"""

from __future__ import annotations

import random
import time
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from conftest import case_report, run_cases

import ringcomm as rc
from ringcomm.transport.wire import SUPPORTED_DTYPES

pytestmark = pytest.mark.usefixtures("no_child_processes")

DTYPES = list(SUPPORTED_DTYPES)
SHAPES = [(0,), (1,), (1001,), (3, 5, 7), (), (2, 0, 3), (4, 1)]


def pattern(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Deterministic contents using every bit pattern (NaN payloads, -0.0, extremes)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt == np.bool_:
        flat = rng.integers(0, 2, n).astype(bool)
    else:
        flat = np.frombuffer(rng.bytes(n * dt.itemsize), dtype=dt).copy()
    return flat.reshape(shape)


def garbage_like(a: np.ndarray) -> np.ndarray:
    """A writable buffer like ``a`` filled with 0xAB bytes (so a missed write shows)."""
    return np.frombuffer(b"\xab" * a.nbytes, dtype=a.dtype).reshape(a.shape).copy()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def wait_until(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


# --- cases (run on every rank of a 3-rank job, each in a fresh sub-group) ---------------


def case_every_dtype_and_shape(pg: rc.ProcessGroup) -> None:
    """All 12 dtypes x sizes 0, 1, 1001, multi-dim, 0-d; one piece, then many tiny pieces."""
    matrix = [(dt, shape) for dt in DTYPES for shape in SHAPES]
    tag = 0
    for chunk_bytes in (1 << 20, 100):
        pg.chunk_bytes = chunk_bytes
        for i, (dt, shape) in enumerate(matrix):
            expected = pattern(dt, shape, seed=i)
            if pg.rank == 0:
                expected.flags.writeable = False  # read-only arrays may be sent
                pg.send(expected, dst=1, tag=tag)
            elif pg.rank == 1:
                got = garbage_like(expected)
                out = pg.recv(got, src=0, tag=tag)
                assert out is got
                assert same(got, expected), f"{dt}{list(shape)} chunk_bytes={chunk_bytes}"
            tag += 1


def case_many_tags_out_of_order(pg: rc.ProcessGroup) -> None:
    """isend tags 0..49 in order; irecv 49..25 before they are sent (posted receives) and
    0..24 shuffled after they arrived (unexpected queue); every value lands in its buffer."""
    ntags = 50

    def value(tag: int) -> np.ndarray:
        return np.arange(tag + 1, dtype=np.int64) * 1000 + tag  # sizes differ by tag

    if pg.rank == 0:
        pg.recv(np.zeros(1, np.int64), src=1, tag=1000)  # rank 1 posted its early irecvs
        works = [pg.isend(value(t), dst=1, tag=t) for t in range(ntags)]
        for w in works:
            w.wait()
    elif pg.rank == 1:
        bufs = {t: np.full(t + 1, -1, np.int64) for t in range(ntags)}
        early = list(range(ntags - 1, ntags // 2 - 1, -1))
        works = {t: pg.irecv(bufs[t], src=0, tag=t) for t in early}
        pg.send(np.zeros(1, np.int64), dst=0, tag=1000)
        works[ntags - 1].wait()  # sent last: tags 0..24 are all here, unmatched
        late = list(range(ntags // 2))
        random.Random(7).shuffle(late)
        for t in late:
            works[t] = pg.irecv(bufs[t], src=0, tag=t)
        for t in early + late:
            assert works[t].wait() is bufs[t]
            np.testing.assert_array_equal(bufs[t], value(t), err_msg=f"tag {t}")


NO_OVERTAKING_SEQ = "sbsbbsesbs"  # small, big (multi-piece), empty; all on one tag


def seq_message(kind: str, i: int, src: int) -> np.ndarray:
    if kind == "s":
        return np.full(3, 100 * src + i, np.float64)
    if kind == "b":
        return np.arange(60_000, dtype=np.float64) + 1e6 * i + 1e8 * src
    return np.zeros(0, np.float64)


def case_same_tag_no_overtaking(pg: rc.ProcessGroup) -> None:
    """Ranks 0 and 2 each isend a mix of big multi-piece, small and empty messages on one
    tag; rank 1 receives them (some posted early, some after arrival) in the order sent."""
    tag = 7
    for chunk_bytes in (100_000, 4096):  # zero-copy pieces, then many copied pieces
        pg.chunk_bytes = chunk_bytes
        if pg.rank in (0, 2):
            msgs = [seq_message(k, i, pg.rank) for i, k in enumerate(NO_OVERTAKING_SEQ)]
            works = [pg.isend(m, dst=1, tag=tag) for m in msgs]
            for w in works:
                w.wait()
        else:
            half = len(NO_OVERTAKING_SEQ) // 2
            for src in (0, 2):
                expected = [seq_message(k, i, src) for i, k in enumerate(NO_OVERTAKING_SEQ)]
                bufs = [np.full_like(e, -1.0) for e in expected]
                works = [pg.irecv(bufs[i], src=src, tag=tag) for i in range(half)]
                works[-1].wait()
                for i in range(half, len(bufs)):
                    pg.recv(bufs[i], src=src, tag=tag)
                for w in works:
                    w.wait()
                for i, (b, e) in enumerate(zip(bufs, expected)):
                    assert same(b, e), f"message {i} from {src}, chunk_bytes={chunk_bytes}"


def case_isend_irecv_overlap(pg: rc.ProcessGroup) -> None:
    """Every rank irecvs from and isends to every other rank, computes, then polls done()
    (no wait) until all finish; wait() then returns the receive buffer."""
    n = 200_000  # 1.6 MB: several zero-copy pieces at 256 KiB
    pg.chunk_bytes = 256 * 1024
    r = pg.rank
    peers = [p for p in range(pg.world_size) if p != r]
    rbufs = {p: np.full(n, -1.0) for p in peers}
    rworks = {p: pg.irecv(rbufs[p], src=p, tag=11) for p in peers}
    sbufs = {p: np.arange(n, dtype=np.float64) * (r + 1) + p for p in peers}
    sworks = {p: pg.isend(sbufs[p], dst=p, tag=11) for p in peers}
    a = np.random.default_rng(r).random((150, 150))
    for _ in range(5):  # compute while the transfers move
        a = a @ a / 150.0
    works = [*rworks.values(), *sworks.values()]
    wait_until(lambda: all(w.done() for w in works), 10.0, f"{works}")
    assert all(w.is_completed() for w in works)
    for p, w in rworks.items():
        assert w.exception() is None and "done" in repr(w)
        assert w.wait() is rbufs[p]
        np.testing.assert_array_equal(rbufs[p], np.arange(n, dtype=np.float64) * (p + 1) + r)
    for w in sworks.values():
        assert w.wait() is None


def case_send_to_self(pg: rc.ProcessGroup) -> None:
    """dst == rank: blocking, async in both orders, multi-piece, empty and 0-d."""
    r = pg.rank
    x = np.arange(10, dtype=np.int32) + r
    y = np.zeros_like(x)
    pg.send(x, dst=r, tag=3)
    assert pg.recv(y, src=r, tag=3) is y
    np.testing.assert_array_equal(y, x)
    y2 = np.zeros_like(x)
    w = pg.irecv(y2, src=r, tag=4)  # posted first
    s = pg.isend(x * 2, dst=r, tag=4)
    s.wait()
    assert w.wait() is y2
    np.testing.assert_array_equal(y2, x * 2)
    pg.chunk_bytes = 1000
    big = np.arange(10_001, dtype=np.float64)
    pg.send(big, dst=r, tag=5)
    big[:] = -1  # the send completed: the buffer is ours again
    out = np.zeros(10_001)
    pg.recv(out, src=r, tag=5)
    np.testing.assert_array_equal(out, np.arange(10_001, dtype=np.float64))
    for e in (np.zeros(0, np.uint8), np.array(7.5, np.float16)):
        g = garbage_like(e)
        pg.send(e, dst=r, tag=6)
        pg.recv(g, src=r, tag=6)
        assert same(g, e)


def case_timeouts_leave_group_usable(pg: rc.ProcessGroup) -> None:
    """recv(timeout_s=0.5) with no sender and Work.wait(timeout_s=0.5) raise a bounded
    CommTimeoutError naming rank, peer, op, tag; the buffers stay untouched and later
    messages on those tags go to later receives."""
    if pg.rank == 1:
        b5, b6, b8 = (np.full(4, -1, np.int32) for _ in range(3))
        t0 = time.monotonic()
        with pytest.raises(rc.CommTimeoutError) as ei:
            pg.recv(b5, src=0, tag=5, timeout_s=0.5)
        elapsed = time.monotonic() - t0
        assert 0.45 <= elapsed < 3.0, elapsed
        assert isinstance(ei.value, TimeoutError)
        for part in ("rank 1", "peer 0", "op recv", "tag 5"):
            assert part in str(ei.value), str(ei.value)

        w = pg.irecv(b6, src=0, tag=6)
        t0 = time.monotonic()
        with pytest.raises(rc.CommTimeoutError) as ei:
            w.wait(timeout_s=0.5)
        assert 0.45 <= time.monotonic() - t0 < 3.0
        for part in ("rank 1", "peer 0", "op recv", "tag 6"):
            assert part in str(ei.value), str(ei.value)
        assert w.done() and isinstance(w.exception(), rc.CommTimeoutError)

        pg.timeout_s = 0.5  # the group's default deadline applies when timeout_s is None
        t0 = time.monotonic()
        with pytest.raises(rc.CommTimeoutError, match="tag 8"):
            pg.recv(b8, src=0, tag=8)
        assert time.monotonic() - t0 < 3.0
        pg.timeout_s = 15.0

        pg.send(np.ones(1, np.int32), dst=0, tag=9)  # now rank 0 sends on 5, 6 and 8
        for tag, expired in ((5, b5), (6, b6), (8, b8)):
            fresh = np.zeros(4, np.int32)
            pg.recv(fresh, src=0, tag=tag)
            np.testing.assert_array_equal(fresh, np.full(4, tag))
            np.testing.assert_array_equal(expired, np.full(4, -1))
    elif pg.rank == 0:
        pg.recv(np.zeros(1, np.int32), src=1, tag=9)
        for tag in (5, 6, 8):
            pg.send(np.full(4, tag, np.int32), dst=1, tag=tag)


def case_mismatch_leaves_buffer_and_stream_intact(pg: rc.ProcessGroup) -> None:
    """Wrong size or dtype -> MessageMismatchError (a CollectiveMismatchError), buffer
    untouched, message discarded; the next message on the same tag arrives intact."""
    pg.chunk_bytes = 1024
    sends = [
        np.full(10, 1, np.float32),  # into float32[11]: wrong size
        np.full(10, 2, np.float32),  # ok
        np.arange(5000, dtype=np.float64),  # into float32[10000]: same bytes, wrong dtype
        np.arange(5000, dtype=np.float64) + 0.5,  # ok (multi-piece)
        np.full(10, 5, np.int32),  # into float32[10] via irecv: wrong dtype
        np.full(10, 6, np.int32),  # ok
    ]
    if pg.rank == 0:
        for x in sends:
            pg.send(x, dst=1, tag=3)
    elif pg.rank == 1:
        for i, wrong in ((0, np.full(11, -7, np.float32)), (2, np.full(10000, -7, np.float32))):
            with pytest.raises(rc.MessageMismatchError) as ei:
                pg.recv(wrong, src=0, tag=3)
            assert isinstance(ei.value, rc.CollectiveMismatchError)
            for part in ("rank 1", "peer 0", "op recv", "tag 3"):
                assert part in str(ei.value), str(ei.value)
            assert (wrong == -7).all(), f"message {i} wrote into a mismatched buffer"
            good = np.zeros_like(sends[i + 1])
            pg.recv(good, src=0, tag=3)
            np.testing.assert_array_equal(good, sends[i + 1])
        wrong = np.full(10, -7, np.float32)
        w = pg.irecv(wrong, src=0, tag=3)
        with pytest.raises(rc.MessageMismatchError):
            w.wait()
        assert isinstance(w.exception(), rc.MessageMismatchError)
        assert (wrong == -7).all()
        good = np.zeros(10, np.int32)
        pg.recv(good, src=0, tag=3)
        np.testing.assert_array_equal(good, sends[5])


def case_bad_arguments_fail_before_sending(pg: rc.ProcessGroup) -> None:
    """Bad arrays, peers, tags and timeouts raise at the call, and nothing is sent."""
    ok = np.zeros(4, np.float32)
    bad_arrays = [
        (np.zeros(8, np.float32)[::2], ValueError),  # non-contiguous
        (np.zeros((3, 4), np.float32, order="F"), ValueError),
        (np.zeros(4, ">i4"), ValueError),  # non-native byte order
        (np.zeros(4, np.complex64), TypeError),
        (np.array([None, 1], dtype=object), TypeError),
        (np.zeros(4, "U3"), TypeError),
        (np.zeros(4, "datetime64[s]"), TypeError),
        ([1.0, 2.0], TypeError),
        (b"abcd", TypeError),
        (memoryview(bytearray(4)), TypeError),
        (None, TypeError),
        (3.0, TypeError),
    ]
    readonly = np.zeros(4, np.float32)
    readonly.flags.writeable = False
    peer = (pg.rank + 1) % pg.world_size
    sent_before = pg.stats()["sent_messages"]
    calls = []
    for x, exc in bad_arrays:
        calls += [(pg.send, (x, peer), exc), (pg.isend, (x, peer), exc)]
        calls += [(pg.recv, (x, peer), exc), (pg.irecv, (x, peer), exc)]
    calls += [(pg.recv, (readonly, peer), ValueError), (pg.irecv, (readonly, peer), ValueError)]
    for fn in (pg.send, pg.isend, pg.recv, pg.irecv):
        for bad_peer, exc in (
            (-1, ValueError),
            (pg.world_size, ValueError),
            (99, ValueError),
            (1.0, TypeError),
            (True, TypeError),
            ("1", TypeError),
        ):
            calls.append((fn, (ok, bad_peer), exc))
        for bad_tag, exc in (
            (-1, ValueError),
            (1 << 63, ValueError),
            (1.5, TypeError),
            ("0", TypeError),
            (None, TypeError),
        ):
            calls.append((fn, (ok, peer, bad_tag), exc))
    for fn, args, exc in calls:
        with pytest.raises(exc) as ei:
            fn(*args)
        assert f"rank {pg.rank}" in str(ei.value), str(ei.value)
    for fn in (pg.send, pg.recv):
        for t in (0, -1.0):
            with pytest.raises(ValueError):
                fn(ok, peer, 0, timeout_s=t)
    assert pg.stats()["sent_messages"] == sent_before, "a rejected call sent something"
    # Nothing stray arrived either: the first message on tag 0 is the real one.
    got = np.zeros(4, np.float32)
    w = pg.irecv(got, src=(pg.rank - 1) % pg.world_size, tag=0)
    pg.send(np.full(4, pg.rank, np.float32), dst=peer, tag=0)
    w.wait()
    np.testing.assert_array_equal(got, np.full(4, (pg.rank - 1) % pg.world_size))


def _junk_frames() -> list[list[bytes]]:
    def header(**kw: Any) -> bytes:
        fields = [1, 1, 0, 0, 2, 0, 0, 1, "<i8", 8, 0, [1], None, None]
        for i, v in kw.items():
            fields[int(i[1:])] = v
        return msgpack.packb(fields, use_bin_type=True)

    payload = np.full(1, 666, np.int64).tobytes()
    return [
        [b"x"],  # one frame
        [b"a", b"b", b"c"],  # three frames
        [header(), payload, b"extra"],  # a valid header, but three frames
        [b"\xc1 not msgpack", payload],
        [b"", payload],
        [msgpack.packb([1, 2, 3]), payload],  # wrong length
        [msgpack.packb({"kind": 1}), payload],
        [header(f0=99), payload],  # wire version
        [header(f1=[]), payload],  # unhashable kind
        [header(f6=1, f7=1), payload],  # piece >= npieces
        [header(f2=-1), payload],  # negative src
        [header(f11="oops"), payload],  # bad shape
    ]


def case_junk_frames_are_dropped_and_counted(pg: rc.ProcessGroup) -> None:
    """A raw zmq socket sends malformed messages to rank 1's data endpoint; rank 1 drops
    and counts each one, and p2p keeps working (nothing reaches a user buffer)."""
    junk = _junk_frames()
    if pg.rank == 1:
        transport = pg.core.progress.transport
        endpoint = transport.ipc_endpoint
        assert endpoint is not None and endpoint.startswith("ipc://")
        said = f"{endpoint} {transport.auth_salt or ''}"  # logins are bound to our salt
        raw = np.frombuffer(said.encode().ljust(256, b"\0"), np.uint8)
        dropped_before = pg.stats()["dropped_frames"]
        buf = np.full(1, -1, np.int64)
        w = pg.irecv(buf, src=0, tag=2)  # posted: junk must not complete it
        pg.send(raw, dst=0, tag=1)
        pg.recv(np.zeros(1, np.uint8), src=0, tag=1)  # rank 0 sent all junk
        wait_until(
            lambda: w.done() or pg.stats()["dropped_frames"] - dropped_before >= len(junk),
            10.0,
            "the junk to be dropped",
        )
        assert not w.done(), f"junk completed a receive: {w!r} {buf}"
        assert pg.stats()["dropped_frames"] - dropped_before == len(junk)
        assert (buf == -1).all()
        pg.send(np.zeros(1, np.uint8), dst=0, tag=1)  # now the real message
        assert w.wait() is buf
        assert buf[0] == 12345
        assert pg.stats()["dropped_frames"] - dropped_before == len(junk)
    elif pg.rank == 0:
        raw = np.zeros(256, np.uint8)
        pg.recv(raw, src=1, tag=1)
        endpoint, _, salt = raw.tobytes().rstrip(b"\0").decode().partition(" ")
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            if salt:  # the data plane admits only a login made with the job's token
                from ringcomm.transport.session import plain_login
                from ringcomm.transport.zmq_transport import data_plane_credentials

                token = pg.core.state.config.token
                assert token is not None
                creds = data_plane_credentials(token)
                username, password = plain_login(creds["plain_key"], bytes.fromhex(salt), 0)
                sock.setsockopt(zmq.PLAIN_USERNAME, username)
                sock.setsockopt(zmq.PLAIN_PASSWORD, password)
            sock.connect(endpoint)
            for frames in junk:
                sock.send_multipart(frames)
            sock.close()
        finally:
            ctx.term()  # returns once the queued frames are delivered (LINGER bounds it)
        pg.send(np.zeros(1, np.uint8), dst=1, tag=1)
        pg.recv(np.zeros(1, np.uint8), src=1, tag=1)
        pg.send(np.full(1, 12345, np.int64), dst=1, tag=2)


CASES = [
    case_every_dtype_and_shape,
    case_many_tags_out_of_order,
    case_same_tag_no_overtaking,
    case_isend_irecv_overlap,
    case_send_to_self,
    case_timeouts_leave_group_usable,
    case_mismatch_leaves_buffer_and_stream_intact,
    case_bad_arguments_fail_before_sending,
    case_junk_frames_are_dropped_and_counted,
]
WORLD = 3


@pytest.fixture(scope="module")
def p2p_job() -> list[dict[str, Any]]:
    return rc.spawn(run_cases, WORLD, args=(CASES, 20.0), timeout_s=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__[len("case_") :])
def test_p2p(case: Any, p2p_job: list[dict[str, Any]]) -> None:
    errors = case_report(p2p_job, case.__name__)
    if errors:
        pytest.fail(errors, pytrace=False)


# --- ring pass-around over world sizes 1..8 --------------------------------------------


def ring_job(pg: rc.ProcessGroup) -> list[int]:
    """Every rank starts a token; W hops later each token is back home, having visited
    every rank. World size 1 sends to itself. The payload spans several pieces."""
    r, w = pg.rank, pg.world_size
    right, left = (r + 1) % w, (r - 1) % w
    pg.chunk_bytes = 1000
    token = np.zeros(3 + 1000, np.int64)
    token[:3] = (r, 0, 0)  # origin, hops, sum of the ranks that added themselves
    token[3:] = np.arange(1000) * (r + 1)
    for hop in range(w):
        incoming = np.empty_like(token)
        recv = pg.irecv(incoming, src=left, tag=hop)
        pg.send(token, dst=right, tag=hop)
        recv.wait()
        assert incoming[0] == (r - hop - 1) % w, (hop, incoming[:3])
        incoming[1] += 1
        incoming[2] += r
        token = incoming
    np.testing.assert_array_equal(token[3:], np.arange(1000) * (r + 1))
    return [int(v) for v in token[:3]]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", range(1, 9))
def test_ring_pass_around(world_size: int) -> None:
    results = rc.spawn(ring_job, world_size, timeout_s=60)
    total = world_size * (world_size - 1) // 2
    assert results == [[r, world_size, total] for r in range(world_size)]


# --- one large transfer in hundreds of pieces ------------------------------------------

BIG_BYTES = 64 << 20


def big_job(pg: rc.ProcessGroup) -> dict[str, float]:
    pg.chunk_bytes = 256 * 1024
    n = BIG_BYTES // 8
    expected = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    odd = np.arange(n * 2 + 3, dtype=np.float32)  # 64 MiB + 12 bytes: 257 pieces back
    timing = {}
    if pg.rank == 0:
        before = pg.stats()["sent_messages"]
        t0 = time.perf_counter()
        pg.send(expected, dst=1, tag=1)
        timing["send_s"] = time.perf_counter() - t0
        assert pg.stats()["sent_messages"] - before == 256
        got = np.zeros_like(odd)
        pg.recv(got, src=1, tag=2)
        assert np.array_equal(got, odd)
    else:
        got = np.zeros(n, np.uint64)
        t0 = time.perf_counter()
        pg.recv(got, src=0, tag=1)
        timing["recv_s"] = time.perf_counter() - t0
        assert np.array_equal(got, expected)
        before = pg.stats()["sent_messages"]
        pg.send(odd, dst=0, tag=2)
        assert pg.stats()["sent_messages"] - before == 257
    return timing


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_64mib_in_256_pieces() -> None:
    rc.spawn(big_job, 2, timeout_s=90)
