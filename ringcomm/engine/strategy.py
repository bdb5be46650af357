"""The strategy interface, the training configuration, and the strategy registry.

A *strategy* owns how one rank holds and updates the model (which parameters, gradients
and optimizer states it keeps, which collectives move them) behind one interface,
:class:`Strategy` (``step``, ``state_nbytes``, ``export_params``, ``extra``), registered by
name in :data:`STRATEGIES` (``name -> "module:Class"``, imported on use), so the training
loop and the CLI never name one. Devices (:data:`DEVICES`, :func:`array_module`): ``cpu``,
``cuda`` and ``host-staged`` (the stand-in device), one code path over ``self.xp``.

Invariants: a strategy talks only to its ``ProcessGroup`` (it may split it); every
strategy reproduces ``single`` (the same global batch per step, :meth:`TrainConfig.build_data`,
the same seeded initialisation, the loss summed over the global batch and divided by its
size); host data goes over with ``xp.asarray`` only, back with ``float()``/``to_host``.
The interface and devices in full: docs/architecture.md, section "engine/strategy.py".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from ringcomm.device.standin import STANDIN
from ringcomm.device.xp import cupy_or_none
from ringcomm.engine.data import SyntheticClassification, SyntheticNextToken
from ringcomm.engine.nn import Layer, SoftmaxCrossEntropy, backward_layers, forward_layers, mlp
from ringcomm.engine.tp import TPContext
from ringcomm.engine.transformer import VocabParallelCrossEntropy, transformer
from ringcomm.schedule.partition import split_rows

__all__ = [
    "DEVICES",
    "STRATEGIES",
    "TRANSFORMER_STRATEGIES",
    "Strategy",
    "StrategyUnavailable",
    "TrainConfig",
    "array_module",
    "select_device",
    "state_bytes",
    "strategy_class",
]

#: name -> "module:Class".
STRATEGIES: dict[str, str] = {
    "single": "ringcomm.engine.single:Single",
    "dp": "ringcomm.engine.dp:DataParallel",
    "ps": "ringcomm.engine.ps:ParameterServer",
    "zero1": "ringcomm.engine.zero:Zero1",
    "zero2": "ringcomm.engine.zero:Zero2",
    "zero3": "ringcomm.engine.zero:Zero3",
    "pipeline": "ringcomm.engine.pipeline:Pipeline",
    "tp": "ringcomm.engine.parallel:TensorParallel",
    "3d": "ringcomm.engine.parallel:Parallel3D",
}
#: Every name ``--strategy`` accepts (docs/contracts.md, Command line), registered or not.
STRATEGY_NAMES = ("single", "dp", "ps", "zero1", "zero2", "zero3", "pipeline", "tp", "3d")
#: The strategies that run ``--model transformer``.
TRANSFORMER_STRATEGIES = ("single", "dp", "zero1", "zero2", "zero3", "pipeline", "tp", "3d")
#: What ``--device`` accepts: NumPy, CuPy on a GPU, NumPy through the staged device path.
DEVICES = ("cpu", "cuda", "host-staged")


class StrategyUnavailable(Exception):
    """A strategy or device that cannot run here (the CLI exits 2)."""


@dataclass(frozen=True)
class TrainConfig:
    strategy: str = "single"
    world_size: int = 1
    steps: int = 10
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    optimizer: str = "adam"
    lr: float = 1e-3
    batch_size: int = 64
    in_features: int = 64
    hidden: int = 256
    depth: int = 4
    classes: int = 10
    act: str = "gelu"
    bucket_bytes: int = 25 * 1024 * 1024
    micro_batches: int = 4
    schedule: str = "gpipe"
    timeout_s: float = 300.0
    verbose: bool = False
    comm_summary: bool = False  # each rank returns pg.comm_summary() (DeepSpeed's comms logger)
    export: bool = False  # return the final parameters (tests)
    # Parameter-server options (strategy ps, ringcomm/engine/ps.py).
    ps_servers: int = 1
    consistency: str = "bsp"
    staleness: int = 0
    ps_update: str = "server"
    ps_checkpoint_dir: str | None = None
    ps_checkpoint_interval: int = 0  # steps between server checkpoints (0: only at the end)
    ps_split_min_bytes: int = 1 << 20  # layers this big are split over every server
    # Elastic dp and ps (ringcomm/engine/elastic.py): survive lost ranks; restart them; inject.
    elastic: bool = False
    max_restarts: int = 0
    # (slot, step) or (slot, step, bucket): that slot's first process dies at the start of
    # that step, or once that bucket's all-reduce (0: the first launched; ps: push_pull) is done
    fail_at: tuple[tuple[int, ...], ...] = ()
    # The transformer (--model transformer; ``depth`` is its number of blocks).
    model: str = "mlp"
    vocab: int = 64
    seq_len: int = 16
    d_model: int = 32
    heads: int = 4
    # The mesh (strategies tp and 3d, ringcomm/engine/parallel.py): dp x pp x tp ranks.
    dp: int = 1
    pp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    zero: int = 0  # ZeRO stage over the dp axis (3d): 0, 1 or 2

    def build_model(self, tp: TPContext | None = None) -> list[Layer]:
        """The model's layers (the transformer's over the tp group ``tp``; None: one rank)."""
        if self.model == "transformer":
            return transformer(
                self.vocab, self.seq_len, self.d_model, self.heads, self.depth, tp, self.act
            )
        return mlp(self.in_features, self.hidden, self.depth, self.classes, self.act)

    def activation_shape(self, layers: list[Layer], i: int) -> tuple[int, ...]:
        """Shape of one sample's output of ``layers[i]`` (what a pipeline stage ending at
        layer ``i`` sends the next): the residual stream ``(seq_len, d_model)`` of the
        transformer (its logits after the head), ``(out_features,)`` of an MLP layer."""
        if self.model == "transformer":
            return (self.seq_len, self.d_model if i < len(layers) - 1 else self.vocab)
        return (layers[i].out_features,)

    def num_layers(self) -> int:
        """Layers of the unsplit model (what pipeline stages divide)."""
        return self.depth + 3 if self.model == "transformer" else 3 * self.depth + 1

    def build_data(self) -> Any:
        """The seeded task: next tokens (transformer) or classes (MLP)."""
        if self.model == "transformer":
            return SyntheticNextToken(self.vocab, self.seq_len, self.batch_size, self.seed)
        return SyntheticClassification(
            self.in_features, self.classes, self.batch_size, self.seed, np.dtype(self.dtype)
        )

    def build_loss(self, tp: TPContext | None = None) -> Any:
        """The loss head, divided by the global batch (in tokens for the transformer)."""
        if self.model == "transformer":
            return VocabParallelCrossEntropy(self.batch_size * self.seq_len, tp)
        return SoftmaxCrossEntropy(scale=self.batch_size)


def array_module(device: str) -> ModuleType:
    """The array module computing on ``device``: numpy for ``cpu``; the host stand-in
    device's module (:data:`ringcomm.device.standin.STANDIN`) for ``host-staged``; cupy for
    ``cuda`` (StrategyUnavailable without CuPy or a GPU)."""
    if device == "cpu":
        return np
    if device == "host-staged":
        return STANDIN  # type: ignore[return-value]  # (duck-typed like a module)
    if device == "cuda":
        cp = cupy_or_none()
        if cp is None:
            raise StrategyUnavailable("--device cuda needs CuPy (pip install 'ringcomm[gpu]')")
        try:
            if cp.cuda.runtime.getDeviceCount() < 1:
                raise StrategyUnavailable("--device cuda: no CUDA device found")
        except StrategyUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001  (CUDA driver/runtime missing: any error)
            raise StrategyUnavailable(f"--device cuda: CUDA is not usable here ({exc})") from None
        return cp
    raise StrategyUnavailable(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")


def select_device(cp: Any, rank: int) -> int:
    """Make GPU ``rank % device_count`` current in this process (ranks of ``ringcomm
    train`` are local: several share a GPU when there are fewer GPUs than ranks)."""
    device_id = rank % int(cp.cuda.runtime.getDeviceCount())
    cp.cuda.Device(device_id).use()
    return device_id


def _as_is(a: Any) -> Any:
    return a


def state_bytes(params: Any, grads: Any, opt: Any) -> dict[str, int]:
    """What :meth:`Strategy.state_nbytes` reports for a rank holding the flat ``params`` and
    ``grads`` buffers (or shards) and the optimizer ``opt``."""
    return {
        "param_bytes": int(params.nbytes),
        "grad_bytes": int(grads.nbytes),
        "optim_bytes": opt.state_nbytes(),
    }


def strategy_class(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise StrategyUnavailable(
            f"unknown strategy {name!r}; expected one of {sorted(STRATEGIES)}"
        )
    module, _, cls = STRATEGIES[name].partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


class Strategy:
    """Base: the model, the data, this rank's batch rows and the loss head."""

    name: ClassVar[str] = ""
    #: Whether the global batch is split across ranks by rows (data parallel family).
    splits_batch: ClassVar[bool] = True

    def __init__(self, pg: Any, cfg: TrainConfig) -> None:
        self.pg = pg
        self.cfg = cfg
        self.rank = pg.rank if pg is not None else 0
        self.n = pg.world_size if pg is not None else 1
        self.xp = array_module(cfg.device)
        #: The GPU this rank computes on (``cuda``), else None.
        self.device_id = select_device(self.xp, self.rank) if cfg.device == "cuda" else None
        #: ``as_comm(buffer)``: what the group is handed for a model buffer (see the module
        #: docstring): the buffer itself (it is an ``xp`` array on every device).
        self.as_comm: Any = _as_is
        self.dtype = np.dtype(cfg.dtype)
        self.layers = cfg.build_model()
        self.data = cfg.build_data()
        self.loss = cfg.build_loss()
        if self.splits_batch:
            self.rows = split_rows(cfg.batch_size, self.n)[self.rank]
        else:
            self.rows = (0, cfg.batch_size)
        #: The rank whose ``step`` returns the loss.
        self.loss_rank = 0
        #: Bytes of this rank's buffers in shared memory (:meth:`grad_buffer`), which
        #: tracemalloc does not see: the memory meter adds them.
        self.symmetric_bytes = 0

    def grad_buffer(self, size: int) -> Any:
        """A zeroed flat buffer the group all-reduces or reduce-scatters: a symmetric
        buffer (``pg.alloc``, collectives read it in place) for NumPy arrays on a group
        whose ranks share a host, else ``xp.zeros``. Every rank calls it in one order."""
        if self.pg is None or self.n == 1 or self.xp is not np:
            return self.xp.zeros(size, self.dtype)
        buf = self.pg.alloc(size, self.dtype)
        if self.pg.core.workspace is not None:
            self.symmetric_bytes += int(buf.nbytes)
        return buf

    @property
    def numel(self) -> int:
        """Parameters of the whole model."""
        total = 0
        for layer in self.layers:
            for _, shape in layer.param_shapes():
                total += int(np.prod(shape))
        return total

    def local_batch(self, step: int, rows: tuple[int, int] | None = None) -> tuple[Any, Any]:
        x, y = self.data.batch(step, self.rows if rows is None else rows)
        return self.xp.asarray(x), self.xp.asarray(y)

    def forward_backward(
        self,
        step: int,
        params_of: Callable[[int], Any],
        grads_of: Callable[[int], Any],
        done: Callable[[int], None] | None = None,
    ) -> Any:
        """This rank's batch of global step ``step`` forward through every layer and the
        loss, then backward into ``grads_of(i)`` (``done(i)`` once layer ``i``'s gradients
        are complete); returns the local loss."""
        x, labels = self.local_batch(step)
        idx = range(len(self.layers))
        logits, caches = forward_layers(self.layers, idx, x, params_of)
        loss, cache = self.loss.forward(logits, labels)
        dy = self.loss.backward(cache)
        backward_layers(self.layers, idx, caches, dy, params_of, grads_of, done=done)
        return loss

    def sync(self) -> None:
        """Wait for the kernels this rank queued on its current stream (GPU; no-op on the
        host, where NumPy computes synchronously)."""
        if self.device_id is not None:
            self.xp.cuda.get_current_stream().synchronize()

    def global_loss(self, local: Any) -> float:
        """Sum of the ranks' partial losses (each already divided by the global batch).
        The loss is a host number on every device (``float`` of a CuPy scalar waits for
        it), so it is reduced as a host float64."""
        if self.pg is None or self.n == 1:
            return float(local)
        buf = np.array([float(local)], dtype=np.float64)
        self.pg.all_reduce(buf)
        return float(buf[0])

    # -- the interface --------------------------------------------------------------
    def step(self, step: int) -> float | None:
        raise NotImplementedError

    def state_nbytes(self) -> dict[str, int]:
        raise NotImplementedError

    def export_params(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def extra(self) -> dict[str, Any]:
        return {}
