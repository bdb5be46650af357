"""``ringcomm tune [--out FILE.json] [-n 2] [--sizes 8,1K,...]``: fit the cost model here.

Measures this machine's same-host link class with a short probe (one job of ``-n`` local
ranks through the benchmark harness, :mod:`ringcomm.bench`: ring all_reduce,
reduce_scatter and all_gather at a few sizes, checked, then timed back to back), fits the per-call overhead,
alpha, beta and gamma of :mod:`ringcomm.tuning.costmodel` by least squares and writes a JSON that
``ringcomm model --model FILE`` loads and a process group chooses its algorithms and
piece sizes with (``RINGCOMM_TUNE_FILE``; the default ``--out``, ``ringcomm-model.json``,
is where a group whose rank 0 starts in this directory looks). On one host the network
parameters come from ``--net-gbps``/``--net-latency-us``; with ``--hostfile``/``-H`` a
probe across the hosts (every rank active, through the ssh launcher) measures the network's
effective alpha and beta and the CPU the ranks of a host (and co-located hosts) share, and
fits them (:mod:`ringcomm.tuning.hosts`). Exit status: 0; 1 if a rank failed or a result was
wrong; 2 for a usage error.

``ringcomm tune --hostfile F | -H h1:2,h2:2 [--ssh-config F]``: fit it across hosts
(:mod:`ringcomm.tuning.hosts`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ringcomm.cli.options import add_hosts_options, add_nproc_option, add_ssh_config_option
from ringcomm.config import (
    DEFAULT_TUNE_FILE,
    UsageError,
    check_output_path,
    env_chunk_bytes,
    environ_changed,
    format_size,
    parse_size,
    size_arg,
)
from ringcomm.tuning.costmodel import CostModel, Fit, Sample, design_row, fit_local

if TYPE_CHECKING:
    from ringcomm.bench.sweep import Record
    from ringcomm.group import ProcessGroup

__all__ = ["DEFAULT_SIZES", "PROBE_OPS", "add_parser", "main", "probe_rank"]

#: The probe's sizes (bytes per rank): small ones pin alpha and the overhead, large ones beta
#: and gamma; the largest keeps each piece below the 4 MiB chunk (the fit is linear there).
DEFAULT_SIZES: tuple[int, ...] = (8, 1 << 10, 16 << 10, 128 << 10, 1 << 20, 4 << 20)
#: (bench op, cost-model algorithm) the probe runs: three rings whose message, byte and
#: reduction counts differ, so overhead, alpha, beta and gamma are told apart even on 2
#: ranks (all_reduce = reduce_scatter + all_gather - one call's overhead). A sendrecv would
#: not do: it is two calls (isend, irecv) and two waits, another overhead than a collective's.
PROBE_OPS: tuple[tuple[str, str], ...] = (
    ("all_reduce", "ring"),
    ("reduce_scatter", "ring"),
    ("all_gather", "ring"),
)
#: What the probe sets for its ranks: the ring over the link, not the one-host workspace,
#: with the group's own piece size (no earlier model's).
PROBE_ENV = {"RINGCOMM_ALGO": "ring", "RINGCOMM_WORKSPACE": "0", "RINGCOMM_TUNE_FILE": "none"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from ringcomm.cli.model import add_link_options

    p: argparse.ArgumentParser = subparsers.add_parser(
        "tune",
        help="measure this host's links and fit the cost model (for ringcomm model --model)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--out",
        default=DEFAULT_TUNE_FILE,
        metavar="FILE.json",
        help="where to write the model (default %(default)s: where a group "
        "started here finds it; elsewhere set RINGCOMM_TUNE_FILE)",
    )
    add_nproc_option(p, "ranks of the probe (default 2 on one host; every slot with --hostfile/-H)")
    add_hosts_options(
        p,
        hostfile_help="probe across these hosts over ssh ('host slots=N' a line)",
        hosts_help="probe across these hosts",
    )
    add_ssh_config_option(p, "ssh config for the hosts")
    p.add_argument(
        "--size",
        type=size_arg,
        default=None,
        metavar="S",
        help="across hosts: bytes per rank of the large probes (default 32M)",
    )
    p.add_argument(
        "--base",
        metavar="FILE.json",
        help="across hosts: the same-host link, reduction and overhead from this "
        "file (ringcomm tune on one host; default: the model's defaults)",
    )
    p.add_argument(
        "--sizes",
        default=",".join(format_size(s) for s in DEFAULT_SIZES),
        metavar="S[,S...]",
        help="bytes per rank (default %(default)s)",
    )
    p.add_argument("--iters", type=int, default=10, help="timed iterations (default %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first (default %(default)s)")
    p.add_argument(
        "--stat",
        choices=("min", "median"),
        default="min",
        help="on one host, what of each rank's iteration times is fitted (max over "
        "ranks): min resists a busy host, median is the bench's time (default "
        "%(default)s; across hosts: median)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="bound on the probe job (default 60; 300 across hosts)",
    )
    add_link_options(p, local=False)
    p.set_defaults(main=main)
    return p


def probe_rank(pg: ProcessGroup, specs: Sequence[Any], config: Any) -> list[Record]:
    """What each rank of the probe runs: the bench sweep of every spec, in order."""
    from ringcomm.bench.collectives import RingcommImpl
    from ringcomm.bench.sweep import run_sweep

    return run_sweep([RingcommImpl(pg)], config, pg.rank, specs=specs, progress=False)


def _chunk_bytes() -> int:
    try:
        return env_chunk_bytes()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_timing(args: argparse.Namespace, default_timeout_s: float) -> None:
    """Check --iters and --warmup; set --timeout-s (``default_timeout_s`` when not given)."""
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be >= 1 and --warmup >= 0")
    if args.timeout_s is None:
        args.timeout_s = default_timeout_s
    if not args.timeout_s > 0:
        raise UsageError(f"--timeout-s must be > 0, got {args.timeout_s}")


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({parse_size(t) for t in text.split(",") if t.strip()})
    except ValueError as exc:
        raise UsageError(f"--sizes: {exc}") from None
    if len(sizes) < 2 or sizes[0] < 1:
        raise UsageError("--sizes needs at least two distinct sizes >= 1 byte")
    return sizes


def _format_fit(fit: Fit) -> str:
    return (
        f"# fit: overhead {fit.overhead_s * 1e6:.2f} us/call, alpha {fit.alpha_s * 1e6:.2f} "
        f"us/message, beta {fit.beta_s_per_byte * 1e12:.1f} ps/B "
        f"({_rate(fit.beta_s_per_byte)}), gamma {fit.gamma_s_per_byte * 1e12:.1f} ps/B "
        f"({_rate(fit.gamma_s_per_byte)}); rms relative error {fit.rms_relative_error:.1%}\n"
    )


def _where_used(out: str) -> str:
    """How a group finds the model written to ``out`` (RINGCOMM_TUNE_FILE, docs/cost-model.md)."""
    if os.path.normpath(out) == DEFAULT_TUNE_FILE:
        return f"those whose rank 0 starts here, or RINGCOMM_TUNE_FILE={os.path.abspath(out)}"
    return f"RINGCOMM_TUNE_FILE={os.path.abspath(out)}"


def _rate(s_per_byte: float) -> str:
    return "free" if s_per_byte <= 0 else f"{1 / s_per_byte / 1e9:.3g} GB/s"


def main(args: argparse.Namespace) -> int:
    from ringcomm.bench.report import summarize
    from ringcomm.bench.spec import BenchConfig, SizeSpec, element_count
    from ringcomm.cli.model import model_from_args
    from ringcomm.errors import RankFailedError
    from ringcomm.launch import spawn

    check_output_path(args.out, "--out")
    if args.hostfile is not None or args.hosts is not None:
        return _main_hosts(args)
    if args.ssh_config is not None or args.size is not None or args.base is not None:
        raise UsageError("--ssh-config, --size and --base apply with --hostfile or -H only")
    n = 2 if args.nproc is None else args.nproc
    if n < 2:
        raise UsageError(f"-n must be >= 2 (a link needs two ranks), got {n}")
    _check_timing(args, default_timeout_s=60.0)
    sizes = _parse_sizes(args.sizes)
    chunk = _chunk_bytes()
    net_model = model_from_args(args, CostModel())  # the --net-* options, checked up front
    plan: list[tuple[str, str, SizeSpec]] = []
    for op, algo in PROBE_OPS:
        for size in sizes:
            count = element_count(op, size, 4, n)
            redop = "sum" if op in ("all_reduce", "reduce_scatter") else None
            spec = SizeSpec(op, n, "float32", count, redop, -1)
            try:
                design_row(op, algo, n, spec.nbytes, chunk)
            except ValueError:
                raise UsageError(
                    f"--sizes: {format_size(size)} is too large for the linear fit "
                    f"({op} on {n} ranks sends pieces over {format_size(chunk)})"
                ) from None
            plan.append((op, algo, spec))
    config = BenchConfig(
        op="all_reduce",
        world_size=n,
        iters=args.iters,
        warmup=args.warmup,
        check=True,
        quiet=True,
        timeout_s=args.timeout_s,
    )
    print(
        f"# ringcomm tune: {n} local ranks, {', '.join(op for op, _ in PROBE_OPS)} at "
        f"{', '.join(format_size(s) for s in sizes)} B; {args.warmup} warmup + {args.iters} "
        f"timed iterations (fitted: {args.stat} per rank, max over ranks); "
        + " ".join(f"{k}={v}" for k, v in PROBE_ENV.items()),
        flush=True,
    )
    t0 = time.perf_counter()
    try:
        with environ_changed(PROBE_ENV):
            per_rank = spawn(
                probe_rank, n, args=([s for *_, s in plan], config), timeout_s=args.timeout_s
            )
    except RankFailedError as exc:
        print(f"ringcomm tune: error: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0
    samples: list[Sample] = []
    medians: list[float] = []
    wrong = 0
    for i, (op, algo, spec) in enumerate(plan):
        times = [r[i]["times_s"] for r in per_rank]
        result = summarize("ringcomm", spec, times, [r[i]["errors"] for r in per_rank])
        wrong += result.errors or 0
        medians.append(result.time_us * 1e-6)
        fitted = medians[-1] if args.stat == "median" else max(min(t) for t in times)
        samples.append(Sample(op, algo, n, spec.nbytes, fitted))
    if wrong:
        print(f"ringcomm tune: error: {wrong} wrong elements in the probe", file=sys.stderr)
        return 1
    fit = fit_local(samples, chunk)
    print(f"{'op':<12}{'bytes':>10}{'median':>13}{args.stat:>13}{'model':>13}{'error':>8}")
    for s, med, p in zip(samples, medians, fit.predicted_s):
        print(
            f"{s.op:<12}{s.size:>10}{med * 1e6:>10.1f} us{s.time_s * 1e6:>10.1f} us"
            f"{p * 1e6:>10.1f} us{(p - s.time_s) / s.time_s:>8.1%}"
        )
    print(_format_fit(fit), end="")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    model = fit.apply(
        net_model.replace(chunk_bytes=chunk),
        source=f"ringcomm tune -n {n} on {os.uname().nodename} at {stamp}; net from options",
    )
    model.save(args.out)
    print(f"# net (from options, not measured): {model.net.describe()}")
    print(f"# probe took {elapsed:.1f} s; wrote {args.out} (ringcomm model --model {args.out})")
    print(f"# groups choose algorithms and piece sizes with it: {_where_used(args.out)}")
    return 0


def _main_hosts(args: argparse.Namespace) -> int:
    """``ringcomm tune --hostfile F | -H ...``: the probe across hosts and its fit."""
    from ringcomm.cli.bench import hosts_from_args
    from ringcomm.cli.model import model_from_args
    from ringcomm.tuning.costmodel import HIER_SEGMENT_BYTES, predict_sample
    from ringcomm.tuning.hosts import (
        DEFAULT_SIZE,
        cpu_pools,
        fit,
        probe_specs,
        run_probe,
        samples_from,
    )

    _check_timing(args, default_timeout_s=300.0)
    if args.net_gbps is not None or args.net_latency_us is not None:
        raise UsageError("--net-gbps/--net-latency-us: across hosts the network is measured")
    size = DEFAULT_SIZE if args.size is None else args.size
    if size < (1 << 20):
        raise UsageError(f"--size must be at least 1M, got {format_size(size)}")
    hosts = hosts_from_args(args)
    assert hosts is not None
    if (
        len(hosts.placement) < 2
        or len({n for _, n in hosts.placement}) != 1
        or (hosts.placement[0][1] < 2)
    ):
        raise UsageError(
            f"--hostfile/-H: the probe needs >= 2 hosts with the same number (>= 2) of ranks "
            f"each, got {hosts.describe()}"
        )
    if args.base is not None:
        args.model = args.base
    base = model_from_args(args).replace(chunk_bytes=_chunk_bytes())
    print(
        f"# ringcomm tune across hosts: {hosts.describe()}; float32 sum all_reduce probes "
        + ", ".join(
            f"{k} {format_size(s)}" + (f" (segments {format_size(g)})" if g else "")
            for k, s, g in probe_specs(size)
        )
        + f"; {args.warmup} warmup + {args.iters} timed (each rank's median, the slowest rank's)",
        flush=True,
    )
    t0 = time.perf_counter()
    try:
        per_rank, infos = run_probe(hosts, size, args.iters, args.warmup, args.timeout_s)
    except RuntimeError as exc:
        print(f"ringcomm tune: error: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0
    samples, mins, wrong = samples_from(per_rank)
    if wrong:
        print(f"ringcomm tune: error: {wrong} wrong elements in the probe", file=sys.stderr)
        return 1
    cores, shared = cpu_pools(infos)
    machines = len({i.boot_id for i in infos})
    print(
        f"# {len(hosts.placement)} hosts on {machines} machine(s) (boot ids); a pool of "
        f"{cores:g} core(s) shared by the ranks of "
        + ("every host" if shared == 0 else f"{shared} host(s)")
    )
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result = fit(
        samples,
        infos,
        base,
        f"ringcomm tune --hostfile on {hosts.describe()} at "
        f"{stamp}; local, reduce, overhead from {args.base or 'defaults'}",
    )
    print(
        f"{'probe':<8}{'bytes':>10}{'segment':>9}{'median':>12}{'min':>12}{'model':>12}{'error':>8}"
    )
    for s, low, p in zip(samples, mins, result.predicted_s, strict=True):
        seg = format_size(s.segment_bytes) if s.segment_bytes else "-"
        print(
            f"{s.kind:<8}{format_size(s.size):>10}{seg:>9}{s.time_s * 1e3:>9.2f} ms"
            f"{low * 1e3:>9.2f} ms{p * 1e3:>9.2f} ms{(p - s.time_s) / s.time_s:>8.1%}"
        )
    model = result.model
    assert model.cpu is not None
    print(
        f"# fit: net {model.net.describe()}; {model.cpu.describe()}; rms relative error "
        f"{result.rms_relative_error:.1%}, worst {result.max_relative_error:.1%}"
    )
    h, per_host = samples[0].hosts, samples[0].ranks_per_host
    for kind in ("flat", "hier"):
        t = predict_sample(
            model, type(samples[0])(kind, h, per_host, 64 << 20, 1.0, HIER_SEGMENT_BYTES)
        )
        print(f"# predicted: {kind} all_reduce of 64M on {h} x {per_host}: {t * 1e3:.1f} ms")
    model.save(args.out)
    print(f"# probe took {elapsed:.1f} s; wrote {args.out} (ringcomm model --model {args.out})")
    print(f"# groups choose algorithms, piece and segment sizes with it: {_where_used(args.out)}")
    return 0
