"""``ringcomm bench OP -n N``: an nccl-tests-style sweep, optionally beside Gloo or MPI.

Pipeline: ``add_parser`` (argparse) -> :func:`config_from_args` (a frozen
:class:`~ringcomm.bench.spec.BenchConfig`; :class:`UsageError` for what cannot run) ->
:func:`~ringcomm.bench.runner.run` -> the table and footer on stdout, ``--json`` rows,
``--plot`` figure. Exit status: 0; 1 if ``--check`` found wrong values or a rank failed;
2 for a usage error or a missing optional dependency (torch, mpirun/mpi4py, matplotlib):
:class:`UsageError`, printed by :mod:`ringcomm.cli`. Option defaults are
:class:`BenchConfig`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ringcomm.bench.multihost import HostsSpec
from ringcomm.bench.report import Result, format_footer, format_table, json_row
from ringcomm.bench.spec import DEVICES, GLOO_DTYPES, OPS, REDUCING_OPS, BenchConfig
from ringcomm.cli.options import add_hosts_options, add_nproc_option, add_ssh_config_option
from ringcomm.config import (
    BIND_MODES,
    UsageError,
    bind_mode,
    binds_to_core,
    check_output_path,
    format_size,
    size_arg,
)

__all__ = [
    "UsageError",
    "add_parser",
    "config_from_args",
    "crowding_warning",
    "main",
    "preamble",
    "write_outputs",
]

_PROG = "ringcomm bench"
_REDOPS = ("sum", "avg", "max", "min", "prod")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the CLI's subparsers (see :mod:`ringcomm.cli`)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="nccl-tests-style bandwidth/latency sweep of a collective",
        description="Sweep buffer sizes of one operation over N local ranks (or ranks on other hosts "
        "over ssh: --hostfile, -H) and print an "
        "nccl-tests-style table (time = median per rank, max over ranks; GB/s = 1e9 B/s). "
        "With --compare, the same sweep through Gloo, MPI or NCCL in the same invocation, "
        "alternating implementations per size, with ratios.",
    )
    # Its arguments, in the order --help lists them.
    _add_sweep_args(p)
    _add_op_args(p)
    _add_compare_args(p)
    _add_job_args(p)
    p.set_defaults(main=main)
    return p


def _add_sweep_args(p: argparse.ArgumentParser) -> None:
    """``bench``'s operation, ranks and sizes, and its iterations per size."""
    p.add_argument("op", choices=OPS, metavar="OP", help=f"one of: {', '.join(OPS)}")
    add_nproc_option(
        p, "number of ranks (required on one host; with --hostfile/-H default every slot)"
    )
    for flags, default, what, more in (
        (("-b", "--minbytes"), BenchConfig.begin, "smallest", "; K/M/G suffixes"),
        (("-e", "--maxbytes"), BenchConfig.end, "largest", ""),
    ):
        text = f"{what} size (default {format_size(default)}{more})"
        p.add_argument(*flags, type=size_arg, default=default, metavar="SIZE", help=text)
    p.add_argument(
        "-f",
        "--stepfactor",
        type=int,
        default=BenchConfig.factor,
        metavar="F",
        help="size multiplier between steps (default %(default)s)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=BenchConfig.iters,
        help="timed iterations per size and round (default %(default)s)",
    )
    p.add_argument(
        "-w",
        "--warmup",
        type=int,
        default=BenchConfig.warmup,
        help="untimed iterations first (default %(default)s)",
    )


def _add_op_args(p: argparse.ArgumentParser) -> None:
    """``bench``'s element type, reduce op and root, checking, and ``--json``."""
    from ringcomm.core.buffers import SUPPORTED_DTYPE_NAMES

    p.add_argument(
        "-d",
        "--dtype",
        default=BenchConfig.dtype,
        choices=SUPPORTED_DTYPE_NAMES,
        metavar="DTYPE",
        help="element type (default %(default)s)",
    )
    p.add_argument(
        "-o",
        "--op",
        dest="redop",
        default=BenchConfig.redop,
        choices=_REDOPS,
        help="reduce op of all_reduce/reduce_scatter (default %(default)s)",
    )
    p.add_argument(
        "-r",
        "--root",
        type=int,
        default=BenchConfig.root,
        help="broadcast root (default %(default)s)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="verify every size against NumPy before timing it (#wrong column)",
    )
    p.add_argument(
        "-c",
        dest="check_n",
        type=int,
        choices=(0, 1),
        default=None,
        metavar="0|1",
        help="nccl-tests' spelling: -c 1 is --check, -c 0 is none",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write one JSON object per size and implementation: impl, op, world_size, "
        "bytes, count, dtype, time_us, algbw_GBps, busbw_GBps, errors, algo (the docs' "
        "Contracts page)",
    )


def _add_compare_args(p: argparse.ArgumentParser) -> None:
    """``bench``'s peer implementation (``--compare``), devices and core binding."""
    p.add_argument(
        "--compare",
        choices=("gloo", "mpi", "nccl"),
        help="also run the sweep through torch.distributed Gloo (on CUDA tensors with "
        "--device cuda) or NCCL (one rank per GPU), or mpi4py",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="R",
        help="alternations per size (A B A B...; times pooled); default 2 with --compare, else 1",
    )
    p.add_argument(
        "--mpi-tcp",
        action="store_true",
        help="with --compare mpi: force Open MPI's TCP transport over loopback",
    )
    p.add_argument(
        "--device",
        default=",".join(BenchConfig.devices),
        metavar="D[,D...]",
        help="where ringcomm's buffers live: host (NumPy), cuda (CuPy on the rank's GPU: "
        "LOCAL_RANK modulo the GPUs), standin (the host stand-in for CuPy arrays, through "
        "the algorithm CuPy arrays take: device windows on one host), host-staged (the "
        "stand-in through host staging, as CuPy across hosts), cuda-staged (CuPy through "
        "host staging: the path before device windows), symmetric (NumPy arrays "
        "from pg.alloc: on one host in memory every rank maps), copy (not a collective: "
        "every rank's numpy.copyto of the size at once, the memory-bandwidth reference); "
        "several, comma-separated, "
        "run side by side with ratios of the first over the others (e.g. cuda,host)",
    )
    p.add_argument(
        "--bind",
        choices=BIND_MODES,
        default=None,
        help="core: each rank's driving thread on one core, rank modulo the cores (Gloo's "
        "threads, started later, inherit it); auto: so when ranks > cores; default: "
        "RINGCOMM_BIND, else auto",
    )


def _add_job_args(p: argparse.ArgumentParser) -> None:
    """``bench``'s ``--plot``, hosts (multi-host over ssh), time bound and quiet mode."""
    p.add_argument("--plot", metavar="FILE.png", help="draw busbw and time vs size")
    add_hosts_options(
        p,
        hostfile_help="multi-host: ranks on these hosts over ssh (one host a line, 'host slots=N')",
        hosts_help="multi-host: hosts and slots",
    )
    add_ssh_config_option(p, "multi-host: ssh config for ssh/mpirun")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=BenchConfig.timeout_s,
        metavar="S",
        help="bound on the whole job (default %(default)s)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> BenchConfig:
    """Validate parsed arguments into a :class:`BenchConfig`; raise :class:`UsageError`.

    Without ``--bind`` the ranks inherit ``RINGCOMM_BIND`` from ``environ`` (default: the
    process's environment): that setting, checked here, is the config's ``bind``.
    """
    hosts = hosts_from_args(args)
    if hosts is not None:
        args.nproc = hosts.world_size
    elif args.nproc is None:
        raise UsageError("-n is required (or --hostfile / -H for ranks on several hosts)")
    if args.nproc < 1:
        raise UsageError(f"-n must be >= 1, got {args.nproc}")
    if args.op == "sendrecv" and args.nproc < 2:
        raise UsageError("sendrecv needs -n >= 2 (a ring of ranks)")
    if args.minbytes < 1:
        raise UsageError(f"-b must be >= 1 byte, got {args.minbytes}")
    if args.maxbytes < args.minbytes:
        raise UsageError(f"-e ({args.maxbytes}) must be >= -b ({args.minbytes})")
    if args.stepfactor < 2 and args.maxbytes != args.minbytes:
        raise UsageError(f"-f must be >= 2, got {args.stepfactor}")
    if args.iters < 1:
        raise UsageError(f"--iters must be >= 1, got {args.iters}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    rounds = args.rounds if args.rounds is not None else (2 if args.compare else 1)
    if rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {rounds}")
    if args.op == "broadcast" and not 0 <= args.root < args.nproc:
        raise UsageError(f"--root {args.root} is not a rank of {args.nproc}")
    if args.op in REDUCING_OPS and args.redop == "avg" and args.dtype == "bool":
        raise UsageError("--op avg is not defined on bool")
    if args.mpi_tcp and args.compare != "mpi":
        raise UsageError("--mpi-tcp applies to --compare mpi only")
    if not args.timeout_s > 0:
        raise UsageError(f"--timeout-s must be > 0, got {args.timeout_s}")
    devices = tuple(d.strip() for d in str(getattr(args, "device", "host")).split(","))
    for d in devices:
        if d not in DEVICES:
            raise UsageError(f"--device {d!r}: choose from {', '.join(DEVICES)}")
    if len(set(devices)) != len(devices):
        raise UsageError(f"--device lists a device twice: {','.join(devices)}")
    if args.compare == "mpi" and {"cuda", "cuda-staged"} & set(devices):
        raise UsageError("--compare mpi runs host buffers only (drop cuda from --device)")
    if args.compare == "nccl" and args.dtype not in _nccl_dtypes():
        raise UsageError(f"--compare nccl: NCCL does not support {args.dtype}")
    bind = args.bind
    if bind is None:
        try:
            bind = bind_mode(environ)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    config = BenchConfig(
        op=args.op,
        world_size=args.nproc,
        begin=args.minbytes,
        end=args.maxbytes,
        factor=args.stepfactor,
        iters=args.iters,
        warmup=args.warmup,
        dtype=args.dtype,
        redop=args.redop,
        root=args.root,
        check=args.check or bool(getattr(args, "check_n", None)),
        compare=args.compare,
        rounds=rounds,
        timeout_s=args.timeout_s,
        op_timeout_s=min(BenchConfig.op_timeout_s, args.timeout_s),
        quiet=args.quiet,
        mpi_tcp=args.mpi_tcp,
        devices=devices,
        bind=bind,
        multihost=hosts is not None,
    )
    if hosts is not None and devices != ("host",):
        raise UsageError("--hostfile/-H: only --device host runs across hosts")
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    _check_available(config, args.plot)
    return config


def hosts_from_args(args: argparse.Namespace) -> HostsSpec | None:
    """The hosts of ``--hostfile``/``-H`` (with ``-n``, ``--ssh-config``); None without."""
    from ringcomm.launch.hostfile import (
        HostfileError,
        assign_ranks,
        parse_hosts_option,
        read_hostfile,
    )

    hostfile, hosts_option = getattr(args, "hostfile", None), getattr(args, "hosts", None)
    ssh_config = getattr(args, "ssh_config", None)
    if hostfile is None and hosts_option is None:
        if ssh_config is not None:
            raise UsageError("--ssh-config applies with --hostfile or -H only")
        return None
    try:
        slots = (
            read_hostfile(hostfile)
            if hostfile is not None
            else parse_hosts_option(str(hosts_option))
        )
        placements = assign_ranks(slots, args.nproc)
    except HostfileError as exc:
        raise UsageError(str(exc)) from None
    if ssh_config is not None:
        if not os.path.isfile(ssh_config):
            raise UsageError(f"--ssh-config: no such file: {ssh_config}")
        ssh_config = os.path.abspath(ssh_config)
    per_host: dict[str, int] = {}
    for p in placements:
        per_host[p.host] = per_host.get(p.host, 0) + 1
    return HostsSpec(
        hostfile=hostfile and os.path.abspath(hostfile),
        hosts_option=hosts_option,
        ssh_config=ssh_config,
        nproc=args.nproc,
        placement=tuple(per_host.items()),
    )


def _check_available(config: BenchConfig, plot: str | None) -> None:
    """Refuse, before anything starts, what this installation cannot run."""
    from ringcomm.bench.collectives import device_missing, missing_collective

    why = missing_collective(config.op)
    if why is not None:
        raise UsageError(f"{config.op}: {why}")
    for device in config.devices:
        why = device_missing(device)
        if why is not None:
            raise UsageError(why)
    if config.compare == "gloo":
        import importlib.util

        if config.dtype not in GLOO_DTYPES:  # wrong with or without torch: say so first
            raise UsageError(f"--compare gloo: Gloo does not support {config.dtype}")
        if importlib.util.find_spec("torch") is None:
            raise UsageError(
                "--compare gloo needs PyTorch (torch.distributed with Gloo): "
                "pip install 'ringcomm[torch]' (or pip install torch)"
            )
    if config.compare == "nccl":
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise UsageError("--compare nccl needs PyTorch with CUDA: pip install torch")
        from ringcomm.bench.gloo import nccl_missing

        why = nccl_missing(config.world_size)
        if why is not None:
            raise UsageError(why)
    if config.compare == "mpi":
        from ringcomm.bench.mpi import mpi_missing

        why = mpi_missing()
        if why is not None:
            raise UsageError(why)
        if config.op in REDUCING_OPS and config.redop == "avg":
            raise UsageError("--compare mpi: MPI has no avg reduction")
    if plot is not None:
        from ringcomm.bench.plot import matplotlib_missing

        why = matplotlib_missing()
        if why is not None:
            raise UsageError(why)


def preamble(config: BenchConfig) -> str:
    """The ``#`` lines printed before the sweep (nccl-tests' run description)."""
    import numpy as np

    from ringcomm import __version__

    versus = f"; compared with {config.compare}" if config.compare else ""
    if config.devices != ("host",):
        versus += f"; buffers on {', '.join(config.devices)}"
    bind = config.bind if config.bind is not None else bind_mode()  # None: as inherited
    # The ranks' own rule (ringcomm.config.binds_to_core); the job's ranks are this host's.
    if binds_to_core(bind, config.world_size, len(os.sched_getaffinity(0))):
        versus += "; each rank bound to a core"
    if {"cuda", "cuda-staged"} & set(config.devices):
        versus += "; " + gpu_line(config.world_size)
    lines = [
        (
            f"# ringcomm bench {config.op}: nranks {config.world_size} minBytes {config.begin} "
            f"maxBytes {config.end} step: {config.factor}(factor) warmup iters: "
            f"{config.warmup} iters: {config.iters} rounds: {config.rounds} "
            f"validation: {int(config.check)}"
        ),
        (
            f"# ringcomm {__version__}, numpy {np.__version__}, python "
            f"{platform.python_version()}, {platform.node()} ({os.cpu_count()} cpus){versus}"
        ),
        (
            "# time: median of each rank's iteration times, max over ranks; "
            "p50/p99: all iterations of all ranks; GB/s = 1e9 B/s"
        ),
        "#",
    ]
    return "\n".join(lines) + "\n"


def _nccl_dtypes() -> frozenset[str]:
    return frozenset({"int8", "uint8", "int32", "int64", "float16", "float32", "float64"})


def gpu_line(world_size: int) -> str:
    """``2 ranks on 1 GPU (NVIDIA H200), MPS daemon running`` (the header's GPU part)."""
    from ringcomm.config import mps_active
    from ringcomm.device.xp import cupy_or_none

    mps = "MPS daemon running" if mps_active() else "no MPS daemon"
    cp = cupy_or_none()
    try:
        count = int(cp.cuda.runtime.getDeviceCount()) if cp is not None else 0
        name = cp.cuda.runtime.getDeviceProperties(0)["name"] if cp is not None and count else "?"
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 (no driver: say so, the run fails later on its own)
        count, name = 0, "?"
    per_gpu = -(-world_size // count) if count else world_size
    share = f", {per_gpu} ranks per GPU" if per_gpu > 1 else ""
    return f"{world_size} ranks on {min(count, world_size)} GPU(s) ({name}){share}, {mps}"


def write_outputs(
    results: Sequence[Result], config: BenchConfig, json_path: str | None, plot_path: str | None
) -> None:
    """The ``--json`` rows and the ``--plot`` figure."""
    rows = [json_row(r) for r in results]
    if json_path:
        with open(json_path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    if plot_path:
        from ringcomm.bench.plot import plot_rows

        impls = " vs ".join(config.impls)
        plot_rows(
            rows, plot_path, title=f"ringcomm bench {config.op}: {impls}, {config.world_size} ranks"
        )


#: More ranks per core than this on one host draws :func:`crowding_warning`.
CROWDED_RANKS_PER_CORE = 4


def crowding_warning(nproc: int, ncores: int) -> str | None:
    """What to say when ``-n`` exceeds this host's cores by far (nccl-tests users mean
    iterations by ``-n``): None when it does not."""
    if nproc <= CROWDED_RANKS_PER_CORE * max(1, ncores):
        return None
    return (
        f"-n {nproc} starts {nproc} ranks on {ncores} core(s); here -n is the number of "
        "ranks (in nccl-tests it is iterations: that is --iters)"
    )


def placement_line(hostnames: Sequence[str]) -> str:
    """``# ranks 0-1 on h0; 2-3 on h1`` (the hostnames the ranks reported)."""
    groups: list[tuple[str, list[int]]] = []
    for rank, name in enumerate(hostnames):
        if groups and groups[-1][0] == name:
            groups[-1][1].append(rank)
        else:
            groups.append((name, [rank]))
    parts = [(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}") + f" on {name}" for name, r in groups]
    return f"# ranks {'; '.join(parts)} ({len(set(hostnames))} hosts)\n#\n"


def main(args: argparse.Namespace) -> int:
    """``ringcomm bench``: see the module docstring for the exit status."""
    config = config_from_args(args)
    from ringcomm.bench.runner import run
    from ringcomm.errors import RankFailedError

    hosts = hosts_from_args(args)
    crowded = crowding_warning(config.world_size, len(os.sched_getaffinity(0)))
    if hosts is None and crowded:
        print(f"{_PROG}: warning: {crowded}", file=sys.stderr)
    sys.stdout.write(preamble(config))
    sys.stdout.flush()
    try:
        if hosts is None:
            results = run(config)
        else:
            from ringcomm.bench import multihost

            results, hostnames = multihost.run(config, hosts)
            sys.stdout.write(placement_line(hostnames))
    except (RankFailedError, RuntimeError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(format_table(results, config.impls))
    sys.stdout.write(format_footer(results, config.impls))
    sys.stdout.flush()
    write_outputs(results, config, args.json, args.plot)
    errors = sum(r.errors or 0 for r in results)
    return 1 if errors else 0
