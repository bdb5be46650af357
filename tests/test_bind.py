"""RINGCOMM_BIND: each rank's driving thread on one core (local rank modulo the cores),
by default when a host has more ranks than cores."""

from __future__ import annotations

import os

import pytest

import ringcomm as rc
from ringcomm.config import resolve_init_config
from ringcomm.errors import RendezvousError


def test_bind_setting() -> None:
    assert resolve_init_config(env={}).bind == "auto"
    assert resolve_init_config(env={"RINGCOMM_BIND": "Core"}).bind == "core"
    assert resolve_init_config(env={}).local_world_size is None
    cfg = resolve_init_config(
        env={"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1"}
    )
    assert cfg.local_world_size == 2
    cfg = resolve_init_config(
        env={
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_PORT": "1",
        }
    )
    assert cfg.local_world_size == 2
    with pytest.raises(RendezvousError, match="RINGCOMM_BIND"):
        resolve_init_config(env={"RINGCOMM_BIND": "socket"})
    with pytest.raises(RendezvousError, match="LOCAL_WORLD_SIZE"):
        resolve_init_config(env={"LOCAL_WORLD_SIZE": "0"})


def job_affinity(pg: rc.ProcessGroup) -> tuple[list[int], str | None]:
    return sorted(os.sched_getaffinity(0)), os.environ.get("RINGCOMM_LOCAL_RANK")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("bind", "world"), [("core", 3), ("none", 3), ("auto", "more"), ("auto", "cores")]
)
def test_spawned_ranks_bind_round_robin(
    bind: str, world: int | str, monkeypatch: pytest.MonkeyPatch, no_child_processes: None
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    n = {"more": len(cores) + 1, "cores": len(cores)}.get(str(world), world)
    assert isinstance(n, int)
    monkeypatch.setenv("RINGCOMM_BIND", bind)
    results = rc.spawn(job_affinity, n, timeout_s=50)
    bound = bind == "core" or (bind == "auto" and world == "more")
    for rank, (affinity, local) in enumerate(results):
        assert local == str(rank)
        assert affinity == ([cores[rank % len(cores)]] if bound else cores), (rank, affinity)
