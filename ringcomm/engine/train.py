"""The training loop of one rank, the local launch of all ranks, and the JSON result.

:func:`train_rank` (``rc.spawn``'s target) builds the strategy, runs ``cfg.steps`` steps,
prints the loss as it goes (on the strategy's ``loss_rank``, when ``cfg.verbose``) and
returns this rank's measurements: losses, step times (on a GPU, after the step's kernels
finished), model-state bytes held at the end of the last step, ``peak_bytes``
(:mod:`.memory`: tracemalloc's peak over the steps on the host, the CuPy pool's high-water
on a GPU), the pinned staging buffers' bytes (``staging_bytes``; device runs) and how many
the run took from the staging pool, bytes sent per step (the group's counter), the
strategy's extras.
Launching the ranks is the CLI's (:func:`ringcomm.cli.train.run_training`: a top-layer
module, so the engine never imports the launcher).
:func:`summarize` turns the per-rank results into the ``train --json`` object (docs/contracts.md).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from ringcomm.config import mps_active
from ringcomm.engine.elastic import run_elastic
from ringcomm.engine.memory import TracemallocMeter, make_meter, staging_stats
from ringcomm.engine.strategy import TrainConfig, array_module, strategy_class
from ringcomm.schedule.pipeline import gpipe_bubble, shared_bubble_floor

__all__ = ["bubble_lines", "describe_model", "stage_placement", "summarize", "train_rank"]

#: BLAS threads per rank when several ranks share a host (set unless already set).


def describe_model(cfg: TrainConfig, numel: int) -> str:
    itemsize = 8 if cfg.dtype == "float64" else 4
    if cfg.model == "transformer":
        return (
            f"transformer vocab {cfg.vocab}, seq {cfg.seq_len}, d_model {cfg.d_model}, "
            f"{cfg.heads} heads, {cfg.depth} blocks ({cfg.act}): {numel:,} parameters, "
            f"{numel * itemsize / 2**20:.1f} MiB in {cfg.dtype}"
        )
    return (
        f"MLP {cfg.in_features}-{cfg.hidden}x{cfg.depth}-{cfg.classes} ({cfg.act}, layernorm): "
        f"{numel:,} parameters, {numel * itemsize / 2**20:.1f} MiB in {cfg.dtype}"
    )


def _staging_probe(strat: Any) -> Any:
    """An empty array of the kind this rank hands the group (None: nothing is staged)."""
    if strat.cfg.device == "cpu" or strat.pg is None:
        return None
    return strat.as_comm(strat.xp.empty(0, strat.dtype))


def train_rank(pg: Any, cfg: TrainConfig) -> dict[str, Any]:
    """Train on this rank (``pg`` None: single process); return its measurements."""
    if pg is not None and cfg.device == "host-staged":
        pg.device_windows = False  # host staging, not the device windows (ipc): its point
    meter = make_meter(cfg.device, array_module(cfg.device))
    meter.start()
    if cfg.elastic:
        try:
            meter.begin_step(0)  # the peak over the whole run (steps may be taken again)
            elastic = run_elastic(pg, cfg)
            meter.end_step()
            meter.stop()
            elastic.update(peak_bytes=int(meter.peak), peak_bytes_source=meter.source)
            return elastic
        finally:
            meter.stop()
    try:
        strat = strategy_class(cfg.strategy)(pg, cfg)
        if isinstance(meter, TracemallocMeter):
            meter.untraced_bytes = strat.symmetric_bytes
        rank = strat.rank
        if cfg.verbose and rank == 0:
            where = cfg.device if strat.device_id is None else f"cuda:{strat.device_id}"
            print(
                f"ringcomm train: strategy {cfg.strategy}, {strat.n} rank(s), device "
                f"{where}, {describe_model(cfg, strat.numel)}; {cfg.optimizer} lr {cfg.lr}, "
                f"global batch {cfg.batch_size}, {cfg.steps} steps, seed {cfg.seed}",
                flush=True,
            )
        probe = _staging_probe(strat)
        staging0 = staging_stats(probe)
        sent0 = pg.stats()["sent_bytes"] if pg is not None else 0
        moved0 = pg.stats()["workspace_bytes"] if pg is not None else 0
        losses, times = [], []
        for step in range(cfg.steps):
            meter.begin_step(step)
            t0 = time.perf_counter()
            loss = strat.step(step)
            strat.sync()  # (GPU) the step's kernels are finished before the clock is read
            dt = time.perf_counter() - t0
            meter.end_step()
            times.append(dt)
            if loss is not None:
                losses.append(loss)
                if cfg.verbose and rank == strat.loss_rank:
                    print(
                        f"[rank {rank}] step {step + 1}/{cfg.steps}  loss {loss:.6f}  "
                        f"{dt * 1e3:.1f} ms",
                        flush=True,
                    )
        sent = (pg.stats()["sent_bytes"] - sent0) if pg is not None else 0
        moved = (pg.stats()["workspace_bytes"] - moved0) if pg is not None else 0
        staging = staging_stats(probe)
        meter.stop()
        result: dict[str, Any] = {
            "rank": rank,
            "loss_rank": strat.loss_rank,
            "numel": strat.numel,
            "losses": losses,
            "step_times_s": times,
            **strat.state_nbytes(),
            "peak_bytes": int(meter.peak),
            "traced_bytes_end": int(meter.held),
            "peak_bytes_source": meter.source,
            "staging_bytes": staging["bytes"],
            "staging_acquires": staging["acquires"] - staging0["acquires"],
            "device_id": strat.device_id,
            "array_module": strat.xp.__name__,
            "sent_bytes_per_step": sent / max(cfg.steps, 1),
            # (on one host the collectives go through the shared workspace, not a socket)
            "workspace_bytes_per_step": moved / max(cfg.steps, 1),
            "extra": strat.extra(),
            "comm_summary": pg.comm_summary() if cfg.comm_summary and pg is not None else None,
        }
        if cfg.export:
            result["params"] = strat.export_params()
        return result
    finally:
        meter.stop()


def pipeline_bubble(per_rank: Sequence[dict[str, Any]]) -> list[float]:
    """Per step: ``1 - sum over stages of busy / (stages * longest span)``."""
    busy = [r["extra"]["busy_s"] for r in per_rank]
    span = [r["extra"]["span_s"] for r in per_rank]
    p = len(per_rank)
    out = []
    for k in range(len(busy[0])):
        makespan = max(sp[k] for sp in span)
        out.append(1.0 - sum(b[k] for b in busy) / (p * makespan) if makespan > 0 else 0.0)
    return out


def stage_placement(cfg: TrainConfig, per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Where the pipeline's stages computed, and the bubble that alone implies: ``units``
    compute units (distinct GPUs on ``cuda``, without MPS each runs one process's kernels
    at a time; else the CPU cores this job may use) shared by ``stages`` stage processes,
    so the measured bubble is at least ``shared_floor`` = ``1 - units/stages`` whatever the
    schedule (:func:`~ringcomm.schedule.pipeline.shared_bubble_floor`). The formula
    ``(p-1)/(m+p-1)`` assumes a unit per stage."""
    stages = len(per_rank)
    if cfg.device == "cuda":
        kind = "GPU"
        units = len({r["device_id"] for r in per_rank})
        mps = mps_active()
        floor_units = stages if mps else units  # (MPS: kernels of the stages may overlap)
    else:
        kind, mps = "CPU core", False
        units = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        units = min(units, os.cpu_count() or units)
        floor_units = units
    return {
        "stages": stages,
        "units": min(units, stages),
        "unit": kind,
        "mps": mps,
        "shared_floor": shared_bubble_floor(stages, min(floor_units, stages)),
    }


def bubble_lines(result: dict[str, Any]) -> list[str]:
    """The pipeline's bubble for people: measured, the formula, and (when stages share a
    compute unit) why the two differ."""
    measured, theory = result["bubble_fraction"], result["bubble_fraction_theory"]
    place = result["pipeline_placement"]
    p, m = place["stages"], result["micro_batches"]
    head = (
        f"pipeline {result['schedule']}, {m} micro-batches: bubble {measured:.3f} measured, "
        f"{theory:.3f} by the formula (p-1)/(m+p-1) = {p - 1}/{m + p - 1}, which assumes "
        f"each of the {p} stages computes on its own {place['unit']}"
    )
    lines = [head]
    if place["shared_floor"] > 0:
        units, unit = place["units"], place["unit"]
        plural = "s" if units > 1 else ""
        why = (
            "kernels of different processes do not run concurrently on one GPU without MPS"
            if unit == "GPU"
            else "a core runs one stage at a time"
        )
        lines.append(
            f"  here {p} stages share {units} {unit}{plural} ({why}): at most {units} "
            f"stage{plural} compute{'' if plural else 's'} at once, so the measured bubble is "
            f"at least 1 - {units}/{p}"
            f" = {place['shared_floor']:.3f} whatever the schedule, a floor the formula does "
            "not include: a measured figure above the formula here is the placement, not a "
            "schedule bug"
        )
    elif place["unit"] == "GPU" and place["mps"]:
        lines.append("  (MPS is active: the stages' kernels may overlap on a shared GPU)")
    return lines


def summarize(cfg: TrainConfig, per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``train --json`` object (docs/contracts.md, JSON output) plus extra keys."""
    loss_rank = per_rank[0]["loss_rank"]
    step_max = [max(r["step_times_s"][k] for r in per_rank) for k in range(cfg.steps)]
    timed = step_max[1:] if len(step_max) > 1 else step_max  # step 1 warms up
    out: dict[str, Any] = {
        "strategy": cfg.strategy,
        "world_size": len(per_rank),
        "steps": cfg.steps,
        "losses": per_rank[loss_rank]["losses"],
        "step_time_s": statistics.median(timed) if timed else 0.0,
        "per_rank": [
            {
                "rank": r["rank"],
                "param_bytes": r["param_bytes"],
                "grad_bytes": r["grad_bytes"],
                "optim_bytes": r["optim_bytes"],
                "peak_bytes": r["peak_bytes"],
                "sent_bytes_per_step": r["sent_bytes_per_step"],
                "workspace_bytes_per_step": r["workspace_bytes_per_step"],
                "staging_bytes": r["staging_bytes"],
                **({"device_id": r["device_id"]} if r["device_id"] is not None else {}),
                **{
                    k: v
                    for k, v in r["extra"].items()
                    if not isinstance(v, list) or k == "stage_layers"
                },
            }
            for r in per_rank
        ],
        "device": cfg.device,
        "peak_bytes_source": per_rank[0]["peak_bytes_source"],
        "dtype": cfg.dtype,
        "optimizer": cfg.optimizer,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "model": {
            "in_features": cfg.in_features,
            "hidden": cfg.hidden,
            "depth": cfg.depth,
            "classes": cfg.classes,
            "act": cfg.act,
            "params": per_rank[0]["numel"],
            "kind": cfg.model,
            **(
                {
                    "vocab": cfg.vocab,
                    "seq_len": cfg.seq_len,
                    "d_model": cfg.d_model,
                    "heads": cfg.heads,
                    "blocks": cfg.depth,
                }
                if cfg.model == "transformer"
                else {}
            ),
        },
        "step_times_s": step_max,
    }
    if cfg.strategy in ("dp", "zero1", "zero2"):
        out["bucket_bytes"] = cfg.bucket_bytes
    if cfg.strategy in ("tp", "3d"):
        extra0 = per_rank[0]["extra"]
        out["mesh_shape"] = extra0["mesh_shape"]
        out["sequence_parallel"] = extra0["sequence_parallel"]
        if cfg.strategy == "3d":
            out.update(micro_batches=cfg.micro_batches, schedule=cfg.schedule, zero=cfg.zero)
    if cfg.strategy == "ps":
        from ringcomm.engine.ps import ps_summary

        out["ps"] = ps_summary(per_rank)
    if cfg.strategy == "pipeline":
        bubbles = pipeline_bubble(per_rank)
        measured = bubbles[1:] if len(bubbles) > 1 else bubbles
        out.update(
            schedule=cfg.schedule,
            micro_batches=cfg.micro_batches,
            bubble_fraction=statistics.median(measured) if measured else 0.0,
            bubble_fraction_best=min(measured) if measured else 0.0,
            bubble_fraction_per_step=bubbles,
            bubble_fraction_theory=gpipe_bubble(len(per_rank), cfg.micro_batches),
            pipeline_placement=stage_placement(cfg, per_rank),
        )
        for row, r in zip(out["per_rank"], per_rank):
            peaks = r["extra"]["activation_peak_bytes"]
            row["activation_peak_bytes"] = max(peaks) if peaks else None
    return out
