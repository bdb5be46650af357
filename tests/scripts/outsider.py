"""A process that is not part of a job and has no token, trying to get in (issue 29's probes).

``python outsider.py '{"store": [host, port], "endpoints": [...], "claim": "rank 1 of group pg0"}'``
prints one JSON line: what each attempt got. It forges (1) a well-formed p2p frame "from
rank 0, tag 9" to every data endpoint with no credential, a wrong PLAIN login and wrong
CURVE keys, and (2) store requests: unsigned reads and writes, a request signed with a key
of its own, and first contacts that ask for the token as a rank that already has it and as
no rank at all. Every receive is bounded.
"""

from __future__ import annotations

import json
import os
import sys

import msgpack
import numpy as np
import zmq

from ringcomm.transport.session import dh_keypair, job_key, mac, plain_login, session_key
from ringcomm.transport.wire import KIND_P2P, Header, pack_header
from ringcomm.transport.zmq_transport import data_plane_credentials

FORGED_TAG = 9
FORGED_VALUE = 666


def forged_frame() -> bytes:
    payload = np.full(2, FORGED_VALUE, np.int64)
    header = Header(
        KIND_P2P, 0, 0, FORGED_TAG, 0, 0, 1, payload.dtype.str, payload.nbytes, 0, payload.shape
    )
    return pack_header(header, payload.tobytes())


def forge_frames(ctx: zmq.Context, endpoints: list[str]) -> int:  # type: ignore[type-arg]
    """Send the forged frame over every way in; returns how many sockets tried."""
    wrong = data_plane_credentials("not the job's token")
    socks = []
    for endpoint in endpoints:
        for how in ("null", "plain", "curve"):
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            if how == "plain":
                username, password = plain_login(wrong["plain_key"], os.urandom(16), 0)
                s.setsockopt(zmq.PLAIN_USERNAME, username)
                s.setsockopt(zmq.PLAIN_PASSWORD, password)
            elif how == "curve":
                s.setsockopt(zmq.CURVE_SERVERKEY, wrong["server_public"])
                s.setsockopt(zmq.CURVE_PUBLICKEY, wrong["client_public"])
                s.setsockopt(zmq.CURVE_SECRETKEY, wrong["client_secret"])
            s.connect(endpoint)
            s.send(forged_frame(), zmq.NOBLOCK)
            socks.append(s)
    # Each connection gets refused at its handshake; the monitors of the target count them.
    for s in socks:
        s.close(linger=500)
    return len(socks)


def _ask(sock: zmq.Socket, head: bytes, body: dict, request_id: int) -> dict:  # type: ignore[type-arg]
    payload = msgpack.packb({"id": request_id, "body": body})
    sock.send_multipart([head, payload])
    if not sock.poll(10_000):
        return {"no answer": True}
    frames = sock.recv_multipart()
    message = msgpack.unpackb(frames[-1])
    return message.get("body") or {"refused": message.get("refused")}


def forge_store(ctx: zmq.Context, host: str, port: int, claim: str) -> dict[str, object]:  # type: ignore[type-arg]
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{host}:{port}")
    got: dict[str, object] = {}
    try:
        got["set"] = _ask(sock, b"", {"op": "set", "key": "rank/1", "value": b"evil"}, 1)
        got["get"] = _ask(sock, b"", {"op": "try_get", "key": "rank/0"}, 2)
        cn = os.urandom(16)
        hello = _ask(sock, b"", {"op": "hello", "cn": cn}, 3)
        key = session_key(job_key("a guess", b"store"), cn, hello.get("sn", b""))
        signed = (4).to_bytes(8, "little")
        body = {"op": "set", "key": "rank/1", "value": b"evil"}
        payload = msgpack.packb({"id": 4, "body": body})
        head = cn + signed + mac(key, b"request", signed, payload)
        sock.send_multipart([head, payload])
        got["signed"] = (
            msgpack.unpackb(sock.recv_multipart()[-1]) if sock.poll(10_000) else {"no answer": 1}
        )
        for n, who in ((5, claim), (6, None)):
            fields: dict[str, object] = {"op": "hello", "cn": os.urandom(16), "dh": dh_keypair()[1]}
            if who is not None:
                fields["claim"] = who
            got["claim None" if who is None else "claim rank 1"] = _ask(sock, b"", fields, n)
    finally:
        sock.close()
    return got


def main() -> None:
    spec = json.loads(sys.argv[1])
    ctx = zmq.Context()
    try:
        result: dict[str, object] = {"frames": forge_frames(ctx, spec["endpoints"])}
        if spec.get("store"):
            host, port = spec["store"]
            result["store"] = forge_store(
                ctx, host, int(port), spec.get("claim", "rank 1 of group pg0")
            )
    finally:
        ctx.destroy(linger=0)
    print(json.dumps(result, default=repr), flush=True)


if __name__ == "__main__":
    main()
