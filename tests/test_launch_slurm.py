"""srun and sbatch for real, on a one-node Slurm cluster (marker needs_slurm).

``.ci/run`` starts the cluster with ``scripts/slurm_localhost.sh start`` (Debian's slurm-wlm
and munge; munged, slurmctld and slurmd on this host) and stops it at the end. Each rank
runs ``docs/examples/collectives.py``: rank and world size come from ``SLURM_PROCID`` /
``SLURM_NTASKS``, the store from the first host of ``SLURM_JOB_NODELIST`` and a port derived
from ``SLURM_JOB_ID`` (DESIGN.md §1); the results must equal ``ringcomm run``'s and the
values each rank computes alone. The sbatch test submits the script the docs show
(``docs/examples/collectives.sbatch``) and waits for it (``sbatch --wait``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launcher_results import (
    EXAMPLE,
    SBATCH_EXAMPLE,
    assert_results,
    clean_env,
    ringcomm_run,
)

pytestmark = [pytest.mark.needs_slurm, pytest.mark.timeout(240)]


def _python_dir_first(env: dict[str, str]) -> dict[str, str]:
    """``python`` in the job means this interpreter (its venv holds ringcomm's deps)."""
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def test_srun_matches_ringcomm_run() -> None:
    proc = subprocess.run(
        ["srun", "-n", "4", "--time=5", "python", str(EXAMPLE)],
        env=_python_dir_first(clean_env()),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert assert_results(proc.stdout, 4) == ringcomm_run(4)


def test_sbatch_script_from_the_docs(tmp_path: Path) -> None:
    # The job runs where collectives.py is, as the script's first line says to submit it.
    work = tmp_path / "job"
    work.mkdir()
    shutil.copy(EXAMPLE, work / EXAMPLE.name)
    proc = subprocess.run(
        ["sbatch", "--wait", "--parsable", str(SBATCH_EXAMPLE)],
        cwd=work,
        env=_python_dir_first(clean_env()),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    job_id = proc.stdout.strip().split(";")[0]
    outputs = sorted(work.glob("ringcomm-collectives-*.out"))
    text = "\n".join(p.read_text() for p in outputs)
    assert proc.returncode == 0, proc.stdout + proc.stderr + text
    assert [p.name for p in outputs] == [f"ringcomm-collectives-{job_id}.out"]
    assert_results(text, 4)
