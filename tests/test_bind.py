"""RINGCOMM_BIND=core: each rank's driving thread on one core (local rank modulo cores)."""

from __future__ import annotations

import os

import pytest

import ringcomm as rc
from ringcomm.config import resolve_init_config
from ringcomm.errors import RendezvousError


def test_bind_setting() -> None:
    assert resolve_init_config(env={}).bind == "none"
    assert resolve_init_config(env={"RINGCOMM_BIND": "Core"}).bind == "core"
    with pytest.raises(RendezvousError, match="RINGCOMM_BIND"):
        resolve_init_config(env={"RINGCOMM_BIND": "socket"})


def job_affinity(pg: rc.ProcessGroup) -> tuple[list[int], str | None]:
    return sorted(os.sched_getaffinity(0)), os.environ.get("RINGCOMM_LOCAL_RANK")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bind", ["core", "none"])
def test_spawned_ranks_bind_round_robin(
    bind: str, monkeypatch: pytest.MonkeyPatch, no_child_processes: None
) -> None:
    monkeypatch.setenv("RINGCOMM_BIND", bind)
    cores = sorted(os.sched_getaffinity(0))
    results = rc.spawn(job_affinity, 3, timeout_s=50)
    for rank, (affinity, local) in enumerate(results):
        assert local == str(rank)
        if bind == "core":
            assert affinity == [cores[rank % len(cores)]]
        else:
            assert affinity == cores
