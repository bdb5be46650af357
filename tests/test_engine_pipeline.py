"""Pipeline parallelism, measured: GPipe's bubble and 1F1B's activation memory (p = 2).

Bubble: per step, ``1 - sum(busy) / (p * makespan)`` where ``busy`` is each stage's time in
forward/backward compute (wall clock) and the makespan runs from a barrier to the last
stage's end. Compared with (p-1)/(m+p-1) = 0.2 for p=2, m=4 within 0.1 absolute. To make
the measurement mean something on a small, shared machine, the per-micro-batch compute
(~2 x 128x1024x1024 matmuls per stage) dwarfs the messages (512 KiB activations) and BLAS
runs one thread per rank. It is still wall clock on two cores shared with other work, and
other processes' CPU use inflates it: at load average ~16 on the two cores, per-step values
ranged 0.23-0.54 and the median of 7 steps missed the band in 3 of 4 jobs, while the best
step was within it in all 4. So the test takes the best of steps 2..8 of a job (as timing
benchmarks take the best of N), and retries up to ATTEMPTS jobs before failing. It is
reliable on a quiet machine (median and best both ~0.21-0.25); under heavy load it can
still fail, which says the machine was busy, not that the schedule changed.

Activation memory: stage 0 of 1F1B holds at most p micro-batches' activations, GPipe all
m; measured as tracemalloc's peak within a step above the step's starting level.
"""

from __future__ import annotations

from typing import Any

import pytest

import ringcomm as rc
from ringcomm.engine.strategy import TrainConfig
from ringcomm.engine.train import pipeline_bubble, train_rank
from ringcomm.schedule.pipeline import gpipe_bubble

P = 2
#: Jobs tried before the bubble test fails (wall-clock on a shared machine, see above).
ATTEMPTS = 5
BIG = {
    "strategy": "pipeline",
    "world_size": P,
    "dtype": "float32",
    "in_features": 1024,
    "hidden": 1024,
    "depth": 4,
    "classes": 10,
    "batch_size": 512,
    "timeout_s": 120.0,
}
BUBBLE = TrainConfig(micro_batches=4, schedule="gpipe", steps=8, **BIG)
MEMORY = [TrainConfig(micro_batches=8, schedule=s, steps=2, **BIG) for s in ("gpipe", "1f1b")]


def pipeline_job(pg: Any, cases: list[TrainConfig]) -> list[dict[str, Any]]:
    out = []
    for cfg in cases:
        sub = pg.new_group(range(pg.world_size))
        try:
            out.append(train_rank(sub, cfg))
        finally:
            sub.close()
    return out


def _threads_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpipe_bubble_matches_theory(
    no_child_processes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _threads_one(monkeypatch)
    want = gpipe_bubble(P, BUBBLE.micro_batches)
    seen = []
    for _attempt in range(ATTEMPTS):
        per_rank = [r[0] for r in rc.spawn(pipeline_job, P, args=([BUBBLE],), timeout_s=150)]
        got = min(pipeline_bubble(per_rank)[1:])  # step 1 warms up
        seen.append(round(got, 3))
        if abs(got - want) <= 0.10:
            break
    print(f"bubble measured {seen} (attempts), theory {want:.3f}")
    assert abs(got - want) <= 0.10, f"bubble measured {seen} (attempts), theory {want:.3f}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_1f1b_holds_less_activation_memory_than_gpipe(
    no_child_processes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _threads_one(monkeypatch)
    per_rank = rc.spawn(pipeline_job, P, args=(MEMORY,), timeout_s=150)
    gpipe, f1b = per_rank[0]  # stage 0: the most micro-batches alive
    assert gpipe["extra"]["max_live_micro_batches"] == 8
    assert f1b["extra"]["max_live_micro_batches"] == P
    g_peak = max(gpipe["extra"]["activation_peak_bytes"])
    f_peak = max(f1b["extra"]["activation_peak_bytes"])
    # 8 vs 2 micro-batches of ~4 MiB each (plus the same transient buffers in both)
    assert f_peak < 0.6 * g_peak, (f_peak, g_peak)
    assert g_peak > 8 * 2 * 2**20
    for s in range(P):  # every stage: 1F1B below GPipe; same losses (same math)
        g, f = per_rank[s]
        assert max(f["extra"]["activation_peak_bytes"]) < max(g["extra"]["activation_peak_bytes"])
    assert per_rank[P - 1][0]["losses"] == pytest.approx(per_rank[P - 1][1]["losses"], rel=1e-5)
