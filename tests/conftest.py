"""Shared test helpers: optional-peer markers, leaked-process check, free ports, and a case
runner for spawned jobs.

Tests that need an optional peer carry a marker (registered in pyproject.toml):
``needs_torch``, ``needs_mpi``, ``needs_ssh``, ``needs_plot``, ``needs_slurm``. Where the peer
is missing they are skipped with a reason naming it, so ``pip install -e ".[test]" && python -m
pytest`` passes on a fresh machine; ``pytest -m "needs_torch or needs_mpi or needs_ssh or
needs_plot or needs_slurm"`` runs just them where the peers are installed (CI's second run,
.ci/run).

Spawning ranks costs a few hundred milliseconds per job on a small machine, so multi-process
tests batch many cases into one job: :func:`run_cases` runs each case on every rank inside
its own sub-group (its own tag space, so a failed case cannot leave stray messages for the
next) and reports per case, and the test module turns that into one pytest test per case.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import signal
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import leakcheck


def _module_missing(name: str, install: str) -> str | None:
    return None if importlib.util.find_spec(name) else f"{name} is not installed ({install})"


def _torch_missing() -> str | None:
    return _module_missing("torch", "pip install 'ringcomm[torch]'")


def _mpi_missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (OpenMPI: apt-get install openmpi-bin libopenmpi-dev)"
    return _module_missing("mpi4py", "pip install mpi4py")


def _ssh_missing() -> str | None:
    from sshd_hosts import sshd_unavailable  # tests/ is on sys.path (rootdir conftest)

    return sshd_unavailable()


def _plot_missing() -> str | None:
    return _module_missing("matplotlib", "pip install 'ringcomm[plot]'")


def _slurm_missing() -> str | None:
    from launcher_results import slurm_unavailable  # tests/ is on sys.path (rootdir conftest)

    return slurm_unavailable()


#: marker -> why its tests cannot run here (None: they can); each asked once per session.
OPTIONAL_PEERS: dict[str, Callable[[], str | None]] = {
    "needs_torch": functools.cache(_torch_missing),
    "needs_mpi": functools.cache(_mpi_missing),
    "needs_ssh": functools.cache(_ssh_missing),
    "needs_plot": functools.cache(_plot_missing),
    "needs_slurm": functools.cache(_slurm_missing),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip a test whose optional peer is missing, naming the peer."""
    for item in items:
        for marker, missing in OPTIONAL_PEERS.items():
            if item.get_closest_marker(marker) is not None:
                why = missing()
                if why is not None:
                    item.add_marker(pytest.mark.skip(reason=f"{marker}: {why}"))


def _live_children(pid: int) -> list[tuple[int, str]]:
    """(pid, cmdline) of live, non-zombie children of ``pid`` (multiprocessing's
    resource tracker, which lives as long as the test process, does not count)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
        if ppid != pid or state == "Z" or "resource_tracker" in cmdline:
            continue
        found.append((int(name), cmdline))
    return found


@pytest.fixture
def no_child_processes() -> Iterator[None]:
    """Fail the test if a child process it started outlives it (by 5 s); kill leftovers."""
    before = {p for p, _ in _live_children(os.getpid())}
    yield
    deadline = time.monotonic() + 5.0
    while True:
        left = [(p, c) for p, c in _live_children(os.getpid()) if p not in before]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for p, _ in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def tag() -> Iterator[str]:
    """A unique tag for the environment of every process a test starts (leakcheck.py):
    none may outlive the test (by 5 s); leftovers are killed and fail it."""
    value = uuid.uuid4().hex
    yield value
    left = leakcheck.wait_gone(value, 5.0, exclude=(os.getpid(),))
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


def free_port() -> int:
    """A TCP port the OS just handed out on 127.0.0.1 (free, barring a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Case = Callable[[Any], None]


def run_cases(pg: Any, cases: Sequence[Case], case_timeout_s: float = 15.0) -> dict[str, Any]:
    """Run every case ``fn(sub)`` on this rank, each in a fresh sub-group of all ranks.

    Returns ``{case name: (error text or None, seconds)}``. Module-level; pass it to
    ``rc.spawn`` as ``rc.spawn(run_cases, n, args=(CASES,))``.
    """
    results: dict[str, Any] = {}
    for fn in cases:
        sub = pg.new_group(range(pg.world_size))
        sub.timeout_s = case_timeout_s
        t0 = time.monotonic()
        try:
            fn(sub)
            err = None
        except Exception:  # noqa: BLE001  (a case's failure is its report)
            err = f"rank {pg.rank}:\n{traceback.format_exc()}"
        finally:
            sub.close()
        results[fn.__name__] = (err, time.monotonic() - t0)
    return results


def case_report(per_rank: Sequence[dict[str, Any]], name: str) -> str | None:
    """The failures of case ``name`` across ranks (None if it passed everywhere)."""
    errors = [r[name][0] for r in per_rank if r[name][0] is not None]
    return "\n".join(errors) if errors else None


def compare_to_single(
    failures: list[str],
    label: str,
    results: Sequence[dict[str, Any]],
    ref: dict[str, Any],
    steps: int,
    tol: float,
) -> float | None:
    """Check one training job (every rank's ``run_training`` result) against the
    ``single`` run ``ref``: the reported losses to ``tol`` relative, the parameters (pipeline
    stages hold disjoint layers, the others the whole model) to ``tol`` absolute. Appends
    what is off to ``failures``; returns the worst of the two errors (None when the job
    could not be compared: wrong number of losses or of parameters)."""
    import numpy as np  # only the engine tests need it

    losses = results[results[0]["loss_rank"]]["losses"]
    if len(losses) != steps:
        failures.append(f"{label}: {len(losses)} losses")
        return None
    rel = float(np.max(np.abs(np.array(losses) - ref["losses"]) / np.abs(ref["losses"])))
    if not rel <= tol:
        failures.append(f"{label}: loss rel err {rel:.3g} > {tol}: {losses}")
    params: dict[str, Any] = {}
    for res in results:
        params.update(res["params"])
    if set(params) != set(ref["params"]):
        failures.append(f"{label}: parameters {sorted(params)}")
        return None
    err = max(float(np.max(np.abs(params[key] - ref["params"][key]))) for key in params)
    if not err <= tol:
        failures.append(f"{label}: param err {err:.3g} > {tol}")
    return max(rel, err)


def assert_same_results(results: Sequence[tuple[list[str], dict[Any, Any]]]) -> None:
    """Per rank ``(failures, {case id: digest of its output})`` from a matrix job: no
    failure on any rank, and every rank's digests equal rank 0's (the same bytes)."""
    failures = [f for fails, _ in results for f in fails]
    assert not failures, "\n".join(failures[:30])
    first = results[0][1]
    for rank, (_, digests) in enumerate(results):
        differ = [cid for cid in first if digests.get(cid) != first[cid]]
        assert not differ, f"rank {rank} differs from rank 0 in cases {differ[:10]}"


@pytest.fixture
def no_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks spawned by the test form no shared workspace (RINGCOMM_WORKSPACE=0): their
    collectives take the message path even on one host, for tests of that path."""
    monkeypatch.setenv("RINGCOMM_WORKSPACE", "0")
