"""Nothing is held for a sender before it authenticates (issue 29's memory probes, turned round).

A target process (a rank's data socket; a store's host) is probed by a process that has
no token: ZMTP streams that claim 8 GiB and 4 x 256 MiB before any credential, 300 idle
connections, floods of wrong-token store requests. Its resident memory (and its peak)
stays within 16 MB of where it was, idle connections are closed after the handshake
interval, and the target still works.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from launcher_results import clean_env

from ringcomm.rendezvous import Store
from ringcomm.rendezvous.store import MAX_VALUE_BYTES
from ringcomm.transport.zmq_transport import HANDSHAKE_S

MIB = 1 << 20
LIMIT = 16 * MIB

_TARGET = """
import json, os, sys
import ringcomm as rc
from ringcomm.rendezvous import StoreServer
pg = rc.init_process_group(0, 1, env={})
server = StoreServer("127.0.0.1", 0, token="the job's token").start()
t = pg.core.progress.transport
print(json.dumps({"tcp": t.tcp_endpoint, "store": server.port}), flush=True)
for line in sys.stdin:  # "ping": the data socket still works (an all_reduce, a file)
    import numpy as np
    x = pg.all_reduce(np.ones(4))
    with open(os.devnull) as f:
        pass
    print(json.dumps({"ok": x.tolist(), "auth_failures": pg.stats()["auth_failures"],
                      "store_rejected": server.rejected}), flush=True)
"""


def _mem(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


@contextlib.contextmanager
def _target() -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _TARGET],
        env=clean_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        yield proc, info
    finally:
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _ping(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("ping\n")
    proc.stdin.flush()
    return dict(json.loads(proc.stdout.readline()))


def _greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.1 greeting (what a client sends before any credential)."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + mechanism.ljust(20, b"\0") + bytes(32)


def _claim_and_stream(host: str, port: int, size: int, send_bytes: int) -> int:
    """Greet, claim a ``size``-byte command frame, stream up to ``send_bytes`` of it;
    returns how many bytes went out before the target closed the connection."""
    sent = 0
    with socket.create_connection((host, port), timeout=10) as s:
        try:
            s.sendall(_greeting(b"PLAIN") + b"\x06" + struct.pack(">Q", size))
            chunk = bytes(MIB)
            while sent < send_bytes:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # closed by the target: what we want
    return sent


def _endpoint(info: dict[str, Any]) -> tuple[str, int]:
    host, port = info["tcp"].removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


@pytest.mark.timeout(120)
def test_preauth_streams_leave_the_rank_memory_flat() -> None:
    with _target() as (proc, info):
        host, port = _endpoint(info)
        _ping(proc)
        rss0, hwm0 = _mem(proc.pid)
        sent = [_claim_and_stream(host, port, 8 << 30, 64 * MIB)]  # an 8 GiB claim
        threads: list[threading.Thread] = []
        for _ in range(4):  # 4 x 256 MiB, in parallel
            t = threading.Thread(
                target=lambda: sent.append(_claim_and_stream(host, port, 256 * MIB, 256 * MIB))
            )
            t.start()
            threads.append(t)
        for t in threads:
            t.join(60)
        after = _ping(proc)  # still serving
        rss1, hwm1 = _mem(proc.pid)
        assert after["ok"] == [1.0] * 4
        assert max(rss1 - rss0, hwm1 - hwm0) < LIMIT, (rss0, rss1, hwm0, hwm1, sent)
        # The size is refused as soon as it is read: far less than claimed got through.
        assert max(sent) < 64 * MIB, sent


@pytest.mark.timeout(120)
def test_idle_unauthenticated_connections_are_closed() -> None:
    with _target() as (proc, info):
        host, port = _endpoint(info)
        rss0, _ = _mem(proc.pid)
        conns = [socket.create_connection((host, port), timeout=10) for _ in range(300)]
        try:
            assert _ping(proc)["ok"] == [1.0] * 4  # its own open() and sockets still work
            start = time.monotonic()
            closed = 0
            for c in conns:  # each is closed by the target once its handshake time is up
                c.settimeout(max(0.1, start + HANDSHAKE_S + 10 - time.monotonic()))
                with contextlib.suppress(OSError):
                    while c.recv(4096):  # its greeting, then EOF
                        pass
                    closed += 1
            assert closed == len(conns)
            assert time.monotonic() - start < HANDSHAKE_S + 10
        finally:
            for c in conns:
                c.close()
        assert _mem(proc.pid)[0] - rss0 < LIMIT


def _flood(port: int, n: int) -> None:
    """Wrong-token store requests as large as the store takes: signed with a key that is not
    the session's, and unsigned ones too large for a first contact; then one above the
    limit."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        body = bytes(MAX_VALUE_BYTES)
        for i in range(n):
            head = os.urandom(16) + i.to_bytes(8, "little") + os.urandom(32)
            sock.send_multipart([head if i % 2 else b"", body])
        sock.send_multipart([b"", bytes(256 * MIB)])  # above the limit: dropped at its size
        sock.poll(100)
    finally:
        sock.close()
        ctx.term()


@pytest.mark.timeout(120)
def test_wrong_token_floods_leave_the_store_memory_flat() -> None:
    with _target() as (proc, info):
        port = info["store"]
        _ping(proc)
        rss0, hwm0 = _mem(proc.pid)
        threads = [threading.Thread(target=_flood, args=(port, 256)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with Store("127.0.0.1", port, token="the job's token", timeout_s=30) as s:
            s.set("still", b"serving")  # answered after every flood message before it
            assert s.get("still") == b"serving"
        after = _ping(proc)
        rss1, hwm1 = _mem(proc.pid)
        assert max(rss1 - rss0, hwm1 - hwm0) < LIMIT, (rss0, rss1, hwm0, hwm1)
        assert after["store_rejected"] >= 4 * 128, after  # the signed ones, each refused
