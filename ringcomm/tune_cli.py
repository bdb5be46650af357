"""``ringcomm tune [--out FILE.json] [-n 2] [--sizes 8,1K,...]``: fit the cost model here.

Measures this machine's same-host link class with a short probe (one job of ``-n`` local
ranks through the benchmark harness, :mod:`ringcomm.bench`: ring all_reduce,
reduce_scatter and all_gather at a few sizes, checked, then timed back to back), fits the per-call overhead,
alpha, beta and gamma of :mod:`ringcomm.costmodel` by least squares and writes a JSON that
``ringcomm model --model FILE`` loads and a process group chooses its algorithms and
piece sizes with (``RINGCOMM_TUNE_FILE``; the default ``--out``, ``ringcomm-model.json``,
is where a group whose rank 0 starts in this directory looks). Across hosts there is
nothing to measure from one host: the network parameters come from
``--net-gbps``/``--net-latency-us`` (a hostfile probe is left for the multi-host bench).
Exit status: 0; 1 if a rank failed or a result was
wrong; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .config import DEFAULT_CHUNK_BYTES, DEFAULT_TUNE_FILE, UsageError, format_size, parse_size
from .costmodel import CostModel, Fit, Sample, design_row, fit_local

if TYPE_CHECKING:
    from .bench.sweep import Record
    from .group import ProcessGroup

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
    from .model_cli import add_link_options

    p: argparse.ArgumentParser = subparsers.add_parser(
        "tune",
        help="measure this host's links and fit the cost model (for ringcomm model --model)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("--out", default=DEFAULT_TUNE_FILE, metavar="FILE.json",
                   help="where to write the model (default %(default)s: where a group "
                   "started here finds it; elsewhere set RINGCOMM_TUNE_FILE)")  # fmt: skip
    p.add_argument("-n", "--nproc", type=int, default=2, metavar="N",
                   help="local ranks of the probe (default %(default)s)")  # fmt: skip
    p.add_argument("--sizes", default=",".join(format_size(s) for s in DEFAULT_SIZES),
                   metavar="S[,S...]", help="bytes per rank (default %(default)s)")  # fmt: skip
    p.add_argument("--iters", type=int, default=10, help="timed iterations (default %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first (default %(default)s)")
    p.add_argument("--stat", choices=("min", "median"), default="min",
                   help="what of each rank's iteration times is fitted (max over ranks): min "
                   "resists a busy host, median is the bench's time (default %(default)s)")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=60.0, metavar="S",
                   help="bound on the probe job (default %(default)s)")  # fmt: skip
    add_link_options(p, local=False)
    p.set_defaults(main=main)
    return p


def probe_rank(pg: ProcessGroup, specs: Sequence[Any], config: Any) -> list[Record]:
    """What each rank of the probe runs: the bench sweep of every spec, in order."""
    from .bench.collectives import RingcommImpl
    from .bench.sweep import run_sweep

    return run_sweep([RingcommImpl(pg)], config, pg.rank, specs=specs, progress=False)


@contextmanager
def _environ(changes: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _chunk_bytes() -> int:
    text = os.environ.get("RINGCOMM_CHUNK_BYTES")
    if not text:
        return DEFAULT_CHUNK_BYTES
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"RINGCOMM_CHUNK_BYTES: {exc}") from None


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
    from .bench.report import summarize
    from .bench.spec import BenchConfig, SizeSpec, element_count
    from .errors import RankFailedError
    from .launch import spawn
    from .model_cli import model_from_args

    n = args.nproc
    if n < 2:
        raise UsageError(f"-n must be >= 2 (a link needs two ranks), got {n}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be >= 1 and --warmup >= 0")
    if not args.timeout_s > 0:
        raise UsageError(f"--timeout-s must be > 0, got {args.timeout_s}")
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
    config = BenchConfig(op="all_reduce", world_size=n, iters=args.iters, warmup=args.warmup,
                         check=True, quiet=True, timeout_s=args.timeout_s)  # fmt: skip
    print(
        f"# ringcomm tune: {n} local ranks, {', '.join(op for op, _ in PROBE_OPS)} at "
        f"{', '.join(format_size(s) for s in sizes)} B; {args.warmup} warmup + {args.iters} "
        f"timed iterations (fitted: {args.stat} per rank, max over ranks); "
        + " ".join(f"{k}={v}" for k, v in PROBE_ENV.items()),
        flush=True,
    )
    t0 = time.perf_counter()
    try:
        with _environ(PROBE_ENV):
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
