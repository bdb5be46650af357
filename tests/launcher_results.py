"""What ``docs/examples/collectives.py`` prints under any launcher, and how to read it.

Shared by the mpirun and Slurm tests (and :func:`slurm_unavailable`, the needs_slurm check): each launches the example, parses its ``RESULT`` lines
with :func:`parse_results` and compares them with :func:`expected_results` (computed from rank
and world size alone) and with what ``ringcomm run`` prints for the same world size.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "docs" / "examples" / "collectives.py"
SBATCH_EXAMPLE = REPO / "docs" / "examples" / "collectives.sbatch"
#: Where scripts/slurm_localhost.sh writes its slurm.conf (default RINGCOMM_SLURM_DIR).
SLURM_TESTBED_CONF = (
    Path(os.environ.get("RINGCOMM_SLURM_DIR") or Path(tempfile.gettempdir()) / "ringcomm-slurm")
    / "slurm.conf"
)
_RESULT = re.compile(r"RESULT (\d+) (\d+) (\{[^{}]*\})")  # the results hold no braces

#: Variables that would hand a launched rank its rendezvous from outside the launcher.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RINGCOMM_RANK",
    "RINGCOMM_WORLD_SIZE",
    "RINGCOMM_MASTER_ADDR",
    "RINGCOMM_MASTER_PORT",
    "RINGCOMM_STORE_EXTERNAL",
)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher variables, with the repository first on
    PYTHONPATH (so launched ranks import this checkout's ringcomm)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env = {
        k: v
        for k, v in env.items()
        if not k.startswith(("OMPI_", "PMIX_", "SLURM_")) or k == "SLURM_CONF"
    }
    if "SLURM_CONF" not in env and SLURM_TESTBED_CONF.is_file():
        env["SLURM_CONF"] = str(SLURM_TESTBED_CONF)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{path}" if path else str(REPO)
    env.update(extra or {})
    return env


def expected_results(rank: int, world: int) -> dict[str, Any]:
    """What rank ``rank`` of ``world`` prints (the example's own checks, as values)."""
    n = 1003
    return {
        "all_reduce": [float(world * (world + 1) // 2), float((n - 1) * world * (world + 1) // 2)],
        "all_gather": [[r, r * r] for r in range(world)],
        "broadcast": world - 1 + 100,
        "reduce_scatter": [10 * world * (world - 1) // 2 + world * rank] * 3,
        "all_to_all": [r * 10 + rank for r in range(world)],
        "max": float(world - 1),
    }


def parse_results(output: str) -> dict[int, tuple[int, dict[str, Any]]]:
    """rank -> (world size, results) from the ``RESULT`` records, wherever they stand (mpirun
    writing into a pipe may run two ranks' lines together; ``ringcomm run`` prefixes
    ``[rank] ``)."""
    found: dict[int, tuple[int, dict[str, Any]]] = {}
    for rank, world, body in _RESULT.findall(output):
        found[int(rank)] = (int(world), json.loads(body))
    return found


def assert_results(output: str, world: int) -> dict[int, dict[str, Any]]:
    """Every rank of ``world`` printed the expected results; returns them by rank."""
    found = parse_results(output)
    assert sorted(found) == list(range(world)), output
    for rank, (got_world, results) in found.items():
        assert got_world == world, output
        assert results == expected_results(rank, world), (rank, output)
    return {rank: results for rank, (_, results) in found.items()}


def ringcomm_run(world: int, timeout_s: float = 120.0) -> dict[int, dict[str, Any]]:
    """``ringcomm run -n world`` on the example: its results by rank."""
    proc = subprocess.run(
        [sys.executable, "-m", "ringcomm", "run", "-n", str(world), str(EXAMPLE)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return assert_results(proc.stdout, world)


def slurm_unavailable() -> str | None:
    """Why the needs_slurm tests cannot run here (None: they can): srun/sbatch/sinfo on PATH
    and a controller that answers with an idle node (SLURM_CONF, else the test bed's)."""
    missing = [b for b in ("srun", "sbatch", "sinfo") if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not on PATH (apt-get install slurm-wlm munge)"
    how = "start one: scripts/slurm_localhost.sh start"
    env = clean_env()
    conf = env.get("SLURM_CONF")
    if conf is None and not Path("/etc/slurm/slurm.conf").is_file():
        return f"no slurm.conf (SLURM_CONF unset, no /etc/slurm/slurm.conf; {how})"
    if conf == str(SLURM_TESTBED_CONF) and not _pid_alive(
        SLURM_TESTBED_CONF.parent / "slurmctld.pid"
    ):
        return f"the test bed's slurmctld is not running ({how})"  # sinfo would retry ~10 s
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-o", "%T"],
            env=env,
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"sinfo got no answer from a Slurm controller in 15 s ({how})"
    states = set(proc.stdout.split())
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return f"no Slurm controller answers: sinfo: {why[0]} ({how})"
    if not states & {"idle", "mixed"}:
        return f"no idle Slurm node (sinfo states: {sorted(states) or 'none'}; {how})"
    return None


def _pid_alive(pidfile: Path) -> bool:
    try:
        os.kill(int(pidfile.read_text().strip()), 0)
    except PermissionError:
        return True  # alive, someone else's
    except (OSError, ValueError):
        return False
    return True
