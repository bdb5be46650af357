"""``ringcomm train --strategy S -n N``: train the synthetic MLP, or with ``--model
transformer`` the small transformer, with one strategy (``tp``/``3d``: over the mesh
``--dp x --pp x --tp``, which must multiply to ``-n``; :func:`_mesh_from_args` checks it
and the tp splits before any rank starts).

Pipeline: ``add_parser`` (argparse) -> :func:`config_from_args` (a frozen
:class:`~ringcomm.engine.strategy.TrainConfig`; ``UsageError`` for what cannot run) ->
:func:`run_training` (``rc.spawn`` for N ranks; ``single`` in this
process) -> a summary on stdout and the ``--json`` object (docs/contracts.md, JSON output). Exit status: 0;
1 if a rank failed; 2 for a usage error or
``--device cuda`` without CuPy or a GPU (:class:`UsageError`, printed by :mod:`ringcomm.cli`).
Option defaults are :class:`~ringcomm.engine.strategy.TrainConfig`'s.

Devices: ``cpu`` (NumPy), ``cuda`` (CuPy: model state and activations on the GPU, staged
through pinned host buffers by ringcomm), ``host-staged`` (NumPy compute, every
collective and p2p call through the staged device path with stand-in device arrays: the
CPU check of the GPU path's bookkeeping). See :mod:`ringcomm.engine.strategy`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ringcomm.cli.options import add_consistency_options, add_nproc_option
from ringcomm.config import (
    UsageError,
    check_output_path,
    environ_changed,
    environment,
    format_size,
    size_arg,
)
from ringcomm.core.flight import summary_table
from ringcomm.engine.elastic import ELASTIC_STRATEGIES, summarize_elastic
from ringcomm.engine.optim import OPTIMIZERS
from ringcomm.engine.strategy import (
    DEVICES,
    STRATEGY_NAMES,
    TRANSFORMER_STRATEGIES,
    StrategyUnavailable,
    TrainConfig,
    array_module,
)
from ringcomm.engine.train import bubble_lines, summarize, train_rank
from ringcomm.engine.transformer import check_tp_sizes
from ringcomm.errors import RingcommError
from ringcomm.launch.spawn import spawn
from ringcomm.schedule.pipeline import SCHEDULES

#: Thread pools capped at one per rank (ranks share the cores).
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def run_training(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Run every rank (``single``: in this process) and return their results in rank order."""
    if cfg.strategy == "single":
        if cfg.world_size != 1:
            raise ValueError(f"strategy single runs on one process; got -n {cfg.world_size}")
        return [train_rank(None, cfg)]
    # (one thread pool per rank: ranks share the cores; a value the user set stays)
    with environ_changed({k: environment().get(k, "1") for k in _THREAD_VARS}):
        return list(
            spawn(
                train_rank,
                cfg.world_size,
                args=(cfg,),
                timeout_s=cfg.timeout_s,
                elastic=cfg.elastic,
                max_restarts=cfg.max_restarts,
            )
        )


__all__ = ["UsageError", "add_parser", "config_from_args", "main"]

_PROG = "ringcomm train"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``train`` on the CLI's subparsers (see :mod:`ringcomm.cli`)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "train",
        help="train a small MLP or transformer with a parallel strategy "
        "(dp, ps, zero1/2/3, pipeline, tp, 3d)",
        description="Train an MLP on a seeded synthetic classification task, or a small "
        "transformer on a seeded next-token task, with one strategy over N local ranks. Every strategy computes the same losses as "
        "--strategy single for the same seed and global batch.",
    )
    d = TrainConfig  # the defaults, written once
    p.add_argument("--strategy", choices=STRATEGY_NAMES, required=True)
    add_nproc_option(p, "number of ranks", default=d.world_size)
    p.add_argument(
        "--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)"
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default=d.device,
        help="cpu (NumPy), cuda (CuPy on the GPU), or host-staged (NumPy compute, every "
        "collective/p2p through the staged device path with stand-in device arrays)",
    )
    p.add_argument(
        "--micro-batches", type=int, default=d.micro_batches, metavar="M", help="pipeline only"
    )
    p.add_argument("--schedule", choices=SCHEDULES, default=d.schedule, help="pipeline only")
    p.add_argument("--json", metavar="FILE", help="write the result object to FILE")
    # The argument groups, in the order --help lists them.
    _add_model_args(p)
    _add_mesh_args(p)
    _add_bucket_args(p)
    _add_ps_args(p)
    _add_elastic_args(p)
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="bound on the whole job")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-step lines")
    p.add_argument(
        "--comm-summary",
        action="store_true",
        help="print rank 0's collectives per op and size bucket (count, bytes, "
        "times, busbw); the JSON gets every rank's",
    )
    p.set_defaults(main=main)
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """``train``'s "model and optimizer" and "transformer" argument groups."""
    d = TrainConfig
    g = p.add_argument_group("model and optimizer")
    g.add_argument("--dtype", choices=("float32", "float64"), default=d.dtype)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=d.optimizer)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="global batch (default %(default)s)"
    )
    g.add_argument("--in-features", type=int, default=d.in_features)
    g.add_argument("--hidden", type=int, default=d.hidden)
    g.add_argument(
        "--layers", type=int, default=d.depth, dest="depth", metavar="L", help="hidden blocks"
    )
    g.add_argument("--classes", type=int, default=d.classes)
    g.add_argument("--act", choices=("gelu", "relu"), default=d.act)
    g.add_argument(
        "--model",
        choices=("mlp", "transformer"),
        default=None,
        help="mlp (default; tp and 3d: transformer)",
    )
    t = p.add_argument_group("transformer (--model transformer; --layers is its blocks)")
    t.add_argument("--vocab", type=int, default=d.vocab)
    t.add_argument("--seq-len", type=int, default=d.seq_len)
    t.add_argument("--d-model", type=int, default=d.d_model)
    t.add_argument("--heads", type=int, default=d.heads)


def _add_mesh_args(p: argparse.ArgumentParser) -> None:
    """``train``'s "mesh" argument group (--strategy tp | 3d)."""
    m = p.add_argument_group("mesh (--strategy tp | 3d): dp x pp x tp = -n")
    m.add_argument("--tp", type=int, default=None, metavar="T", help="tensor-parallel ranks")
    m.add_argument("--pp", type=int, default=None, metavar="P", help="pipeline stages (3d)")
    m.add_argument("--dp", type=int, default=None, metavar="D", help="data-parallel replicas (3d)")
    m.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="LayerNorm regions on sequence shards (all_gather / reduce_scatter for f / g)",
    )
    m.add_argument("--zero", type=int, choices=(1, 2), default=None, help="ZeRO over dp (3d)")


def _add_bucket_args(p: argparse.ArgumentParser) -> None:
    """``train``'s "gradient buckets" argument group (dp, zero1, zero2)."""
    b = p.add_argument_group("gradient buckets (dp, zero1, zero2)")
    bx = b.add_mutually_exclusive_group()
    bx.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help=f"bucket size in MiB ({TrainConfig.bucket_bytes / 2**20:g})",
    )
    bx.add_argument("--bucket-bytes", type=size_arg, default=None, help="bucket size, e.g. 1M")


def _add_ps_args(p: argparse.ArgumentParser) -> None:
    """``train``'s "parameter server" argument group (--strategy ps)."""
    d = TrainConfig
    s = p.add_argument_group("parameter server (--strategy ps)")
    s.add_argument("--ps-servers", type=int, default=d.ps_servers, metavar="S")
    add_consistency_options(s, consistency=d.consistency, staleness=d.staleness, update=d.ps_update)
    s.add_argument("--checkpoint-dir", metavar="DIR", help="servers checkpoint here (and resume)")
    s.add_argument(
        "--checkpoint-interval",
        type=int,
        default=d.ps_checkpoint_interval,
        metavar="STEPS",
        help="steps between server checkpoints (0: only at the end)",
    )
    s.add_argument(
        "--ps-split-min-bytes",
        type=size_arg,
        default=d.ps_split_min_bytes,
        metavar="SIZE",
        help=f"layers this big are split over every server ({format_size(d.ps_split_min_bytes)})",
    )


def _add_elastic_args(p: argparse.ArgumentParser) -> None:
    """``train``'s "elastic training" argument group (--strategy dp|ps --elastic)."""
    e = p.add_argument_group("elastic training (--strategy dp|ps --elastic)")
    e.add_argument(
        "--elastic",
        action="store_true",
        help="survive lost ranks (ps: lost workers, under bsp): the survivors "
        "shrink and re-split the batch",
    )
    e.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="start a lost rank again up to K times; it rejoins (grow)",
    )
    e.add_argument(
        "--fail-at",
        default="",
        metavar="SLOT:STEP[:BUCKET][,...]",
        help="fault injection: that rank's first process dies (SIGKILL) at that "
        "step, or mid-step once its BUCKET-th gradient all-reduce (ps: push_pull) "
        "is done",
    )


#: The :class:`TrainConfig` fields that take the option of their name as it was parsed
#: (checked in :func:`config_from_args`); the others are worked out there.
_AS_GIVEN = (
    "strategy",
    "steps",
    "device",
    "dtype",
    "seed",
    "optimizer",
    "lr",
    "batch_size",
    "in_features",
    "hidden",
    "depth",
    "classes",
    "act",
    "micro_batches",
    "schedule",
    "timeout_s",
    "comm_summary",
    "ps_servers",
    "consistency",
    "staleness",
    "ps_update",
    "ps_split_min_bytes",
    "elastic",
    "max_restarts",
)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    check_output_path(args.json, "--json")
    check_output_path(getattr(args, "checkpoint_dir", None), "--checkpoint-dir", directory=True)
    n = args.nproc
    if n < 1:
        raise UsageError(f"-n must be >= 1, got {n}")
    if args.strategy == "single" and n != 1:
        raise UsageError("--strategy single runs one process: use -n 1")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    for name in ("batch_size", "in_features", "hidden", "depth"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.classes < 2:
        raise UsageError("--classes must be >= 2")
    mesh = _mesh_from_args(args, n)
    if args.strategy == "3d":
        if args.batch_size < mesh["dp"] * (args.micro_batches if mesh["pp"] > 1 else 1):
            raise UsageError(
                f"--batch-size {args.batch_size} leaves a replica a micro-batch without rows "
                f"(--dp {mesh['dp']}, --micro-batches {args.micro_batches})"
            )
    elif args.strategy == "pipeline":
        if not 1 <= args.micro_batches <= args.batch_size:
            raise UsageError(f"--micro-batches must be in [1, --batch-size {args.batch_size}]")
        layers = args.depth + 3 if (args.model or "mlp") == "transformer" else 3 * args.depth + 1
        if layers < n:
            raise UsageError(f"pipeline: {layers} layers cannot fill {n} stages")
    elif args.strategy != "tp" and args.batch_size < n:
        raise UsageError(f"--batch-size {args.batch_size} leaves ranks without rows at -n {n}")
    if args.bucket_bytes is not None:
        bucket = args.bucket_bytes
    elif args.bucket_mb is not None:
        bucket = int(args.bucket_mb * 2**20)
    else:
        bucket = TrainConfig.bucket_bytes
    if bucket < 1:
        raise UsageError("bucket size must be > 0")
    if args.strategy == "ps":
        if n < 2:
            raise UsageError(
                f"--strategy ps needs -n >= 2 (at least one server and one worker), got -n {n}"
            )
        if not 1 <= args.ps_servers < n:
            raise UsageError(f"--ps-servers must be in [1, {n - 1}] at -n {n} (>= 1 worker)")
        if args.device != "cpu":
            raise UsageError("--strategy ps runs on --device cpu")
        if args.staleness < 0 or args.checkpoint_interval < 0 or args.ps_split_min_bytes < 1:
            raise UsageError(
                "--staleness, --checkpoint-interval must be >= 0, --ps-split-min-bytes > 0"
            )
        if args.checkpoint_interval and not args.checkpoint_dir:
            raise UsageError("--checkpoint-interval needs --checkpoint-dir")
    fail_at = _elastic_args(args, n)
    try:
        array_module(args.device)  # StrategyUnavailable without CuPy / a GPU
    except StrategyUnavailable as exc:
        raise UsageError(str(exc)) from None
    return TrainConfig(
        world_size=n,
        bucket_bytes=bucket,
        verbose=not args.quiet,
        ps_checkpoint_dir=args.checkpoint_dir,
        ps_checkpoint_interval=args.checkpoint_interval,
        fail_at=fail_at,
        **{name: getattr(args, name) for name in _AS_GIVEN},
        **mesh,
    )


def _elastic_args(args: argparse.Namespace, n: int) -> tuple[tuple[int, ...], ...]:
    """Check --elastic, --max-restarts, --fail-at; the (slot, step[, bucket]) of --fail-at."""
    if not args.elastic:
        if args.max_restarts or args.fail_at:
            raise UsageError("--max-restarts and --fail-at need --elastic")
        return ()
    if args.strategy not in ELASTIC_STRATEGIES:
        raise UsageError(
            f"--elastic runs --strategy {' or '.join(ELASTIC_STRATEGIES)} (got {args.strategy})"
        )
    if args.device != "cpu":
        raise UsageError("--elastic runs on --device cpu")
    servers = args.ps_servers if args.strategy == "ps" else 0
    if servers:
        if args.consistency != "bsp":
            raise UsageError(
                f"--strategy ps --elastic needs --consistency bsp (got {args.consistency}): "
                "a lost worker's step is undone and taken again, and only bsp has steps to "
                "undo (ssp/asp apply every push on arrival)"
            )
        if args.checkpoint_dir:
            raise UsageError(
                "--strategy ps --elastic keeps the servers' state in memory (it survives lost "
                "workers, not lost servers); --checkpoint-dir is for servers that restart "
                "(ringcomm ps-server)"
            )
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    pairs: list[tuple[int, ...]] = []
    for part in filter(None, (p.strip() for p in args.fail_at.split(","))):
        fields = part.split(":")
        if len(fields) not in (2, 3) or not all(f.isdigit() for f in fields):
            raise UsageError(f"--fail-at takes SLOT:STEP or SLOT:STEP:BUCKET, got {part!r}")
        slot, step = int(fields[0]), int(fields[1])
        if not 0 <= slot < n or step >= args.steps:
            raise UsageError(
                f"--fail-at {part}: rank must be < -n {n}, step < --steps {args.steps}"
            )
        pairs.append(tuple(int(f) for f in fields))
    if len({p[0] for p in pairs}) >= n:
        raise UsageError("--fail-at: at least one rank must survive")
    if servers and {p[0] for p in pairs} >= set(range(servers, n)):
        raise UsageError("--fail-at: at least one ps worker must survive")
    return tuple(pairs)


def _mesh_from_args(args: argparse.Namespace, n: int) -> dict[str, Any]:
    """The model and mesh fields of the config; UsageError for a mesh that does not
    multiply to ``n``, sizes that do not split over tp, options of the wrong strategy."""
    strategy = args.strategy
    parallel = strategy in ("tp", "3d")
    model = args.model or ("transformer" if parallel else "mlp")
    if model == "transformer" and strategy not in TRANSFORMER_STRATEGIES:
        raise UsageError(
            f"--model transformer runs with --strategy {', '.join(TRANSFORMER_STRATEGIES)}"
        )
    if parallel and model != "transformer":
        raise UsageError(f"--strategy {strategy} trains --model transformer")
    if not parallel:
        for flag in ("tp", "pp", "dp", "zero"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag} needs --strategy tp or 3d")
        if args.sequence_parallel:
            raise UsageError("--sequence-parallel needs --strategy tp or 3d")
    if strategy == "tp":
        if args.pp not in (None, 1) or args.dp not in (None, 1) or args.zero is not None:
            raise UsageError("--strategy tp is tensor parallel only: use 3d for --pp/--dp/--zero")
        tp, pp, dp = args.tp if args.tp is not None else n, 1, 1
    else:
        tp, pp, dp = (
            getattr(args, a) if getattr(args, a) is not None else 1 for a in ("tp", "pp", "dp")
        )
    if parallel:
        if min(tp, pp, dp) < 1:
            raise UsageError("--tp, --pp and --dp must be >= 1")
        if tp * pp * dp != n:
            raise UsageError(
                f"mesh --dp {dp} x --pp {pp} x --tp {tp} = {dp * pp * tp} does not multiply "
                f"to -n {n}"
            )
        if args.zero is not None and dp == 1:
            raise UsageError("--zero shards over the dp axis: it needs --dp > 1")
        if pp > args.depth:
            raise UsageError(
                f"--pp {pp} stages need at least {pp} --layers (blocks), got {args.depth}"
            )
        if pp > 1 and args.micro_batches < 1:
            raise UsageError("--micro-batches must be >= 1")
    if model == "transformer":
        problem = check_tp_sizes(
            args.vocab, args.seq_len, args.d_model, args.heads, tp, args.sequence_parallel
        )
        if problem is not None:
            raise UsageError(problem)
        if args.vocab < 2:
            raise UsageError("--vocab must be >= 2")
    return {
        "model": model,
        "vocab": args.vocab,
        "seq_len": args.seq_len,
        "d_model": args.d_model,
        "heads": args.heads,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "sequence_parallel": bool(args.sequence_parallel and parallel),
        "zero": args.zero or 0,
    }


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:9.2f}"


def shm_bytes_per_step(r: dict[str, Any]) -> float:
    """A rank's bytes per step through the shared workspace: its world group's and its
    mesh axes' (sub-groups count their own)."""
    by_axis = r.get("workspace_bytes_per_step_by_axis") or {}
    return float(r.get("workspace_bytes_per_step") or 0.0) + float(sum(by_axis.values()))


def format_summary(result: dict[str, Any]) -> str:
    staged = result.get("device", "cpu") != "cpu"
    lines = [
        (
            f"strategy {result['strategy']}, {result['world_size']} rank(s), "
            f"{result['model']['params']:,} parameters, device {result.get('device', 'cpu')}; "
            f"step time {result['step_time_s'] * 1e3:.1f} ms (median); "
            f"final loss {result['losses'][-1]:.6f}"
        ),
        " rank  param MiB   grad MiB  optim MiB   peak MiB   MiB/step: sockets     shm"
        + ("  staging MiB" if staged else ""),
    ]
    for r in result["per_rank"]:
        lines.append(
            f"{r['rank']:5d} {_mib(r['param_bytes'])} {_mib(r['grad_bytes'])} "
            f"{_mib(r['optim_bytes'])} {_mib(r['peak_bytes'])}          "
            f"{_mib(r['sent_bytes_per_step'])} {_mib(shm_bytes_per_step(r))}"
            + (f"    {_mib(r['staging_bytes'])}" if staged else "")
        )
    lines.append(
        "MiB/step: what every collective moved, through sockets (sent) and through the "
        "shared memory of ranks on one host (the inputs it took)"
    )
    if "peak_bytes_source" in result:
        lines.append(f"peak: {result['peak_bytes_source']}")
    if "bubble_fraction" in result:
        lines += bubble_lines(result)
    if "mesh_shape" in result:
        ms = result["mesh_shape"]
        lines.append(
            f"mesh dp {ms['dp']} x pp {ms['pp']} x tp {ms['tp']}"
            + (", sequence parallel" if result.get("sequence_parallel") else "")
            + (f", ZeRO-{result['zero']} over dp" if result.get("zero") else "")
            + "; sent MiB/step by axis (ring count):"
        )
        for r in result["per_rank"]:
            c, by = r["mesh"], r["sent_bytes_per_step_by_axis"]
            lines.append(
                f"{r['rank']:5d} (dp {c['dp']}, pp {c['pp']}, tp {c['tp']})  "
                + "  ".join(f"{a} {by[a] / 2**20:.3f}" for a in ("dp", "pp", "tp"))
            )
    if "ps" in result:
        ps = result["ps"]
        lines.append(
            f"ps: {ps['servers']} server(s) (ranks 0..{ps['servers'] - 1}), {ps['workers']} "
            f"worker(s); {ps['consistency']}"
            + (f" K={ps['staleness']}" if ps["consistency"] == "ssp" else "")
            + f", update on the {ps['update']}; max pull gap {ps['max_pull_gap']} "
            f"over {ps['pulls']} pulls"
        )
    return "\n".join(lines)


def format_elastic(result: dict[str, Any]) -> str:
    ps = result.get("ps")
    roles = f" ({ps['servers']} server(s), update on the {ps['update']})" if ps else ""
    head = (
        f"strategy {result['strategy']} (elastic), {result['world_size']} rank slot(s)"
        f"{roles}; step time "
        f"{result['step_time_s'] * 1e3:.1f} ms (median); final loss {result['losses'][-1]:.6f}"
    )
    lines = [head]
    for c in result["membership"]:
        lines.append(
            f"step {c['step']}: {c['event']} -> ranks (slots) {c['slots']}, "
            f"{c['time_lost_s'] * 1e3:.0f} ms lost"
        )
    if result["lost_slots"]:
        lines.append(f"lost for good: slots {result['lost_slots']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``ringcomm train``: see the module docstring for the exit status."""
    cfg = config_from_args(args)
    try:
        per_rank = run_training(cfg)
    except RingcommError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 1
    if cfg.elastic:
        result = summarize_elastic(cfg, per_rank)
        print(format_elastic(result), flush=True)
    else:
        result = summarize(cfg, per_rank)
        print(format_summary(result), flush=True)
        if cfg.comm_summary:
            result["comm_summary"] = [r.get("comm_summary") for r in per_rank]
            rows = per_rank[0].get("comm_summary") or []
            print(
                "collectives of rank 0 (ringcomm.core.flight.summary_table):\n"
                + summary_table(rows)
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0
