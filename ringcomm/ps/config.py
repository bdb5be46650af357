"""Configuration of a parameter-server job, parsed once into a frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CONSISTENCY_MODES", "UPDATE_MODES", "PSConfig"]

CONSISTENCY_MODES = ("bsp", "ssp", "asp")
UPDATE_MODES = ("server", "worker")


@dataclass(frozen=True)
class PSConfig:
    """What every server of a job must agree on.

    ``update``: ``server`` (servers average a step's gradients and apply ``optimizer``;
    workers pull parameters) or ``worker`` (servers only average; workers pull the averaged
    gradient and apply their own optimizer). ``consistency``: ``bsp`` (a step's update
    happens once every worker pushed it; pulls wait for it), ``ssp`` (a pull waits while
    the reader is more than ``staleness`` steps ahead of the slowest worker), ``asp``
    (every push applied on arrival, pulls never wait). ``checkpoint_every_steps``: a
    server writes its state each time the slowest worker's clock passes another multiple.
    ``reduce``: ``avg`` (a step's gradient is the workers' mean; an asp/ssp push counts
    ``1/W``) or ``sum`` (their sum; a push counts whole), for workers whose gradients are
    already divided by the global batch, as the engine's ``dp`` does before its all_reduce.
    ``keep_undo`` (bsp only; elastic training): a shard keeps its parameters and optimizer
    state from before its last applied step, so that a step a lost worker took part in can
    be undone (:meth:`~ringcomm.ps.state.ServerState.rebase`).
    """

    num_workers: int
    consistency: str = "bsp"
    staleness: int = 0
    update: str = "server"
    optimizer: str = "sgd"
    optimizer_args: dict[str, Any] = field(default_factory=lambda: {"lr": 0.01})
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int = 0
    timeout_s: float = 300.0
    reduce: str = "avg"
    keep_undo: bool = False
    #: The largest shard a worker's init may create (bytes): a request's sizes are checked
    #: against it (or against the shard it names) before anything is allocated.
    max_shard_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"ps: num_workers must be >= 1, got {self.num_workers}")
        if self.consistency not in CONSISTENCY_MODES:
            raise ValueError(
                f"ps: consistency must be one of {CONSISTENCY_MODES}, got {self.consistency!r}"
            )
        if self.update not in UPDATE_MODES:
            raise ValueError(f"ps: update must be one of {UPDATE_MODES}, got {self.update!r}")
        if self.reduce not in ("avg", "sum"):
            raise ValueError(f"ps: reduce must be 'avg' or 'sum', got {self.reduce!r}")
        if self.staleness < 0:
            raise ValueError(f"ps: staleness must be >= 0, got {self.staleness}")
        if self.checkpoint_every_steps < 0:
            raise ValueError(
                f"ps: checkpoint_every_steps must be >= 0, got {self.checkpoint_every_steps}"
            )
        if self.checkpoint_every_steps and not self.checkpoint_dir:
            raise ValueError("ps: checkpoint_every_steps needs a checkpoint_dir")
        if self.keep_undo and self.consistency != "bsp":
            raise ValueError(
                f"ps: keep_undo needs consistency 'bsp' (under {self.consistency!r} every push "
                "is applied on arrival: there is no step to undo)"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"ps: timeout_s must be > 0, got {self.timeout_s}")
        if self.max_shard_bytes < 0:
            raise ValueError(f"ps: max_shard_bytes must be >= 0, got {self.max_shard_bytes}")

    @property
    def bound(self) -> int | None:
        """How many steps a reader may be ahead of the slowest worker (None: unbounded)."""
        if self.consistency == "bsp":
            return 0
        if self.consistency == "ssp":
            return self.staleness
        return None
