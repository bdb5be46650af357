"""Reliability features that need no fault injection: the cap on unexpected messages, the
progress map in timeout errors, RINGCOMM_LOG=debug op logs, and what a failed group does."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

import ringcomm as rc


def job_flood(pg: rc.ProcessGroup) -> str:
    """Rank 0 sends 60 messages nobody receives; rank 1 (cap: 50 per peer) fails clearly."""
    if pg.rank == 0:
        for i in range(60):
            pg.send(np.full(4, i, np.int32), dst=1, tag=5)
        pg.send(np.zeros(1, np.uint8), dst=1, tag=7)
        return "sent"
    try:
        pg.recv(np.zeros(1, np.uint8), src=0, tag=7, timeout_s=30)
        return "no error"
    except rc.QueueLimitError as exc:
        first = str(exc)
    try:  # stays failed
        pg.all_reduce(np.ones(1))
        return "next call ran"
    except rc.QueueLimitError:
        pass
    assert pg.stats()["unexpected_messages"] == 50
    return first


@pytest.mark.timeout(60)
def test_unexpected_message_cap_fails_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, no_child_processes: None
) -> None:
    monkeypatch.setenv("RINGCOMM_MAX_UNEXPECTED_MESSAGES", "50")
    sent, text = rc.spawn(job_flood, 2, timeout_s=50)
    assert sent == "sent"
    assert "peer rank 0 has 50 messages" in text, text
    assert "cap of 50 messages" in text and "RINGCOMM_MAX_UNEXPECTED_MESSAGES" in text, text


def job_where(pg: rc.ProcessGroup) -> str:
    """Ranks 0 and 1 wait in an all_reduce for rank 2, which waits in a recv: rank 0's
    timeout names where everybody was. Rank 2's receive then fails as rank 0 closes."""
    if pg.rank == 2:
        try:
            pg.recv(np.zeros(3, np.int64), src=0, tag=99, timeout_s=30)
        except rc.RingcommError as exc:
            return str(exc)
        return "no timeout"
    try:  # rank 0 times out first; rank 1 then learns that rank 0 left
        pg.all_reduce(np.ones(1000, np.float32), timeout_s=1.5 * (pg.rank + 1), algo="ring")
    except rc.RingcommError as exc:
        return str(exc)
    return "no timeout"


@pytest.mark.timeout(60)
def test_timeout_error_carries_the_progress_map(no_child_processes: None) -> None:
    texts = rc.spawn(job_where, 3, timeout_s=50)
    text = texts[0]
    assert "timed out after 1.5 s" in text, text
    assert "where each rank was:" in text, text
    lines = {line.split(":", 1)[0].strip(): line for line in text.splitlines()}
    assert "all_reduce(float32[1000]" in lines["rank 0 (this rank)"], text
    assert "op #1 all_reduce(float32[1000])" in lines["rank 0 (this rank)"], text
    assert "recv from peer 0 (op recv, tag 99" in lines["rank 2"], text
    # rank 1 timed out too: still inside its all_reduce, asking around, or closed already
    assert any(w in lines["rank 1"] for w in ("all_reduce", "no answer", "closed")), text
    # rank 0 closed after its timeout: rank 2's receive from it fails at once
    assert "peer rank 0 left the group (it closed its process group)" in texts[2], texts[2]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def job_debug_log(pg: rc.ProcessGroup) -> list[str]:
    records = _Records()
    logging.getLogger("ringcomm").addHandler(records)
    x = np.ones(2, np.float32)
    pg.all_reduce(x)
    if pg.rank == 0:
        pg.send(x, dst=1, tag=3)
    else:
        pg.recv(x, src=0, tag=3)
    return records.lines


@pytest.mark.timeout(60)
def test_debug_log_has_every_op_start_and_end(
    monkeypatch: pytest.MonkeyPatch, no_child_processes: None
) -> None:
    monkeypatch.setenv("RINGCOMM_LOG", "debug")
    for rank, lines in enumerate(rc.spawn(job_debug_log, 2, timeout_s=50)):
        text = "\n".join(lines)
        assert f"rank {rank}: start all_reduce(float32[2]" in text, text
        assert f"rank {rank}: end all_reduce(float32[2]" in text, text
        p2p = "send to peer 1" if rank == 0 else "recv from peer 0"
        assert f"rank {rank}: start {p2p}" in text and f"rank {rank}: end {p2p}" in text, text


def job_failed_then_close(pg: rc.ProcessGroup) -> dict[str, Any]:
    """A peer-failure report (as a forwarded control message) fails the group for good."""
    out: dict[str, Any] = {}
    if pg.rank == 1:
        engine = pg.core.progress
        with engine._lock:  # as if rank 2 had been reported dead by rank 0
            engine.health.peer_failed(2, reporter=0, text="test")
        for call in (lambda: pg.all_reduce(np.ones(1)), lambda: pg.send(np.ones(1), dst=0)):
            try:
                call()
                out.setdefault("errors", []).append(None)
            except rc.PeerFailedError as exc:
                out.setdefault("errors", []).append((exc.peer, "peer rank 2 failed" in str(exc)))
        out["failed_peers"] = pg.failed_peers()
    return out


@pytest.mark.timeout(60)
def test_a_failed_group_stays_failed_and_closes(no_child_processes: None) -> None:
    res = rc.spawn(job_failed_then_close, 3, timeout_s=50)
    assert res[1]["errors"] == [(2, True), (2, True)]
    assert res[1]["failed_peers"] == [2]
