"""Elastic training: ``ringcomm train --strategy dp|ps --elastic``.

The ``dp`` strategy (or ``ps`` under bsp) driven so that it survives a lost rank: a step
that fails with ``PeerFailedError`` is undone on every survivor (from a snapshot taken at
the step's start), the survivors ``shrink()``, agree on the earliest step among them,
re-split the *same* global batch and run it again; with ``--max-restarts K`` the lost slot
is started again and admitted at a step boundary (``grow(wait=True)``), getting the step,
parameters and optimizer state from a survivor. ``cfg.fail_at`` injects a kill at a step
(or mid-step, after a given bucket). Each membership change is recorded (step, event,
slots, time lost).

Invariant: every step's loss is the mean over the whole global batch, so every later
step equals ``single``'s. What the loop needs of a strategy is :class:`ElasticStrategy`
(:data:`ELASTIC_STRATEGIES`). Details: docs/architecture.md, section "engine/elastic.py".
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ringcomm.engine.strategy import TrainConfig, strategy_class
from ringcomm.errors import PeerFailedError

__all__ = [
    "ELASTIC_STRATEGIES",
    "ElasticStrategy",
    "agree_step",
    "restore",
    "run_elastic",
    "snapshot",
    "summarize_elastic",
]

#: The strategies ``--elastic`` runs.
ELASTIC_STRATEGIES = ("dp", "ps")


class ElasticStrategy(Protocol):
    """What :func:`run_elastic` needs of a strategy besides ``step``."""

    #: Called with each gradient transfer of a step once launched (fault injection).
    after_launch: Callable[[Any], None] | None
    #: What the group is handed for a model buffer (``Strategy.as_comm``).
    as_comm: Any
    #: The optimizer's step count (snapshotted with the state arrays).
    opt_steps: int

    @property
    def votes_step(self) -> bool:
        """Whether this rank's step counts when the survivors agree on one."""

    @property
    def replicas(self) -> Any:
        """The group whose ranks hold :meth:`state_arrays` alike (a restarted rank gets
        them from a survivor there); None: this rank holds none."""

    @property
    def numel(self) -> int: ...

    def step(self, step: int) -> float | None: ...

    def state_arrays(self) -> list[Any]:
        """What a snapshot copies and a restarted rank gets."""

    def launches_per_step(self) -> int:
        """How many gradient transfers a step launches (``fail_at``'s bucket counts them)."""

    def abandon(self) -> None:
        """A step failed: let its outstanding transfers end (they fail too)."""

    def regroup(self, pg: Any, step: int = 0) -> None:
        """Go on over ``pg`` (after a shrink or grow) at the start of step ``step``."""

    def finish(self) -> None:
        """After the last step."""

    def state_nbytes(self) -> dict[str, int]: ...

    def export_params(self) -> dict[str, np.ndarray]: ...


def make_elastic(pg: Any, cfg: TrainConfig) -> ElasticStrategy:
    """``cfg.strategy``'s strategy on ``pg`` (one of :data:`ELASTIC_STRATEGIES`)."""
    if cfg.strategy not in ELASTIC_STRATEGIES:
        raise ValueError(
            f"elastic training runs {' or '.join(ELASTIC_STRATEGIES)}, not {cfg.strategy!r}"
        )
    strat: ElasticStrategy = strategy_class(cfg.strategy)(pg, cfg)  # type: ignore[assignment]
    return strat


def snapshot(strat: ElasticStrategy) -> tuple[list[Any], int]:
    """A copy of ``strat``'s parameters and optimizer state (and its step count)."""
    return [a.copy() for a in strat.state_arrays()], strat.opt_steps


def restore(strat: ElasticStrategy, snap: tuple[list[Any], int]) -> None:
    """Put :func:`snapshot`'s copy back."""
    arrays, t = snap
    for dst, src in zip(strat.state_arrays(), arrays, strict=True):
        dst[...] = src
    strat.opt_steps = t


def _inject(strat: ElasticStrategy, bucket: int | None) -> None:
    """Fault injection: die now (``bucket`` None), or once the ``bucket``-th gradient
    transfer of this step is done (it is waited for: ``dp``, every survivor has that
    all-reduce; ``ps``, every worker pushed that key)."""
    if bucket is None:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    if not 0 <= bucket < strat.launches_per_step():
        raise ValueError(f"fail_at: bucket {bucket} of a step of {strat.launches_per_step()}")
    launched = [0]

    def after_launch(work: Any) -> None:
        if launched[0] == bucket:
            work.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        launched[0] += 1

    strat.after_launch = after_launch


def agree_step(pg: Any, strat: ElasticStrategy, step: int, prev_snap: Any) -> int:
    """After a shrink: the step every survivor takes again, the earliest among them (a
    survivor whose last step completed before it saw the failure is one ahead: it goes
    back to the snapshot before that step). A rank that does not vote (``votes_step``
    False: a ps server) takes the step agreed."""
    at = np.array([step if strat.votes_step else np.iinfo(np.int64).max], np.int64)
    pg.all_reduce(at, op="min")
    first = int(at[0])
    if first == step or not strat.votes_step:
        return first
    if first != step - 1 or prev_snap is None:  # collectives keep ranks within one step
        raise RuntimeError(f"rank {pg.rank}: elastic: survivors at steps {first} and {step}")
    restore(strat, prev_snap)
    return first


def _lowest(group: Any, have: bool) -> int:
    """The lowest rank of ``group`` that has the state (``have``)."""
    flags = group.all_gather(np.array([1 if have else 0], np.int8)).ravel()
    return int(np.flatnonzero(flags)[0])


def _share_state(pg: Any, strat: ElasticStrategy, step: int, have: bool) -> int:
    """After a grow: the lowest-ranked survivor (``have``) sends the step number to
    everyone, and the lowest-ranked survivor of ``strat.replicas`` the parameters and the
    optimizer state to its group; returns the step."""
    meta = np.array([step], np.int64)
    pg.broadcast(meta, _lowest(pg, have))
    group = strat.replicas
    if group is not None:
        root = _lowest(group, have)
        t = np.array([strat.opt_steps], np.int64)
        group.broadcast(t, root)
        for a in strat.state_arrays():
            group.broadcast(strat.as_comm(a), root)
        strat.opt_steps = int(t[0])
    return int(meta[0])


def _shrink(
    pg: Any, strat: ElasticStrategy, step: int, back: Any, t0: float, changes: list[dict[str, Any]]
) -> tuple[Any, int]:
    """A peer failed at ``step`` (in it, or in the grow at its start): the survivors'
    group, and the step they take again (``back``: the snapshot before this rank's last
    step, for a rank one ahead); the change recorded in ``changes``."""
    pg = pg.shrink()
    seen_at, step = step, agree_step(pg, strat, step, back)
    strat.regroup(pg, step)
    changes.append(_change("shrink", step, pg, t0, seen_at=seen_at))
    return pg, step


def _change(event: str, step: int, pg: Any, t0: float, **seen: Any) -> dict[str, Any]:
    """The record of a change of the group (``event``) that took the time since ``t0``."""
    return {
        "step": step,
        **seen,
        "event": event,
        "slots": pg.slots,
        "time_lost_s": time.perf_counter() - t0,
        "at_s": time.time(),
    }


def run_elastic(pg: Any, cfg: TrainConfig) -> dict[str, Any]:
    """Train ``cfg.steps`` steps of ``cfg.strategy`` on ``pg`` through failures (module
    docstring). Returns per step index the loss and the time (this process's steps
    only), the membership changes, and the state bytes at the end."""
    strat = make_elastic(pg, cfg)
    losses: dict[int, float] = {}
    times: dict[int, float] = {}
    changes: list[dict[str, Any]] = []
    step = 0
    fresh = bool(pg.rejoined)
    # A restarted process always rejoined: only a slot's first process injects its failure.
    kills: dict[int, int | None] = {}  # step -> the transfer to die after (None: at once)
    if not fresh:
        mine = [f for f in cfg.fail_at if int(f[0]) == pg.slot]
        kills = {int(f[1]): (int(f[2]) if len(f) > 2 else None) for f in mine}
    snap = prev_snap = None
    sent0, steps_in_group = pg.stats()["sent_bytes"], 0
    while True:
        if fresh:  # a restarted rank, just admitted: where the others are
            step = _share_state(pg, strat, step, have=False)
            fresh = False
        elif cfg.max_restarts:
            t0 = time.perf_counter()
            # A slot being started again: wait for it here; the strategy lets go of this
            # group (a ps server's request loops) before anyone closes it.
            try:
                grown = pg.grow(wait=True, on_admit=strat.abandon)
            except PeerFailedError:  # a rank went right after the last step: as in a step
                strat.abandon()
                pg, step = _shrink(pg, strat, step, snap, t0, changes)
                sent0, steps_in_group = pg.stats()["sent_bytes"], 0
                continue
            if grown is not pg:
                pg = grown
                strat.regroup(pg, step)
                step = _share_state(pg, strat, step, have=True)
                sent0, steps_in_group = pg.stats()["sent_bytes"], 0
                changes.append(_change("grow", step, pg, t0))
        if step >= cfg.steps:
            break
        if step in kills:
            _inject(strat, kills[step])
        prev_snap, snap = snap, snapshot(strat)
        t0 = time.perf_counter()
        try:
            loss = strat.step(step)
        except PeerFailedError:
            strat.abandon()
            restore(strat, snap)
            pg, step = _shrink(pg, strat, step, prev_snap, t0, changes)
            sent0, steps_in_group = pg.stats()["sent_bytes"], 0
            continue  # the same step again, on the survivors
        times[step] = time.perf_counter() - t0
        if loss is not None:  # (every rank of an elastic strategy has it)
            losses[step] = loss
        steps_in_group += 1
        if cfg.verbose and pg.rank == 0 and loss is not None:
            print(
                f"[slot {pg.slot}] step {step + 1}/{cfg.steps}  loss {loss:.6f}  "
                f"{times[step] * 1e3:.1f} ms  ({pg.world_size} ranks)",
                flush=True,
            )
        step += 1
    strat.finish()
    return {
        "slot": pg.slot,
        "rank": pg.rank,
        "rejoined": bool(pg.rejoined),
        "losses_by_step": {str(k): v for k, v in sorted(losses.items())},
        "times_by_step": {str(k): v for k, v in sorted(times.items())},
        "membership": changes,
        "final_slots": pg.slots,
        "numel": strat.numel,
        # (the last group's: each shrink or grow makes a new transport)
        "sent_bytes_per_step": (pg.stats()["sent_bytes"] - sent0) / max(steps_in_group, 1),
        "params": strat.export_params() if cfg.export else None,
        **strat.state_nbytes(),
    }


def summarize_elastic(
    cfg: TrainConfig, per_rank: Sequence[dict[str, Any] | None]
) -> dict[str, Any]:
    """The ``train --json`` object of an elastic run: per step the loss (every rank that
    took the step has the same, all-reduced) and the slowest rank's time; the membership
    changes; per slot (its last process) the state bytes."""
    results = [r for r in per_rank if r is not None]
    losses, step_times = [], []
    for k in range(cfg.steps):
        got = [r["losses_by_step"][str(k)] for r in results if str(k) in r["losses_by_step"]]
        losses.append(got[0] if got else None)
        step_times.append(max((r["times_by_step"].get(str(k), 0.0) for r in results), default=0.0))
    changes: dict[tuple[int, str, tuple[int, ...]], dict[str, Any]] = {}
    for r in results:
        for c in r["membership"]:
            key = (c["step"], c["event"], tuple(c["slots"]))  # (two shrinks in one step)
            if key not in changes or c["time_lost_s"] > changes[key]["time_lost_s"]:
                changes[key] = c
    timed = step_times[1:] if len(step_times) > 1 else step_times
    final_slots: list[int] = max((r["final_slots"] for r in results), key=len, default=[])
    ps = (
        {
            "servers": cfg.ps_servers,
            "workers": len(final_slots) - cfg.ps_servers,
            "consistency": cfg.consistency,
            "update": cfg.ps_update,
        }
        if cfg.strategy == "ps"
        else None
    )
    return {
        "strategy": cfg.strategy,
        "elastic": True,
        "world_size": cfg.world_size,
        "steps": cfg.steps,
        "losses": losses,
        "step_time_s": statistics.median(timed) if timed else 0.0,
        "step_times_s": step_times,
        "membership": sorted(changes.values(), key=lambda c: float(c["at_s"])),
        "final_slots": final_slots,
        "per_rank": [
            {
                "rank": r["slot"],
                "rejoined": r["rejoined"],
                "param_bytes": r["param_bytes"],
                "grad_bytes": r["grad_bytes"],
                "optim_bytes": r["optim_bytes"],
                "peak_bytes": r["peak_bytes"],
                "sent_bytes_per_step": r["sent_bytes_per_step"],
            }
            for r in sorted(results, key=lambda r: int(r["slot"]))
        ],
        "lost_slots": [slot for slot, r in enumerate(per_rank) if r is None],
        "peak_bytes_source": results[0]["peak_bytes_source"] if results else None,
        "device": cfg.device,
        "dtype": cfg.dtype,
        "optimizer": cfg.optimizer,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "model": {"params": results[0]["numel"] if results else 0},
        **({"ps": ps} if ps is not None else {}),
    }
