"""``ringcomm bench``: nccl-tests-style sweeps of ringcomm collectives, side by side with
Gloo (torch.distributed) and MPI (mpi4py) in the same invocation.

Modules (top to bottom):

* :mod:`~ringcomm.bench.report` -- pure: the sweep plan (sizes, element counts, shapes),
  busbw factors, aggregation of per-rank times, the table, JSON rows, the footer.
* :mod:`~ringcomm.bench.inputs` -- pure NumPy: rank-seeded inputs and the expected results.
* :mod:`~ringcomm.bench.sweep` -- the rank-side timing loop, generic over implementations
  (A B A B per size, warm-up, per-iteration times, check before timing).
* :mod:`~ringcomm.bench.collectives` (ringcomm), :mod:`~ringcomm.bench.gloo` (the only
  module that imports torch), :mod:`~ringcomm.bench.mpi` (mpi4py, run under mpirun): one
  family each, each with ``bench(group, config) -> records``.
* :mod:`~ringcomm.bench.runner` -- parent side: starts the ranks, merges their records.
* :mod:`~ringcomm.bench.plot` (matplotlib, optional), :mod:`~ringcomm.cli.bench`.
"""
