"""A token under every launcher, and nothing accepted from a process without it (issue 29).

* Under each convention that starts ranks (``ringcomm run``, torchrun's, mpirun's and srun's
  variables, a real ``mpirun``; a plain environment with nothing but rank and world size),
  a job of two ranks gets a token, and an outsider with none (``scripts/outsider.py``)
  cannot deliver a frame or read or write the store: its frames never complete the posted
  receive, its store requests are refused, and results stay right.
* ``RINGCOMM_SECURITY=none`` is the explicit way to run without one; a store and a rank
  that disagree on it are told so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import free_port
from launcher_results import clean_env

import ringcomm as rc
from ringcomm.rendezvous import Store, StoreServer

SCRIPTS = Path(__file__).resolve().parent / "scripts"
JOB = SCRIPTS / "outsider_job.py"


def _reports(report_dir: Path) -> dict[int, dict[str, Any]]:
    """Each rank's report, from the file it wrote (never from a launcher's merged stdout)."""
    return {int(f.stem): json.loads(f.read_text()) for f in sorted(report_dir.glob("*.json"))}


def _job_env(report_dir: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    base = clean_env() if env is None else env
    out = {k: v for k, v in base.items() if "TOKEN" not in k}
    out["OUTSIDER_REPORT_DIR"] = str(report_dir)
    return out


def _run_ranks(
    envs: list[dict[str, str]], report_dir: Path, timeout_s: float = 150.0
) -> dict[int, dict[str, Any]]:
    """Start one process per environment (the same job), wait for all, parse their reports."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB)],
            env=_job_env(report_dir, env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            outs.append(out + err)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    return _reports(report_dir)


def _check(reports: dict[int, dict[str, Any]], rank0_serves: bool) -> None:
    assert sorted(reports) == [0, 1], reports
    for r in reports.values():
        assert r["token"], "every group has a token"
        assert r["all_reduce"] == [3.0] * 4
    one, zero = reports[1], reports[0]
    assert one["received"] == [12345, 54321]  # the real message, not the forged one
    assert not one["early"], "a forged frame completed the receive"
    assert one["auth_failures"] >= zero["outsider"]["frames"], one  # every way in refused
    store = zero["outsider"]["store"]
    for what in ("set", "get"):
        assert store[what].get("status") == "auth", store
    assert store["signed"].get("refused") == "token mismatch", store
    for claim in ("claim rank 1", "claim None"):
        assert store[claim].get("status") == "auth" and "box" not in store[claim], store
    if rank0_serves:
        assert zero["store_rejected"] >= 5, zero
        assert "already received" in store["claim rank 1"]["why"]


def _env(port: int, **names: str) -> dict[str, str]:
    env = clean_env({"RINGCOMM_TIMEOUT_S": "60", **names})
    env["MASTER_ADDR"] = env.get("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = env.get("MASTER_PORT", str(port))
    return {k: v for k, v in env.items() if "TOKEN" not in k}


CONVENTIONS = {
    "plain": lambda r, port: _env(port, RINGCOMM_RANK=str(r), RINGCOMM_WORLD_SIZE="2"),
    "torchrun": lambda r, port: _env(port, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r)),
    "mpirun": lambda r, port: _env(
        port,
        OMPI_COMM_WORLD_RANK=str(r),
        OMPI_COMM_WORLD_SIZE="2",
        OMPI_COMM_WORLD_LOCAL_RANK=str(r),
    ),
    "srun": lambda r, port: _env(port, SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r)),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
def test_outsider_is_refused_under_each_convention(convention: str, tmp_path: Path) -> None:
    """No launcher token: rank 0 mints one and hands it to rank 1 sealed, once."""
    port = free_port()
    reports = _run_ranks([CONVENTIONS[convention](r, port) for r in range(2)], tmp_path)
    _check(reports, rank0_serves=True)


@pytest.mark.timeout(200)
def test_outsider_is_refused_under_ringcomm_run(tmp_path: Path) -> None:
    """``ringcomm run``: the launcher's token, its store; the outsider gets neither."""
    proc = subprocess.run(
        [sys.executable, "-m", "ringcomm", "run", "-n", "2", str(JOB)],
        env=_job_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(_reports(tmp_path), rank0_serves=False)


@pytest.mark.needs_mpi
@pytest.mark.timeout(200)
def test_outsider_is_refused_under_mpirun(tmp_path: Path) -> None:
    """A real mpirun; reports come back as files, since mpirun may merge the ranks' lines."""
    cmd = ["mpirun"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    cmd += ["--oversubscribe", "--bind-to", "none", "-np", "2", "-x", "PYTHONPATH"]
    cmd += ["-x", "OUTSIDER_REPORT_DIR"]
    proc = subprocess.run(
        [*cmd, sys.executable, str(JOB)],
        env=_job_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(_reports(tmp_path), rank0_serves=True)


def job_security_none(pg: rc.ProcessGroup) -> list[object]:
    state = pg.core.state
    x = pg.all_reduce(pg.alloc(3) + pg.rank + 1.0)
    return [state.config.token, pg.core.progress.transport.security, x.tolist()]


@pytest.mark.timeout(120)
def test_security_none_runs_without_a_token(
    monkeypatch: pytest.MonkeyPatch, no_child_processes: None
) -> None:
    monkeypatch.setenv("RINGCOMM_SECURITY", "none")
    monkeypatch.delenv("RINGCOMM_TOKEN", raising=False)
    assert rc.spawn(job_security_none, 2, timeout_s=100) == [[None, None, [3.0] * 3]] * 2


def test_token_and_security_none_conflict() -> None:
    with pytest.raises(rc.RendezvousError, match="RINGCOMM_SECURITY=none"):
        rc.init_process_group(0, 1, token="t", env={"RINGCOMM_SECURITY": "none"})


def test_security_modes_disagree_is_named() -> None:
    """A rank run with ``none`` against a store with a token, and the other way round."""
    with (
        StoreServer("127.0.0.1", 0) as server,
        pytest.raises(rc.AuthenticationError, match="RINGCOMM_SECURITY=none"),
    ):
        Store("127.0.0.1", server.port, auth=False, timeout_s=5)
    with StoreServer("127.0.0.1", 0, auth=False) as server:
        with pytest.raises(rc.AuthenticationError, match="token mismatch"):
            Store("127.0.0.1", server.port, token="t", timeout_s=5)
        assert server.rejected == 1  # named on the store's side too


def test_singleton_has_a_token() -> None:
    with rc.init_process_group(0, 1, env={}) as pg:
        assert pg.core.state.config.token
        assert pg.core.progress.transport.security == "handshake"


# -- ringcomm ps-server --------------------------------------------------------------------
def _ps_server(port: int, token: str | None) -> subprocess.Popen[str]:
    env = {k: v for k, v in clean_env().items() if "TOKEN" not in k}
    if token is not None:
        env["RINGCOMM_TOKEN"] = token
    cmd = [
        sys.executable,
        "-m",
        "ringcomm",
        "ps-server",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--index",
        "0",
        "--num-workers",
        "2",
        "--lr",
        "0.5",
        "--timeout",
        "60",
        "--join-timeout",
        "15",
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def job_ps_worker(pg: rc.ProcessGroup, port: int, token: str) -> list[float]:
    from ringcomm.ps.membership import connect_worker

    kv = connect_worker(
        ("127.0.0.1", port), pg.rank, 2, 1, token=token, timeout_s=60, join_timeout_s=15
    )
    w = np.zeros(4)
    kv.init(0, w).wait()
    kv.push_pull(0, np.ones(4), w).wait()
    kv.advance()
    kv.close()
    return [float(v) for v in w]


@pytest.mark.timeout(200)
def test_ps_server_job_refuses_an_outsider(no_child_processes: None) -> None:
    """Workers and a ``ringcomm ps-server`` share the job's token; a process without it
    can neither take a worker's place, nor use the coordinator, nor (a ps-server without
    the token) join."""
    from ringcomm.ps.membership import connect_worker

    token = "the ps job's token"
    with StoreServer("127.0.0.1", 0, token=token) as coordinator:
        port = coordinator.port
        with pytest.raises(rc.AuthenticationError, match="hands out no token"):
            connect_worker(("127.0.0.1", port), 0, 2, 1, timeout_s=10)  # no token: refused
        out = subprocess.run(
            [
                sys.executable,
                str(SCRIPTS / "outsider.py"),
                json.dumps({"endpoints": [], "store": ["127.0.0.1", port]}),
            ],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        store = json.loads(out.stdout.strip().splitlines()[-1])["store"]
        assert store["set"]["status"] == store["get"]["status"] == "auth", store
        assert store["signed"].get("refused") == "token mismatch", store
        assert all(store[k]["status"] == "auth" for k in ("claim rank 1", "claim None")), store
        stranger = _ps_server(port, None)  # a ps-server without the token
        _, err = stranger.communicate(timeout=60)
        assert stranger.returncode == 1 and "hands out no token" in err, err
        server = _ps_server(port, token)
        try:
            results = rc.spawn(job_ps_worker, 2, args=(port, token), timeout_s=150)
            assert results == [[-0.5] * 4] * 2  # 0 - 0.5 * mean(1, 1)
            server.communicate(timeout=60)
            assert server.returncode == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.communicate(timeout=10)
        assert coordinator.rejected >= 6, coordinator.rejected


def test_a_job_across_hosts_without_encryption_says_so(caplog: pytest.LogCaptureFixture) -> None:
    from ringcomm.config import InitConfig
    from ringcomm.rendezvous.security import warn_across_hosts
    from ringcomm.transport.endpoints import EndpointInfo

    def info(rank: int, host: str) -> EndpointInfo:
        return EndpointInfo(rank=rank, host_id=host, ipc=None, tcp=None, pid=1, version="x")

    def said(security: str, hosts: list[str], rank: int = 0) -> list[str]:
        caplog.clear()
        cfg = InitConfig(
            rank=rank, world_size=2, local_rank=0, master_addr="h", master_port=1, security=security
        )
        with caplog.at_level("WARNING", logger="ringcomm"):
            warn_across_hosts(cfg, [info(r, h) for r, h in enumerate(hosts)])
        return [r.getMessage() for r in caplog.records]

    assert "not encrypted" in said("handshake", ["a", "b"])[0]
    assert "RINGCOMM_SECURITY=none" in said("none", ["a", "b"])[0]
    assert said("curve", ["a", "b"]) == []
    assert said("handshake", ["a", "a"]) == []  # one host
    assert said("handshake", ["a", "b"], rank=1) == []  # rank 0 says it, once
