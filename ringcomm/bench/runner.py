"""Parent side of ``ringcomm bench``: start the ranks, merge their records into results.

* ringcomm alone, or with ``--compare gloo``: one :func:`ringcomm.spawn` job running
  :func:`~ringcomm.bench.collectives.rank_main` (Gloo in the same processes, interleaved
  per size).
* ``--compare mpi``: per round, one ringcomm job then one mpirun job, each a whole sweep
  (MPI ranks are mpirun's own processes); iteration times of the rounds are pooled.
"""

from __future__ import annotations

import dataclasses

from ringcomm.bench.report import Result, aggregate, merge_rounds
from ringcomm.bench.spec import BenchConfig
from ringcomm.bench.sweep import Record
from ringcomm.config import environment

__all__ = ["aggregate", "merge_rounds", "run"]


def run(config: BenchConfig) -> list[Result]:
    """Run the benchmark ``config`` describes; one result per (size, implementation)."""
    from ringcomm.bench.collectives import rank_main
    from ringcomm.launch import spawn

    if config.bind is not None:  # the ranks read it in init_process_group
        environment()["RINGCOMM_BIND"] = config.bind

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
