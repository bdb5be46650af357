"""The torch backend's point-to-point calls (send, recv, recv from any source) and Gloo's
monitored barrier, as functions of a :class:`~ringcomm.torch_backend.core.BackendCore`.

Their Work may finish in any order: its future is completed by the group's second
completion thread, on ringcomm's done callbacks
(:class:`~ringcomm.torch_backend.work.Completer`). The monitored barrier runs on the core's
point-to-point group, on tags of its own.
"""

from __future__ import annotations

import datetime
import time

import numpy as np
import torch

from ringcomm.core.p2p import ANY_SOURCE, AnySource
from ringcomm.errors import RingcommError
from ringcomm.torch_backend.core import BackendCore
from ringcomm.torch_backend.tensors import contig, copy_back, move_view
from ringcomm.torch_backend.work import RingcommWork

__all__ = ["monitored_barrier", "recv", "recv_anysource", "send"]

#: Tags of monitored barriers in the point-to-point group (far above the all-to-all ones).
MONITORED_TAG0 = 1 << 40


def send(g: BackendCore, tensors: list[torch.Tensor], dst: int, tag: int) -> RingcommWork:
    what = g.start("send")
    t = g.one(tensors, what)
    c, _ = contig(t)
    w = g.call(g.rc.isend, move_view(c), dst=dst, tag=tag)
    return g.issue([w], [t], None, f"send to {dst} tag {tag}", None, p2p=True)


def recv(g: BackendCore, tensors: list[torch.Tensor], src: int, tag: int) -> RingcommWork:
    return _recv(g, tensors, src, tag, f"recv from {src} tag {tag}")


def recv_anysource(g: BackendCore, tensors: list[torch.Tensor], tag: int) -> RingcommWork:
    """``dist.recv(t)`` / ``dist.irecv(t)`` without ``src``: the next message with
    ``tag`` from any rank (ringcomm's ``ANY_SOURCE``); the work's ``_source_rank()``
    is the sender's group rank (what ``dist.recv`` returns)."""
    return _recv(g, tensors, ANY_SOURCE, tag, f"recv from any source tag {tag}")


def _recv(
    g: BackendCore, tensors: list[torch.Tensor], src: int | AnySource, tag: int, desc: str
) -> RingcommWork:
    what = g.start("recv")
    t = g.one(tensors, what)
    c, copied = contig(t)
    w = g.call(g.rc.irecv, move_view(c), src=src, tag=tag)
    return g.issue([w], [t], copy_back(t, c, copied), desc, None, p2p=True)


def monitored_barrier(
    g: BackendCore, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """Gloo's monitored barrier (``pg.monitored_barrier(timeout)``; torch's
    ``dist.monitored_barrier`` itself refuses every backend not named gloo): every
    other rank checks in with rank 0 and waits for its answer; rank 0 waits for each
    (in rank order, within ``timeout`` in all) and names the first rank that did not
    come (``wait_all_ranks``: all of them) in a ``RuntimeError`` worded as Gloo's."""
    g.start("monitored_barrier")
    timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else g.timeout_s
    n, me = g.rc.world_size, g.rc.rank
    if n == 1:
        return
    g.monitored_seq += 1
    tag = MONITORED_TAG0 + g.monitored_seq
    ms = int(timeout_s * 1000)
    wait_s = max(timeout_s, 1e-3)
    if me != 0:
        try:
            g.rc_p2p.send(np.zeros(1, np.uint8), dst=0, tag=tag, timeout_s=wait_s)
            g.rc_p2p.recv(np.zeros(1, np.uint8), src=0, tag=tag, timeout_s=wait_s)
        except RingcommError as exc:
            raise RuntimeError(
                f"Rank {me} successfully reached monitoredBarrier, but received errors "
                "while waiting for send/recv from rank 0. Please check rank 0 logs for "
                f"faulty rank. ({type(exc).__name__}: {exc})"
            ) from exc
        return
    deadline = time.monotonic() + timeout_s
    works = {r: g.rc_p2p.irecv(np.zeros(1, np.uint8), src=r, tag=tag) for r in range(1, n)}
    failed: list[int] = []
    for r, w in works.items():
        left = deadline - time.monotonic()
        if left <= 0 and not w.done():
            waiting = [q for q, wq in works.items() if q >= r and not wq.done()]
            raise RuntimeError(
                f"Rank 0 timed out in monitoredBarrier after {ms} ms; ranks not yet "
                f"checked in: {waiting}"
            )
        try:
            w.wait(max(left, 1e-3))
        except RingcommError as exc:
            if not wait_all_ranks:
                raise RuntimeError(
                    f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {ms} ms "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            failed.append(r)
    if failed:
        raise RuntimeError(
            f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass "
            f"monitoredBarrier in {ms} ms"
        )
    for r in range(1, n):
        g.rc_p2p.send(np.zeros(1, np.uint8), dst=r, tag=tag, timeout_s=wait_s)
