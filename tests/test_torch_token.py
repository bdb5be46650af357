"""The torch backend's ringcomm group has a token, and torch's store never holds it (issue 29):
torch's stores (a file here, TCPStore under torchrun) are readable by anyone who reaches
them, so a minted token reaches each rank sealed on its first contact with the ringcomm
store instead."""

from __future__ import annotations

import datetime
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def _rank(rank: int, store_path: str, results: Any) -> None:
    import ringcomm.torch_backend  # noqa: F401  (registers "ringcomm")

    dist.init_process_group(
        "ringcomm",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        rc_group = dist.group.WORLD.ringcomm_group  # type: ignore[union-attr]
        token = rc_group.core.state.config.token
        security = rc_group.core.progress.transport.security
        with open(store_path, "rb") as f:  # what anyone who can read torch's store sees
            written = f.read()
        dist.barrier()
        results.put((rank, token, security, t.tolist(), written))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_torch_store_never_holds_the_token(tmp_path: Path, no_child_processes: None) -> None:
    store_path = str(tmp_path / "torch-store")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store_path, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=90) for _ in procs)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
        results.join_thread()
    (_, token0, sec0, t0, written), (_, token1, sec1, t1, _) = got
    assert token0 and token0 == token1 and sec0 == sec1 == "handshake"
    assert t0 == t1 == [3.0] * 4
    assert b"ringcomm/store" in written  # the store's contents were read
    for form in (token0.encode(), bytes.fromhex(token0)):
        assert form not in written
