"""Soak at full size (benchmarks/soak.py): 100k small and 1k large collectives on 2 ranks,
every result checked; RSS after the run within 5% of RSS after warm-up, open file
descriptors unchanged, on every rank."""

from __future__ import annotations

import importlib
import pathlib
import sys
from typing import Any

import pytest

_BENCHMARKS = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")


def _load_soak() -> Any:
    """benchmarks/soak.py as module ``soak`` (importable by name in spawned ranks, which
    inherit sys.path)."""
    if _BENCHMARKS not in sys.path:
        sys.path.insert(0, _BENCHMARKS)
    return importlib.import_module("soak")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_memory_and_descriptors_stay_flat(no_child_processes: None) -> None:
    soak = _load_soak()
    reports = soak.run(2, 100_000, 1000, 4 << 20, warmup=0.1, timeout_s=850)
    assert [r["small_calls"] for r in reports] == [100_000] * 2
    assert [r["large_calls"] for r in reports] == [1000] * 2
    problems = soak.verdict(reports, 0.05)
    assert not problems, problems
    for r in reports:
        assert r["stats"]["dropped_frames"] == 0 and r["stats"]["unexpected_messages"] == 0
