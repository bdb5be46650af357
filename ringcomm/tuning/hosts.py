"""``ringcomm tune --hostfile F | -H h1:2,h2:2 [--ssh-config F]``: fit the cost model across hosts.

One job of the ssh launcher (``ringcomm run --hostfile ... -m ringcomm.tuning.hosts CONFIG``,
as ``ringcomm bench --hostfile`` starts its ranks, :mod:`ringcomm.bench.multihost`) runs,
on every rank of every host at once, the probes of :data:`ringcomm.tuning.costmodel.PROBE_KINDS`
(float32 sum all_reduce): the flat ring over the whole group, the hierarchical schedule in
two segment sizes, only its steps across hosts (every local rank's ring with the ranks of
its local index elsewhere, all at once) and only its steps on the hosts. Each is checked
once, then timed back to back (the bench's convention: each rank's median, the slowest
rank's). Every rank also reports its host's boot id and the cores it may run on: hosts
with one boot id are one machine (network namespaces, containers) and share its cores.

:func:`ringcomm.tuning.costmodel.fit_hosts` then fits the network's effective alpha and beta and
the CPU terms (:class:`ringcomm.tuning.costmodel.CpuModel`) to the measured times; the rest (the
same-host link, the reduction, the per-call overhead) comes from ``--base`` (a file of
``ringcomm tune`` on one host) or the defaults. The command prints each probe beside the
fitted model and writes the JSON (format version 2) that ``RINGCOMM_TUNE_FILE`` and
``ringcomm model --model`` read.

Each rank line it reads is ``RINGCOMM-BENCH-RECORDS {"rank", "hostname", "records"}`` (the
bench's marker, so the launcher's output is filtered the same way).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringcomm.config import environ_changed
from ringcomm.tuning.costmodel import HIER_SEGMENT_BYTES, CostModel, HostFit, HostSample, fit_hosts

__all__ = [
    "DEFAULT_SIZE",
    "SMALL_SIZE",
    "HostInfo",
    "cpu_pools",
    "probe",
    "probe_specs",
    "run_probe",
    "samples_from",
]

#: Bytes per rank of the large probes (float32 elements * 4).
DEFAULT_SIZE = 32 << 20
#: Bytes per rank of the small probe across hosts (its latency).
SMALL_SIZE = 64 << 10
#: The hierarchical probe's second segment size (the first: the default, 8 MiB).
SMALL_SEGMENT = 1 << 20


def probe_specs(size: int) -> list[tuple[str, int, int | None]]:
    """(kind, bytes per rank, segment bytes) of each probe, in the order they run."""
    return [
        ("cross", SMALL_SIZE, None),
        ("cross", size, None),
        ("host", size, None),
        ("flat", size, None),
        ("hier", size, HIER_SEGMENT_BYTES),
        ("hier", size, SMALL_SEGMENT),
    ]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: every host its own machine
        return f"{socket.gethostname()}-{os.getpid()}"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1


def probe(pg: Any, specs: Sequence[Sequence[Any]], iters: int, warmup: int) -> dict[str, Any]:
    """What every rank runs: each probe of ``specs`` checked once, then ``warmup`` untimed
    and ``iters`` timed calls back to back; this rank's times and wrong elements."""
    from ringcomm.collectives.hierarchy import Hierarchy
    from ringcomm.ops import ReduceOp

    topo = pg.topology
    if topo.num_hosts < 2 or not topo.uniform or topo.max_local_size < 2:
        raise ValueError(
            f"ringcomm tune --hostfile needs at least 2 hosts with the same number (>= 2) of "
            f"ranks each; got {[len(h) for h in topo.hosts]} ranks per host"
        )
    h = Hierarchy(pg, topo)
    hosts, per_host, n = topo.num_hosts, topo.max_local_size, topo.world_size
    cross, local, me = h.cross[h.local_rank], h.local, h.local.rank

    def host_steps(x: Any) -> None:  # the host's reduce_scatter and all_gather, in place
        rows = x.reshape(per_host, -1)
        local.reduce_scatter(rows, out=rows[me])
        local.all_gather(rows[me], out=rows)

    runs: dict[str, tuple[Callable[[Any, int | None], Any], int]] = {
        "flat": (lambda x, _s: pg.all_reduce(x, algo="ring"), n),
        "hier": (lambda x, s: h.all_reduce(x, ReduceOp.SUM, None, s), n),
        "cross": (lambda x, _s: cross.all_reduce(x, algo="ring"), hosts),
        "host": (lambda x, _s: host_steps(x), per_host),
    }
    records = []
    for kind, size, segment in specs:
        fn, expect = runs[kind]
        count = max(per_host, size // 4 // per_host * per_host)
        x = np.ones(count, np.float32)
        fn(x, segment)
        errors = int(np.count_nonzero(x != expect))
        x[:] = 1.0
        for _ in range(warmup):
            fn(x, segment)
        pg.barrier()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn(x, segment)
            times.append(time.perf_counter() - t0)
        records.append(
            {
                "kind": kind,
                "size": count * 4,
                "segment": segment,
                "times_s": times,
                "errors": errors,
            }
        )
    return {
        "host": int(topo.host_of[pg.rank]),
        "hosts": hosts,
        "ranks_per_host": per_host,
        "boot_id": _boot_id(),
        "cores": _cores(),
        "records": records,
    }


@dataclass(frozen=True)
class HostInfo:
    """What a rank found out about its host."""

    host: int  # the host's index in the group's topology
    hostname: str
    boot_id: str
    cores: int


def cpu_pools(infos: Sequence[HostInfo]) -> tuple[float, int]:
    """``(cores, shared_hosts)`` of :class:`ringcomm.tuning.costmodel.CpuModel` from every rank's
    report: hosts reporting one boot id are one machine; ``shared_hosts`` is 0 when every
    host is on one machine, else the most hosts any machine holds (1: hosts of their own);
    ``cores``: the fewest cores a rank of the busiest machine may run on."""
    hosts_of: dict[str, set[int]] = {}
    cores_of: dict[str, int] = {}
    for i in infos:
        hosts_of.setdefault(i.boot_id, set()).add(i.host)
        cores_of[i.boot_id] = min(cores_of.get(i.boot_id, i.cores), i.cores)
    if not hosts_of:
        raise ValueError("cpu_pools: no reports")
    busiest = max(hosts_of, key=lambda b: (len(hosts_of[b]), -cores_of[b]))
    all_hosts = {i.host for i in infos}
    shared = 0 if len(hosts_of) == 1 and len(all_hosts) > 1 else len(hosts_of[busiest])
    return float(cores_of[busiest]), shared


def samples_from(per_rank: Sequence[dict[str, Any]]) -> tuple[list[HostSample], list[float], int]:
    """Every probe's :class:`HostSample` (the time: the slowest rank's median), the
    fastest time of each (the slowest rank's minimum), and the wrong elements in all."""
    first = per_rank[0]
    samples, mins, wrong = [], [], 0
    for i, rec in enumerate(first["records"]):
        times = [r["records"][i]["times_s"] for r in per_rank]
        wrong += sum(int(r["records"][i]["errors"]) for r in per_rank)
        med = max(statistics.median(t) for t in times)
        mins.append(max(min(t) for t in times))
        samples.append(
            HostSample(
                rec["kind"],
                int(first["hosts"]),
                int(first["ranks_per_host"]),
                int(rec["size"]),
                med,
                rec["segment"],
            )
        )
    return samples, mins, wrong


def run_probe(
    hosts: Any, size: int, iters: int, warmup: int, timeout_s: float
) -> tuple[list[dict[str, Any]], list[HostInfo]]:
    """One probe job on ``hosts`` (:class:`ringcomm.bench.multihost.HostsSpec`) through
    the ssh launcher: every rank's report and host."""
    from ringcomm.bench.multihost import run_collecting
    from ringcomm.bench.sweep import MARK

    config = {"specs": probe_specs(size), "iters": iters, "warmup": warmup}
    argv = [sys.executable, "-m", "ringcomm", "run"]
    argv += ["--hostfile", hosts.hostfile] if hosts.hostfile else ["-H", hosts.hosts_option]
    if hosts.ssh_config is not None:
        argv += ["--ssh-config", hosts.ssh_config]
    argv += ["-n", str(hosts.world_size), "-m", "ringcomm.tuning.hosts", json.dumps(config)]
    # (the launcher passes RINGCOMM_* on; the probes name their algorithms)
    with environ_changed({"RINGCOMM_TUNE_FILE": "none", "RINGCOMM_ALGO": None}):
        code, lines = run_collecting(argv, timeout_s, "the probe job")
    if code != 0:
        raise RuntimeError(f"the probe job on {hosts.describe()} exited with status {code}")
    per_rank: list[dict[str, Any] | None] = [None] * hosts.world_size
    infos = []
    for line in lines:
        msg = json.loads(line.partition(MARK)[2])
        rep = msg["records"]
        per_rank[int(msg["rank"])] = rep
        infos.append(
            HostInfo(int(rep["host"]), str(msg["hostname"]), str(rep["boot_id"]), int(rep["cores"]))
        )
    missing = [r for r, v in enumerate(per_rank) if v is None]
    if missing:
        raise RuntimeError(f"no report from rank(s) {', '.join(map(str, missing))}")
    return [r for r in per_rank if r is not None], infos


def fit(
    samples: Sequence[HostSample], infos: Sequence[HostInfo], base: CostModel, source: str
) -> HostFit:
    cores, shared = cpu_pools(infos)
    return fit_hosts(samples, base, cores=cores, shared_hosts=shared, source=source)


def main(argv: Sequence[str] | None = None) -> int:
    """On every rank (under ``ringcomm run``): ``python -m ringcomm.tuning.hosts CONFIG``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m ringcomm.tuning.hosts CONFIG_JSON", file=sys.stderr)
        return 2
    config = json.loads(args[0])
    import ringcomm as rc
    from ringcomm.bench.multihost import report

    with rc.init_process_group() as pg:
        report(pg, probe(pg, config["specs"], int(config["iters"]), int(config["warmup"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
