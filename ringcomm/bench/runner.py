"""Parent side of ``ringcomm bench``: start the ranks, merge their records into results.

* ringcomm alone, or with ``--compare gloo``: one :func:`ringcomm.spawn` job running
  :func:`~ringcomm.bench.collectives.rank_main` (Gloo in the same processes, interleaved
  per size).
* ``--compare mpi``: per round, one ringcomm job then one mpirun job, each a whole sweep
  (MPI ranks are mpirun's own processes); iteration times of the rounds are pooled.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from ringcomm.bench.report import Result, summarize
from ringcomm.bench.spec import BenchConfig
from ringcomm.bench.sweep import Record

__all__ = ["aggregate", "merge_rounds", "run"]


def run(config: BenchConfig) -> list[Result]:
    """Run the benchmark ``config`` describes; one result per (size, implementation)."""
    from ringcomm.bench.collectives import rank_main
    from ringcomm.launch import spawn

    if config.bind is not None:  # the ranks read it in init_process_group
        os.environ["RINGCOMM_BIND"] = config.bind

    if config.compare != "mpi":
        per_rank = spawn(rank_main, config.world_size, args=(config,), timeout_s=config.timeout_s)
        return aggregate(config, per_rank)

    from ringcomm.bench.mpi import run_mpi

    rounds: list[list[list[Record]]] = []
    for rnd in range(config.rounds):
        one = dataclasses.replace(config, rounds=1, compare=None, check=config.check and rnd == 0)
        rounds.append(spawn(rank_main, config.world_size, args=(one,), timeout_s=config.timeout_s))
        rounds.append(run_mpi(one))
    return aggregate(config, merge_rounds(rounds))


def merge_rounds(rounds: Sequence[Sequence[Sequence[Record]]]) -> list[list[Record]]:
    """Pool per-rank records of several jobs: times of the same (impl, size) concatenated,
    the first checked error count kept."""
    world = len(rounds[0])
    merged: list[dict[tuple[str, int], Record]] = [{} for _ in range(world)]
    for job in rounds:
        if len(job) != world:
            raise ValueError("merge_rounds: jobs of different world sizes")
        for rank, records in enumerate(job):
            for rec in records:
                key = (rec["impl"], rec["count"])
                have = merged[rank].get(key)
                if have is None:
                    merged[rank][key] = {**rec, "times_s": list(rec["times_s"])}
                else:
                    have["times_s"].extend(rec["times_s"])
                    if have["errors"] is None:
                        have["errors"] = rec["errors"]
    return [list(m.values()) for m in merged]


def aggregate(config: BenchConfig, per_rank: Sequence[Sequence[Record]]) -> list[Result]:
    """Results in sweep order, each size's implementations in ``config.impls`` order."""
    specs = {s.count: s for s in config.sizes()}
    keyed: list[dict[tuple[str, int], Record]] = [
        {(r["impl"], r["count"]): r for r in records} for records in per_rank
    ]
    results = []
    for count, spec in specs.items():
        for impl in config.impls:
            recs = [k[(impl, count)] for k in keyed if (impl, count) in k]
            if not recs:
                continue
            if len(recs) != len(per_rank):
                raise ValueError(f"{impl} {spec.nbytes} B: records from only some ranks")
            times, errors = [r["times_s"] for r in recs], [r["errors"] for r in recs]
            results.append(summarize(impl, spec, times, errors, str(recs[0].get("algo") or "")))
    return results
