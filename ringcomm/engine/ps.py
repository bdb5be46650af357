"""``ps``: data-parallel training over the parameter server (:mod:`ringcomm.ps`).

Ranks ``0..S-1`` are servers (``cfg.ps_servers``), the other ``W`` workers split the global
batch by rows; one key per layer with parameters, placed by
:class:`~ringcomm.ps.slicer.HashSlicer`, pushed with ``push_pull`` as soon as backward
finished the layer. ``--ps-update server``: the servers apply the optimizer;
``--ps-update worker``: they only sum and every worker applies its own. Workers send their
partial losses to every server (tag :data:`TAG_LOSS`); rank 0 is the ``loss_rank``.

Invariants: losses and gradients are divided by the *global* batch size and the servers
sum (``PSConfig.reduce="sum"``), in worker order under bsp, so ``bsp`` reproduces ``single``
to rounding (``ssp``/``asp`` train but do not follow it); workers never wait for each
other's losses. The one place the engine imports ``ringcomm.ps``; CPU (NumPy) only. Elastic
runs (bsp) and a lost server: docs/architecture.md, section "engine/ps.py".
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringcomm.engine.optim import SGD, Adam, make_optimizer
from ringcomm.engine.params import export_params, init_layer, layer_views, param_shapes
from ringcomm.engine.strategy import Strategy, StrategyUnavailable, TrainConfig
from ringcomm.errors import CommTimeoutError, GroupClosedError, PeerFailedError, RingcommError
from ringcomm.ps import HashSlicer, KVWorker, PSConfig, PSServer
from ringcomm.schedule.partition import flat_layout, split_rows

__all__ = ["TAG_LOSS", "ParameterServer", "ps_config", "ps_summary", "updater_args"]

#: Tag of the workers' partial losses on the parameter server's sub-group (the PS protocol
#: uses 0x5053_0001 and 0x5053_0002 there).
TAG_LOSS = 0x5053_0100
#: How long a server waits for a loss between checks that its request loops still run.
_POLL_S = 1.0


def updater_args(cfg: TrainConfig) -> dict[str, Any]:
    """The server updater's hyper-parameters: those of the engine's optimizer for ``cfg``
    (so that both update modes compute the same numbers)."""
    opt = make_optimizer(cfg.optimizer, np, 0, np.dtype(cfg.dtype), cfg.lr)
    if isinstance(opt, SGD):
        return {"lr": opt.lr, "momentum": opt.momentum}
    if isinstance(opt, Adam):
        return {"lr": opt.lr, "betas": (opt.b1, opt.b2), "eps": opt.eps}
    raise ValueError(f"ps: no server updater for optimizer {cfg.optimizer!r}")


def ps_config(cfg: TrainConfig, num_workers: int) -> PSConfig:
    """The parameter-server configuration of a training run."""
    return PSConfig(
        num_workers=num_workers,
        consistency=cfg.consistency,
        staleness=cfg.staleness,
        update=cfg.ps_update,
        optimizer=cfg.optimizer,
        optimizer_args=updater_args(cfg),
        checkpoint_dir=cfg.ps_checkpoint_dir,
        checkpoint_every_steps=cfg.ps_checkpoint_interval if cfg.ps_checkpoint_dir else 0,
        timeout_s=cfg.timeout_s,
        reduce="sum",
        keep_undo=cfg.elastic,
    )


class ParameterServer(Strategy):
    name = "ps"
    splits_batch = False  # the workers split it among themselves, below

    def __init__(self, pg: Any, cfg: TrainConfig) -> None:
        super().__init__(pg, cfg)
        if cfg.device != "cpu":
            raise StrategyUnavailable("--strategy ps runs on --device cpu (NumPy parameter server)")
        n, s = self.n, cfg.ps_servers
        if cfg.steps < 1:  # servers serve until the last step, workers close after it
            raise ValueError(f"rank {self.rank}: ps: steps must be >= 1, got {cfg.steps}")
        if pg is None or not 1 <= s < n:
            raise ValueError(
                f"rank {self.rank}: ps: --ps-servers must be in [1, {n - 1}] for {n} ranks, got {s}"
            )
        if cfg.elastic and cfg.consistency != "bsp":
            raise ValueError(f"rank {self.rank}: ps: --elastic needs --consistency bsp")
        self.num_servers, self.num_workers = s, n - s
        self.server_ranks = list(range(s))
        self.worker_ranks = list(range(s, n))
        self.is_server = self.rank < s
        self.loss_rank = 0
        self.config = ps_config(cfg, self.num_workers)
        self.elastic = cfg.elastic
        #: Elastic: called with each push_pull's Handle once issued (fault injection).
        self.after_launch: Callable[[Any], None] | None = None
        L = len(self.layers)
        self.layout = flat_layout(param_shapes(self.layers), [(0, L)], 1)
        self.keys: list[tuple[int, int, int]] = []  # (key = layer, offset, size)
        for i in range(L):
            slots = self.layout.layer_slots(i)
            if slots:
                self.keys.append((i, slots[0].offset, sum(sl.size for sl in slots)))
        self.key_of = {k[0]: k for k in self.keys}
        self._make_groups()
        self.start_step = 0
        if self.is_server:
            self._init_server()
        else:
            self._init_worker()

    def _make_groups(self) -> None:
        """Every rank makes the sub-groups (in one order): the PS traffic and losses use
        ``group``; elastic: ``replicas``, the workers' (None on a server), shares a
        replica with a restarted worker."""
        self.group = self.pg.new_group(list(range(self.n)))
        self.replicas = self.pg.new_group(self.worker_ranks) if self.elastic else None

    # -- servers -------------------------------------------------------------------------
    def _init_server(self) -> None:
        self.rows = (0, 0)
        self.server = PSServer(self.config, self.rank)
        self._start_serving()

    def _start_serving(self) -> None:
        self._serve_error: BaseException | None = None
        self._serve_ok = False
        self._thread = threading.Thread(
            target=self._serve, name=f"ps-train-server{self.rank}", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._serve_ok = self.server.serve(self.group, self.worker_ranks)
            if not self._serve_ok:
                raise GroupClosedError(
                    f"rank {self.rank}: ps server {self.rank}: the group ended before every "
                    f"worker closed its client (workers done: {sorted(self.server.byes)})"
                )
        except BaseException as exc:  # noqa: BLE001 (raised by step in the main thread)
            self._serve_error = exc
        finally:
            self.server.close()  # flushes the final checkpoint

    def _check_serving(self) -> None:
        if self._serve_error is not None:
            raise self._serve_error

    def _recv_loss(self, buf: np.ndarray, src: int, step: int) -> None:
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                self.group.recv(buf, src, TAG_LOSS, timeout_s=max(min(_POLL_S, remaining), 1e-3))
                return
            except CommTimeoutError:
                self._check_serving()
                if time.monotonic() >= deadline:
                    raise CommTimeoutError(
                        f"rank {self.rank}: ps server: op recv loss of step {step}, peer {src}, "
                        f"tag {TAG_LOSS:#x}: nothing after {self.cfg.timeout_s:g} s"
                    ) from None

    def _server_step(self, step: int) -> float:
        """Wait until every worker finished ``step``; return the global loss."""
        if self.elastic:  # the workers' partial losses, summed over the job
            self._check_serving()
            return self.global_loss(0.0)
        buf = np.zeros(1, np.float64)
        total = 0.0
        for src in self.worker_ranks:  # summed in worker order
            self._recv_loss(buf, src, step)
            total += float(buf[0])
        if step == self.cfg.steps - 1:  # the workers close their clients after this step
            self.finish()
        return total

    # -- workers -------------------------------------------------------------------------
    def _init_worker(self) -> None:
        cfg, xp = self.cfg, self.xp
        self.index = self.rank - self.num_servers
        self.rows = split_rows(cfg.batch_size, self.num_workers)[self.index]
        total = self.layout.total
        self.params = xp.zeros(total, self.dtype)
        self.grads = xp.zeros(total, self.dtype)
        L = len(self.layers)
        self.pviews = [layer_views(self.layout, self.params, i) for i in range(L)]
        self.gviews = [layer_views(self.layout, self.grads, i) for i in range(L)]
        for i in range(L):
            init_layer(self.layers, i, self.pviews[i], cfg.seed)
        self.worker_update = cfg.ps_update == "worker"
        if self.worker_update:
            self.summed = xp.zeros(total, self.dtype)  # the servers' sum of the gradients
            self.opt = make_optimizer(cfg.optimizer, xp, total, self.dtype, cfg.lr)
        self.handles: list[Any] = []
        self.loss_sends: list[Any] = []
        self._connect()
        # Servers restored from a checkpoint put our clock at their progress: resume there.
        # (Elastic: a restarted worker's clock is the job's step; its state comes later.)
        self.start_step = 0 if self.elastic else self.kv.clock
        if self.start_step:
            if self.worker_update:
                raise ValueError(
                    f"rank {self.rank}: ps: the servers restored step {self.start_step} from "
                    f"{cfg.ps_checkpoint_dir}, but with --ps-update worker the parameters and "
                    "optimizer state live on the workers and are not checkpointed: resume "
                    "needs --ps-update server (or an empty --checkpoint-dir)"
                )
            handles = [self.kv.pull(k, self.params[off : off + size]) for k, off, size in self.keys]
            for h in handles:
                h.wait()

    def _connect(self) -> None:
        """A client of the servers over ``group``, every key registered (a server keeps
        the first value it got for a key: the initial parameters, in a new job)."""
        self.kv = KVWorker(
            self.group,
            self.index,
            self.server_ranks,
            slicer=HashSlicer(split_min_bytes=self.cfg.ps_split_min_bytes),
            timeout_s=self.cfg.timeout_s,
        )
        handles = [self.kv.init(k, self.params[off : off + size]) for k, off, size in self.keys]
        for h in handles:
            h.wait()

    def _layer_done(self, i: int) -> None:
        """Backward finished layer ``i``: its gradient is complete; send it."""
        key = self.key_of.get(i)
        if key is None:
            return
        _, off, size = key
        out = self.summed if self.worker_update else self.params
        self.handles.append(
            self.kv.push_pull(i, self.grads[off : off + size], out[off : off + size])
        )
        if self.after_launch is not None:
            self.after_launch(self.handles[-1])

    def _worker_step(self, step: int) -> float | None:
        if self.elastic and self.kv.clock != step:
            raise RuntimeError(
                f"rank {self.rank}: ps worker {self.index}: step {step}, but the servers are "
                f"at step {self.kv.clock}"
            )
        self.grads[...] = 0
        loss = self.forward_backward(
            self.start_step + step,
            self.pviews.__getitem__,
            self.gviews.__getitem__,
            done=self._layer_done,
        )
        for h in self.handles:
            h.wait()
        self.handles.clear()
        self.kv.advance()
        if self.worker_update:
            self.opt.step([(self.params, self.summed, 0)])
        if self.elastic:
            return self.global_loss(loss)
        for w in self.loss_sends:  # the previous step's (long done: tiny messages)
            w.wait(timeout_s=self.cfg.timeout_s)
        msg = np.array([float(loss)], np.float64)
        self.loss_sends = [self.group.isend(msg, dst, TAG_LOSS) for dst in self.server_ranks]
        if step == self.cfg.steps - 1:
            for w in self.loss_sends:
                w.wait(timeout_s=self.cfg.timeout_s)
            self.loss_sends = []
            self.finish()
        return None

    # -- the interface -----------------------------------------------------------------
    def step(self, step: int) -> float | None:
        if self.is_server:
            return self._server_step(step)
        return self._worker_step(step)

    def finish(self) -> None:
        """After the last step: a worker closes its client (a bye to every server), a
        server waits until every worker did."""
        if self.is_server:
            self._thread.join(self.cfg.timeout_s)
            if self._thread.is_alive():
                raise CommTimeoutError(
                    f"rank {self.rank}: ps server: workers did not close within "
                    f"{self.cfg.timeout_s:g} s (done: {sorted(self.server.byes)})"
                )
            self._check_serving()
        else:
            self.kv.close()
        self.group.close()

    # -- elastic training (ringcomm.engine.elastic) -----------------------------------
    @property
    def votes_step(self) -> bool:
        """Whether this rank's step counts when survivors agree on one (a server's
        follows its workers')."""
        return not self.is_server

    def launches_per_step(self) -> int:
        """push_pulls per step (``fail_at``'s bucket counts them; a server: none)."""
        return 0 if self.is_server else len(self.keys)

    def state_arrays(self) -> list[Any]:
        """What a worker snapshots and a restarted one gets: the replica (and, updating on
        the workers, the optimizer state). A server: nothing (it keeps its undo copy)."""
        if self.is_server:
            return []
        if self.worker_update:
            return [self.params, *self.opt.state_arrays()]
        return [self.params]

    @property
    def opt_steps(self) -> int:
        return int(self.opt.t) if not self.is_server and self.worker_update else 0

    @opt_steps.setter
    def opt_steps(self, t: int) -> None:
        if not self.is_server and self.worker_update:
            self.opt.t = t

    def abandon(self) -> None:
        """The group failed (or is replaced): a server stops serving it, a worker drops
        its client once its requests ended. Idempotent."""
        if self.is_server:
            self.server.interrupt()  # wakes pulls that wait on the state
            try:
                self.group.close()  # its receive loops' operations fail: they end
            except RingcommError:
                pass
            self._thread.join(self.cfg.timeout_s)
            if self._thread.is_alive():
                raise CommTimeoutError(
                    f"rank {self.rank}: ps server: its request loops did not end within "
                    f"{self.cfg.timeout_s:g} s of the group's failure"
                )
        else:
            self.kv.abandon()
            self.handles.clear()

    def regroup(self, pg: Any, step: int = 0) -> None:
        """Go on over ``pg`` (the world group after a shrink or grow; every rank calls it)
        at the start of step ``step``: new sub-groups; a server goes back to that step for
        the new number of workers and serves the new group; a worker takes its rows of the
        global batch among the new workers and connects a new client. A lost server slot
        raises ``PeerFailedError``: the job ends (module docstring)."""
        s = self.num_servers
        if pg.slots[:s] != list(range(s)):
            lost = sorted(set(range(s)) - set(pg.slots))
            raise PeerFailedError(
                f"rank {pg.rank} (slot {pg.slot}): ps --elastic: server "
                f"slot{'s' if len(lost) > 1 else ''} "
                f"{', '.join(map(str, lost))} lost at step {step}; elastic training replaces "
                "lost workers only (a server's part of the model is gone with it): the job ends",
                peer=lost[0],
            )
        self.abandon()
        self.pg, self.rank, self.n = pg, pg.rank, pg.world_size
        self.num_workers = self.n - s
        self.worker_ranks = list(range(s, self.n))
        self.config = ps_config(self.cfg, self.num_workers)
        self._make_groups()
        if self.is_server:
            state = self.server.state.rebase(self.config, step)
            self.server = PSServer(self.config, self.rank, restore=False, state=state)
            self._start_serving()
            return
        self.index = self.rank - s
        self.rows = split_rows(self.cfg.batch_size, self.num_workers)[self.index]
        self._connect()
        if self.kv.clock != step:
            raise RuntimeError(
                f"rank {self.rank}: ps worker {self.index}: regrouped at step {step}, but the "
                f"servers are at step {self.kv.clock}"
            )

    def state_nbytes(self) -> dict[str, int]:
        if not self.is_server:
            grad = int(self.grads.nbytes) + (int(self.summed.nbytes) if self.worker_update else 0)
            return {
                "param_bytes": int(self.params.nbytes),
                "grad_bytes": grad,
                "optim_bytes": self.opt.state_nbytes() if self.worker_update else 0,
            }
        param = grad = optim = 0
        with self.server.cond:
            for sh in self.server.state.shards.values():
                param += int(sh.param.nbytes)
                # per-element state only (not the 0-d step counters)
                optim += sum(int(a.nbytes) for a in sh.opt_state.values() if a.ndim)
                held = [g for d in sh.pending.values() for g in d.values()]
                held += list(sh.averages.values()) + list(sh.inbox.values())
                grad += sum(int(g.nbytes) for g in held)
        return {"param_bytes": param, "grad_bytes": grad, "optim_bytes": optim}

    def export_params(self) -> dict[str, np.ndarray]:
        """A worker's replica (after the last step: the final parameters); servers: none."""
        if self.is_server:
            return {}
        return export_params(self.layers, self.layout, self.params)

    def extra(self) -> dict[str, Any]:
        common = {
            "consistency": self.cfg.consistency,
            "staleness": self.cfg.staleness,
            "update": self.cfg.ps_update,
            "servers": self.num_servers,
            "workers": self.num_workers,
        }
        if self.is_server:
            with self.server.cond:
                st = self.server.state.stats()
            shards = [
                {"key": s["key"], "start": s["start"], "stop": s["stop"], "applied": s["applied"]}
                for s in st["shards"]
            ]
            info = {
                "role": "server",
                "index": self.rank,
                **common,
                "pulls": st["pulls"],
                "max_pull_gap": st["max_gap"],
                "min_pull_gap": st["min_gap"],
                "gap_counts": st["gap_counts"],
                "dropped_pushes": st["dropped_pushes"],
                "checkpoints_written": st["checkpoints_written"],
                "restored_progress": st["restored_progress"],
                "shards": shards,
            }
        else:
            gaps = Counter(self.kv.pull_gaps)
            info = {
                "role": "worker",
                "index": self.index,
                **common,
                "pulls": sum(gaps.values()),
                "max_pull_gap": self.kv.max_pull_gap,
                "gap_hist": {str(g): c for g, c in sorted(gaps.items())},
                "lost_pulls": self.kv.lost_pulls,
                "start_step": self.start_step,
                "rows": list(self.rows),
            }
        return {"ps": info}


def ps_summary(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The job-wide ``"ps"`` object of ``train --json``: roles, modes, the largest clock gap
    any pull was served at (over every server's record), pulls per gap."""
    infos = [r["extra"]["ps"] for r in per_rank]
    servers = [i for i in infos if i["role"] == "server"]
    gaps: Counter[int] = Counter()
    for s in servers:
        for k, c in enumerate(s["gap_counts"]):
            gaps[s["min_pull_gap"] + k] += c
    first = infos[0]
    return {
        "servers": first["servers"],
        "workers": first["workers"],
        "consistency": first["consistency"],
        "staleness": first["staleness"],
        "update": first["update"],
        "max_pull_gap": max((s["max_pull_gap"] for s in servers), default=0),
        "pulls": sum(gaps.values()),
        "pulls_by_gap": {str(g): c for g, c in sorted(gaps.items())},
        "checkpoints_written": sum(s["checkpoints_written"] for s in servers),
    }
