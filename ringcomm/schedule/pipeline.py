"""Pipeline-parallel schedules: pure functions returning ordered (stage, micro-batch, F/B).

``p`` stages, ``m`` micro-batches; each stage runs its own action list
(:func:`stage_orders`): GPipe (every forward, then every backward; bubble
:func:`gpipe_bubble`) or 1F1B (warm-up forwards, then one forward one backward, then the
drain: the same bubble, at most ``p - s`` micro-batches live on stage ``s``).

Invariants: forward of micro-batch ``i`` on stage ``s`` follows its forward on ``s-1``;
backward on ``s`` follows the backward on ``s+1``. :func:`simulate` places every action on a
clock, which proves a set of orders deadlock-free and gives :func:`schedule`'s global
order. Details: docs/architecture.md, section "schedule/pipeline.py".
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "SCHEDULES",
    "Action",
    "Timeline",
    "gpipe_bubble",
    "live_activations",
    "schedule",
    "shared_bubble_floor",
    "simulate",
    "stage_orders",
]

FORWARD = "F"
BACKWARD = "B"
SCHEDULES = ("gpipe", "1f1b")


class Action(NamedTuple):
    stage: int
    micro: int
    kind: str  # "F" or "B"


def _check(p: int, m: int) -> None:
    if p <= 0 or m <= 0:
        raise ValueError(f"need stages > 0 and micro-batches > 0, got {p} and {m}")


def _gpipe_stage(s: int, m: int) -> list[Action]:
    return [Action(s, i, FORWARD) for i in range(m)] + [
        Action(s, i, BACKWARD) for i in range(m - 1, -1, -1)
    ]


def _one_f_one_b_stage(s: int, p: int, m: int) -> list[Action]:
    warm = min(p - s - 1, m)
    acts = [Action(s, i, FORWARD) for i in range(warm)]
    for i in range(m - warm):  # steady state: one forward, one backward
        acts.append(Action(s, warm + i, FORWARD))
        acts.append(Action(s, i, BACKWARD))
    acts += [Action(s, i, BACKWARD) for i in range(m - warm, m)]  # cool-down
    return acts


def stage_orders(p: int, m: int, name: str = "gpipe") -> list[list[Action]]:
    """Each stage's actions in the order it runs them."""
    _check(p, m)
    if name == "gpipe":
        return [_gpipe_stage(s, m) for s in range(p)]
    if name == "1f1b":
        return [_one_f_one_b_stage(s, p, m) for s in range(p)]
    raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {SCHEDULES}")


class Timeline(NamedTuple):
    start: dict[Action, float]
    end: dict[Action, float]
    makespan: float
    busy: list[float]  # per stage

    @property
    def bubble(self) -> float:
        """Idle share of ``stages x makespan``."""
        p = len(self.busy)
        return 1.0 - sum(self.busy) / (p * self.makespan) if self.makespan > 0 else 0.0


def simulate(orders: list[list[Action]], fwd_s: float = 1.0, bwd_s: float = 1.0) -> Timeline:
    """Run the stages' orders on a clock: an action starts when its stage is free and its
    dependency has ended; forward takes ``fwd_s``, backward ``bwd_s``, messages are free.
    Raises ValueError if the orders deadlock (or miss or repeat an action)."""
    p = len(orders)
    end: dict[Action, float] = {}
    start: dict[Action, float] = {}
    free = [0.0] * p
    busy = [0.0] * p
    nxt = [0] * p
    total = sum(len(o) for o in orders)
    while len(end) < total:
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                a = orders[s][nxt[s]]
                if a.stage != s:
                    raise ValueError(f"stage {s}'s order holds {a}")
                if a.kind == FORWARD:
                    dep = Action(s - 1, a.micro, FORWARD) if s > 0 else None
                elif s < p - 1:
                    dep = Action(s + 1, a.micro, BACKWARD)
                else:
                    dep = Action(s, a.micro, FORWARD)
                if dep is not None and dep not in end:
                    break
                t0 = max(free[s], end[dep] if dep is not None else 0.0)
                dt = fwd_s if a.kind == FORWARD else bwd_s
                if a in end:
                    raise ValueError(f"{a} appears twice")
                start[a], end[a] = t0, t0 + dt
                free[s] = t0 + dt
                busy[s] += dt
                nxt[s] += 1
                progressed = True
        if not progressed:
            stuck = [orders[s][nxt[s]] for s in range(p) if nxt[s] < len(orders[s])]
            raise ValueError(f"pipeline orders deadlock; waiting: {stuck}")
    return Timeline(start, end, max(end.values(), default=0.0), busy)


def schedule(p: int, m: int, name: str = "gpipe") -> list[Action]:
    """Every action of one step in the order it happens (unit forward and backward times;
    simultaneous actions by stage)."""
    tl = simulate(stage_orders(p, m, name))
    return sorted(tl.start, key=lambda a: (tl.start[a], a.stage))


def live_activations(order: list[Action]) -> int:
    """Most micro-batches whose forward ran and backward did not yet, over one stage's order."""
    live = peak = 0
    for a in order:
        live += 1 if a.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def gpipe_bubble(p: int, m: int) -> float:
    """The pipeline bubble of GPipe (and 1F1B): ``(p-1)/(m+p-1)``."""
    _check(p, m)
    return (p - 1) / (m + p - 1)


def shared_bubble_floor(p: int, units: int) -> float:
    """The least bubble of ``p`` stages that share ``units`` compute units, each running
    one stage at a time (several stage processes on one GPU without MPS, or on one core):
    at most ``units`` stages compute at once, so ``sum(busy) <= units * makespan`` and the
    bubble ``1 - sum(busy) / (p * makespan)`` is at least ``1 - units/p`` whatever the
    schedule. 0 when every stage has a unit of its own."""
    if p < 1 or units < 1:
        raise ValueError(f"need p >= 1 stages and units >= 1, got p={p}, units={units}")
    return max(0.0, 1.0 - units / p)
