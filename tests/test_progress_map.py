"""The progress map says where inside the algorithm each rank is.

A rank stays out of a collective (busy in a receive nobody answers); the others time out,
and the error's map names, per rank, the op, its step and piece, and whom it waits on:
``op #1 all_reduce(float32[1000]) reduce-scatter step 1/2, piece 1/6, waiting on recv from
rank 2; writes held until ranks [2] are heard from``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import ringcomm as rc


def _lines(text: str) -> dict[str, str]:
    return {line.split(":", 1)[0].strip(): line for line in text.splitlines() if ":" in line}


def _stuck(pg: rc.ProcessGroup, absent: int, call: Any, timeout_s: float) -> str:
    """``call(sub)`` on every rank but ``absent`` (which sits in a receive); the text of
    the timeout (of rank 0, whose deadline is the shortest)."""
    sub = pg.new_group(range(pg.world_size))
    assert sub is not None
    sub.chunk_bytes = 256
    try:
        if pg.rank == absent:
            sub.recv(np.zeros(1, np.int64), src=(absent + 1) % pg.world_size, tag=99,
                     timeout_s=timeout_s + 2.5)  # fmt: skip
            return "no timeout"
        call(sub, timeout_s if pg.rank == 0 else timeout_s + 1.5)
        return "no timeout"
    except rc.CommTimeoutError as exc:
        return str(exc)
    finally:
        sub.close()
        pg.barrier()


def job_map(pg: rc.ProcessGroup) -> dict[str, str]:
    x = np.ones(1000, np.float32)
    return {
        "ring": _stuck(pg, 2, lambda g, t: g.all_reduce(x, algo="ring", timeout_s=t), 1.5),
        "chain": _stuck(pg, 1, lambda g, t: g.broadcast(x, src=0, algo="chain", timeout_s=t), 1.5),
        "all_gather": _stuck(pg, 2, lambda g, t: g.all_gather(x, timeout_s=t), 1.5),
        "rd": _stuck(pg, 2, lambda g, t: g.all_reduce(x, algo="rd", timeout_s=t), 1.5),
    }


@pytest.mark.timeout(90)
def test_progress_map_says_step_piece_and_peer(
    no_child_processes: None, no_workspace: None
) -> None:
    """(The engine's map: on the shared workspace, test_workspace checks the timeout's text.)"""
    per_rank = rc.spawn(job_map, 3, timeout_s=80)
    ring = _lines(per_rank[0]["ring"])
    # Rank 0 waits for its left neighbour (2) in the first step; rank 1 got rank 0's
    # first message but holds it until rank 2 is heard from.
    assert re.search(
        r"rank 0 \(this rank\): op #1 all_reduce\(float32\[1000\]\) reduce-scatter step 1/2, "
        r"piece 1/6, waiting on recv from rank 2; writes held until ranks \[2\] are heard from",
        ring["rank 0 (this rank)"],
    ), per_rank[0]["ring"]
    assert re.search(
        r"op #1 all_reduce\(float32\[1000\]\) reduce-scatter step 2/2, piece 1/6, "
        r"waiting on recv from rank 0; writes held until ranks \[2\]",
        ring["rank 1"],
    ), per_rank[0]["ring"]
    assert "recv from peer 0 (op recv, tag 99" in ring["rank 2"], per_rank[0]["ring"]
    chain = _lines(per_rank[0]["chain"])
    # The source (0) sent everything and waits for rank 1's fingerprint; rank 2 waits on
    # rank 1, which never forwards.
    assert re.search(
        r"op #1 broadcast\(float32\[1000\]\) waiting on the fingerprint message of rank 1",
        chain["rank 0 (this rank)"],
    ), per_rank[0]["chain"]
    assert re.search(
        r"op #1 broadcast\(float32\[1000\]\) chain from rank 0, piece 1/16, waiting on recv "
        r"from rank 1; writes held until ranks \[1\]",
        chain["rank 2"],
    ), per_rank[0]["chain"]
    gather = _lines(per_rank[0]["all_gather"])
    assert re.search(
        r"op #1 all_gather\(float32\[1000\]\) all-gather step 1/2, piece 1/16, waiting on "
        r"recv from rank 2",
        gather["rank 0 (this rank)"],
    ), per_rank[0]["all_gather"]
    rd = _lines(per_rank[0]["rd"])
    # W=3: rank 1 folds into rank 0, which then exchanges with rank 2 (absent).
    assert re.search(
        r"op #1 all_reduce\(float32\[1000\]\) recursive doubling step 2/3 \(exchange with "
        r"rank 2\), piece 1/16, waiting on recv from rank 2",
        rd["rank 0 (this rank)"],
    ), per_rank[0]["rd"]
    assert re.search(
        r"recursive doubling step 2/2 \(recv result with rank 0\), piece 1/16, waiting on "
        r"recv from rank 0",
        rd["rank 1"],
    ), per_rank[0]["rd"]
