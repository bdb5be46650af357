"""A parameter server refuses malformed requests and goes on serving (issue 29).

An authenticated worker sends what a buggy or hostile client could: an unknown dtype code,
a size of 2**40 elements (8 TiB if allocated), an init of that size, a payload shorter than
its header said, an unknown op, a header of the wrong size, a pull of an absurd size. Each
gets an error reply (sizes are checked before anything is allocated; refused payloads are
read and dropped); then both workers train a step and get the exact bsp result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm import ps
from ringcomm.ps import protocol as P

KEY = 1
HUGE = 1 << 40


def _raw(
    g: Any, header: np.ndarray, payload: np.ndarray | None = None, data: np.ndarray | None = None
) -> int:
    """Send one raw request to server rank 0; its reply status (and data, if asked)."""
    g.send(header, 0, P.TAG_REQUEST)
    if payload is not None:
        g.send(payload, 0, P.TAG_REQUEST)
    reply = np.empty(P.REPLY_WORDS, np.int64)
    g.recv(reply, 0, P.TAG_REPLY)
    if data is not None:
        g.recv(data, 0, P.TAG_REPLY)
    return int(reply[0])


def _malformed(g: Any) -> list[int]:
    f64, small = 1, np.ones(2)
    return [
        _raw(g, P.request(P.OP_PUSH, KEY, nelem=4, dtype_code=99), np.ones(4)),
        _raw(g, P.request(P.OP_PUSH, KEY, nelem=HUGE, dtype_code=f64), small),
        _raw(g, P.request(P.OP_INIT, 7, nelem=HUGE, dtype_code=f64, extra=HUGE), small),
        _raw(g, P.request(P.OP_PUSH, KEY, nelem=4, dtype_code=f64), small),  # short payload
        _raw(g, P.request(42, KEY)),  # unknown op
        _raw(g, np.zeros(3, np.int64)),  # not a request header
        _raw(g, P.request(P.OP_PULL, KEY, nelem=HUGE, dtype_code=99), data=np.empty(0, np.uint8)),
    ]


def job_malformed_requests(pg: rc.ProcessGroup) -> dict[str, Any]:
    cfg = ps.PSConfig(num_workers=2, timeout_s=60, optimizer_args={"lr": 0.5})
    role = ps.start(pg, cfg, 1)
    if isinstance(role, ps.PSServer):
        return {"last_error": role.last_error, "shards": sorted(role.state.shards)}
    with role as kv:
        w = np.zeros(4)
        kv.init(KEY, w).wait()
        statuses = _malformed(kv.group) if kv.index == 0 else []
        kv.push_pull(KEY, np.full(4, 1.0 + kv.index), w).wait()  # mean gradient 1.5
        kv.advance()
        return {"statuses": statuses, "w": w.tolist()}


@pytest.mark.timeout(120)
def test_malformed_requests_are_refused_and_the_server_keeps_serving(
    no_child_processes: None,
) -> None:
    server, a, b = rc.spawn(job_malformed_requests, 3, timeout_s=100)
    assert a["statuses"] == [P.STATUS_ERROR] * 7, a
    assert a["w"] == b["w"] == [-0.75] * 4  # 0 - 0.5 * mean(1, 2): both pushes counted once
    assert server["shards"] == [(KEY, 0)]  # the huge init created nothing
    assert "op pull" in server["last_error"] and "dtype code 99" in server["last_error"]
