"""What one server holds and decides: shards, worker clocks, consistency, checkpoints.

Pure bookkeeping, no sockets and no threads: the server (:mod:`ringcomm.ps.server`) calls
these methods under its lock and turns "not ready" into a wait, so the consistency rules
(``bsp``, ``ssp`` with bound K, ``asp``) are unit-tested directly. Worker ``w``'s clock on a
shard counts the steps it pushed there; a pull's *gap* is its clock minus the slowest
worker's, recorded for every served pull.

Invariants: a push for a step below the worker's clock is a duplicate and is dropped; bsp
sums a step's gradients in worker order (the same bits every run) and a pull at clock
``c`` waits until ``version >= c``; ssp delays a pull while its gap would exceed K; in
worker-update mode every worker applies every gradient exactly once. The bsp averages and
inboxes not yet pulled are not checkpointed. :meth:`ServerState.rebase` (undo, elastic)
puts every shard back to a step's start. Details: docs/architecture.md, section "ps/state.py".
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import numpy as np

from ringcomm.ps.config import PSConfig
from ringcomm.ps.updaters import Updater, make_updater

__all__ = ["DTYPES", "ServerState", "Shard", "load_checkpoint", "save_checkpoint"]

#: Parameter dtypes, by their code in request headers.
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

STATUS_OK = 0
STATUS_DROPPED = 1  # a duplicate or stale push, ignored
STATUS_LOST = 2  # worker update: the averaged gradient of that step was lost in a restart


class Shard:
    """Elements ``[start, stop)`` of key ``key`` (``total`` elements in all)."""

    def __init__(
        self, key: int, start: int, stop: int, total: int, dtype: np.dtype, num_workers: int
    ) -> None:
        self.key, self.start, self.stop, self.total = key, start, stop, total
        self.dtype = np.dtype(dtype)
        self.param = np.zeros(stop - start, self.dtype)
        self.opt_state: dict[str, np.ndarray] = {}
        self.version = 0  # bsp: steps applied (with resyncs); ssp/asp: pushes applied
        self.applied = 0  # updates actually applied (what a restart can lose)
        self.clocks = np.zeros(num_workers, np.int64)
        self.pending: dict[int, dict[int, np.ndarray]] = {}  # bsp: step -> worker -> grad
        self.averages: dict[int, np.ndarray] = {}  # bsp worker update: step -> average
        self.served: dict[int, int] = {}  # bsp worker update: step -> pulls served
        self.inbox: dict[int, np.ndarray] = {}  # ssp/asp worker update: worker -> sum of g/W
        # keep_undo, server update: the state before applying step ``undo_step`` (-1: none)
        self.undo_step = -1
        self.undo_param: np.ndarray | None = None
        self.undo_opt: dict[str, np.ndarray] = {}

    @property
    def nelem(self) -> int:
        return self.stop - self.start

    def describe(self) -> str:
        return f"key {self.key} [{self.start}:{self.stop}] of {self.total} {self.dtype}"


class ServerState:
    def __init__(
        self, config: PSConfig, server_index: int = 0, updater: Updater | None = None
    ) -> None:
        self.config = config
        self.server_index = server_index
        self.num_workers = config.num_workers
        self.updater = updater or make_updater(config.optimizer, **config.optimizer_args)
        self.shards: dict[tuple[int, int], Shard] = {}
        self.gap_counts: dict[int, int] = {}  # gap -> pulls served at it (every pull counts)
        self.dropped_pushes = 0
        self.last_checkpoint_progress = 0
        self.checkpoints_written = 0
        self.restored_progress: int | None = None  # progress of the checkpoint we started from
        self.needs_resync = False
        self.hello_clocks: dict[int, int] = {}

    # -- keys --------------------------------------------------------------------------
    def shard(self, key: int, start: int) -> Shard | None:
        return self.shards.get((key, start))

    def init_shard(
        self,
        key: int,
        start: int,
        stop: int,
        total: int,
        dtype: np.dtype,
        value: np.ndarray,
        clock: int = 0,
    ) -> Shard:
        """Create the shard from ``value`` (the first init wins; later ones must agree in
        layout and are ignored). ``clock``: the initialising worker's clock; a key made
        in the middle of a job starts there (version and every worker's clock), so that it
        does not wait for steps that were pushed before it existed."""
        sh = self.shards.get((key, start))
        if sh is not None:
            if (sh.stop, sh.total, sh.dtype) != (stop, total, np.dtype(dtype)):
                raise ValueError(
                    f"server {self.server_index}: init of key {key} [{start}:{stop}] of {total} "
                    f"{np.dtype(dtype)} conflicts with {sh.describe()}"
                )
            return sh
        sh = Shard(key, start, stop, total, dtype, self.num_workers)
        sh.param[...] = value
        sh.version = clock
        sh.clocks[:] = clock
        if self.config.update == "server":
            sh.opt_state = self.updater.new_state(sh.param)
        self.shards[(key, start)] = sh
        return sh

    # -- pushes ------------------------------------------------------------------------
    def push(self, worker: int, sh: Shard, step: int, grad: np.ndarray) -> int:
        """Take worker ``worker``'s gradient of ``step`` (``grad`` becomes the state's: the
        caller must not reuse it). Returns a status."""
        if step < sh.clocks[worker] or (self.config.consistency == "bsp" and step < sh.version):
            self.dropped_pushes += 1
            return STATUS_DROPPED
        sh.clocks[worker] = step + 1
        if self.config.consistency == "bsp":
            sh.pending.setdefault(step, {})[worker] = grad
            self._complete_steps(sh)
            return STATUS_OK
        if self.config.reduce == "avg":
            grad /= self.num_workers
        if self.config.update == "server":
            self.updater.apply(sh.param, grad, sh.opt_state)
        else:
            for w in range(self.num_workers):
                box = sh.inbox.get(w)
                if box is None:
                    sh.inbox[w] = grad.copy()
                else:
                    box += grad
        sh.version += 1
        sh.applied += 1
        return STATUS_OK

    def _complete_steps(self, sh: Shard) -> None:
        while len(sh.pending.get(sh.version, ())) == self.num_workers:
            grads = sh.pending.pop(sh.version)
            avg = grads[0]  # owned by us: sum in worker order into the first
            for w in range(1, self.num_workers):
                avg += grads[w]
            if self.config.reduce == "avg":
                avg /= self.num_workers
            if self.config.update == "server":
                if self.config.keep_undo:
                    _keep_undo(sh)
                self.updater.apply(sh.param, avg, sh.opt_state)
            else:
                sh.averages[sh.version] = avg
            sh.version += 1
            sh.applied += 1
        # Steps that can no longer complete (below version after a resync) are dropped.
        for t in [t for t in sh.pending if t < sh.version]:
            del sh.pending[t]

    # -- pulls -------------------------------------------------------------------------
    def gap(self, sh: Shard, reader_clock: int) -> int:
        return int(reader_clock - sh.clocks.min())

    def pull_ready(self, sh: Shard, reader_clock: int) -> bool:
        """May a pull at ``reader_clock`` be served now (else the server waits)?"""
        if self.config.consistency == "bsp":
            return sh.version >= reader_clock
        bound = self.config.bound
        return bound is None or self.gap(sh, reader_clock) <= bound

    def pull(
        self, sh: Shard, reader_clock: int, copy: bool, worker: int = 0
    ) -> tuple[np.ndarray, int, int]:
        """``(array to send, status, gap)`` of a ready pull; records the gap.

        The array is the shard's own parameter unless ``copy`` (the caller sends it after
        releasing the lock) or it is an average or inbox handed over to this pull
        (``worker``: the reader).
        """
        gap = self.gap(sh, reader_clock)
        self.gap_counts[gap] = self.gap_counts.get(gap, 0) + 1
        status = STATUS_OK
        if self.config.update == "server":
            out = sh.param.copy() if copy else sh.param
        elif self.config.consistency == "bsp":
            step = reader_clock - 1
            out = sh.averages.get(step)  # type: ignore[assignment]
            if out is None:
                out, status = np.zeros(sh.nelem, sh.dtype), STATUS_LOST
            else:
                sh.served[step] = sh.served.get(step, 0) + 1
                if sh.served[step] >= self.num_workers:
                    del sh.averages[step], sh.served[step]
            # Averages nobody will ask for any more (workers skipped them): keep a window.
            for old in [t for t in sh.averages if t < sh.version - 8]:
                del sh.averages[old]
                sh.served.pop(old, None)
        else:
            box = sh.inbox.pop(worker, None)
            out = np.zeros(sh.nelem, sh.dtype) if box is None else box
        return out, status, gap

    # -- progress, reconnects ----------------------------------------------------------
    def progress(self) -> int:
        """Steps every worker has pushed to every shard (0 with no shards)."""
        if not self.shards:
            return 0
        return int(min(sh.clocks.min() for sh in self.shards.values()))

    def checkpoint_due(self) -> bool:
        every = self.config.checkpoint_every_steps
        return bool(every) and self.progress() >= self.last_checkpoint_progress + every

    def hello(self, worker: int, clock: int) -> None:
        self.hello_clocks[worker] = clock

    def resync_ready(self) -> bool:
        return len(self.hello_clocks) >= self.num_workers

    def resync(self) -> None:
        """After a restore: every worker said where it is. Updates between our checkpoint
        and the crash are lost; move clocks (and bsp versions) up to the workers' so that
        the job continues instead of waiting for steps nobody will push again."""
        top = max(self.hello_clocks.values(), default=0)
        for sh in self.shards.values():
            for w, c in self.hello_clocks.items():
                sh.clocks[w] = max(int(sh.clocks[w]), c)
            if self.config.consistency == "bsp" and sh.version < top:
                sh.version = top
                sh.pending.clear()
                sh.averages.clear()
                sh.served.clear()
        self.needs_resync = False

    def rebase(self, config: PSConfig, step: int) -> ServerState:
        """This state for ``config`` (another number of workers: elastic training, after a
        worker was lost or came back), every shard as it was when step ``step`` began.

        A bsp shard is at ``step`` or one past it (every worker pushed ``step`` there
        before one was lost): then its last update is undone (server update: the copy kept
        under ``keep_undo``; worker update: the sum of that step is dropped, the
        parameters never changed). Whatever was pushed for ``step`` or later is dropped
        (partial sums of a lost worker's step), and every worker's clock is ``step``.
        ``ValueError`` for a shard anywhere else. The shards move to the new state (this
        one is done); the pull and drop counters go on."""
        if config.consistency != "bsp" or self.config.consistency != "bsp":
            raise ValueError(f"server {self.server_index}: rebase needs bsp")
        new = ServerState(config, self.server_index, self.updater)
        for key, sh in self.shards.items():
            if sh.version == step + 1 and config.update == "server":
                if sh.undo_step != step or sh.undo_param is None:
                    raise ValueError(
                        f"server {self.server_index}: {sh.describe()} applied step {step} "
                        f"and kept no copy from before it (keep_undo: {config.keep_undo})"
                    )
                sh.param[...] = sh.undo_param
                for name, value in sh.undo_opt.items():
                    sh.opt_state[name][...] = value
            elif sh.version not in (step, step + 1):
                raise ValueError(
                    f"server {self.server_index}: {sh.describe()} is at step {sh.version}, "
                    f"cannot go back to step {step}"
                )
            if sh.version != step:
                sh.applied -= 1
            sh.version, sh.undo_step = step, -1
            sh.clocks = np.full(config.num_workers, step, np.int64)
            sh.pending.clear()
            sh.averages.clear()
            sh.served.clear()
            sh.inbox.clear()
            new.shards[key] = sh
        new.gap_counts = self.gap_counts
        new.dropped_pushes = self.dropped_pushes
        self.shards = {}
        return new

    def stats(self) -> dict[str, Any]:
        lo, hi = min(self.gap_counts, default=0), max(self.gap_counts, default=0)
        return {
            "server": self.server_index,
            "pulls": sum(self.gap_counts.values()),
            "max_gap": hi,
            "min_gap": lo,
            # pulls served at gap min_gap + i, for each i
            "gap_counts": [self.gap_counts.get(g, 0) for g in range(lo, hi + 1)]
            if self.gap_counts
            else [],
            "dropped_pushes": self.dropped_pushes,
            "progress": self.progress(),
            "checkpoints_written": self.checkpoints_written,
            "restored_progress": self.restored_progress,
            "shards": [
                {
                    "key": sh.key,
                    "start": sh.start,
                    "stop": sh.stop,
                    "version": sh.version,
                    "applied": sh.applied,
                    "clocks": sh.clocks.tolist(),
                }
                for sh in self.shards.values()
            ],
        }

    # -- checkpoints -------------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        """The state as named arrays (what :func:`save_checkpoint` writes)."""
        shards: list[dict[str, Any]] = []
        meta = {
            "format": 1,
            "server": self.server_index,
            "config": {
                "consistency": self.config.consistency,
                "update": self.config.update,
                "num_workers": self.num_workers,
                "reduce": self.config.reduce,
            },
            "updater": self.updater.config(),
            "progress": self.progress(),
            "shards": shards,
        }
        arrays: dict[str, np.ndarray] = {}
        for i, sh in enumerate(self.shards.values()):
            shards.append(
                {
                    "key": sh.key,
                    "start": sh.start,
                    "stop": sh.stop,
                    "total": sh.total,
                    "dtype": sh.dtype.str,
                    "version": sh.version,
                    "applied": sh.applied,
                    "state": sorted(sh.opt_state),
                }
            )
            arrays[f"s{i}/param"] = sh.param
            arrays[f"s{i}/clocks"] = sh.clocks
            for name, value in sh.opt_state.items():
                arrays[f"s{i}/opt/{name}"] = value
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        return arrays

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        meta = json.loads(bytes(arrays["meta"]).decode())
        cfg = meta["config"]
        if (cfg["consistency"], cfg["update"], cfg["num_workers"], cfg.get("reduce", "avg")) != (
            self.config.consistency,
            self.config.update,
            self.num_workers,
            self.config.reduce,
        ):
            raise ValueError(
                f"server {self.server_index}: checkpoint was written for {cfg}, this server runs "
                f"consistency={self.config.consistency} update={self.config.update} "
                f"num_workers={self.num_workers} reduce={self.config.reduce}"
            )
        self.shards.clear()
        for i, m in enumerate(meta["shards"]):
            sh = Shard(
                m["key"], m["start"], m["stop"], m["total"], np.dtype(m["dtype"]), self.num_workers
            )
            sh.param[...] = arrays[f"s{i}/param"]
            sh.clocks[...] = arrays[f"s{i}/clocks"]
            sh.version, sh.applied = m["version"], m["applied"]
            sh.opt_state = {name: np.array(arrays[f"s{i}/opt/{name}"]) for name in m["state"]}
            self.shards[(sh.key, sh.start)] = sh
        self.restored_progress = int(meta["progress"])
        self.last_checkpoint_progress = self.restored_progress
        self.needs_resync = True
        self.hello_clocks.clear()


def _keep_undo(sh: Shard) -> None:
    """Copy the shard's state before it applies step ``sh.version`` (buffers reused)."""
    if sh.undo_param is None:
        sh.undo_param = np.empty_like(sh.param)
        sh.undo_opt = {name: np.empty_like(value) for name, value in sh.opt_state.items()}
    np.copyto(sh.undo_param, sh.param)
    for name, value in sh.opt_state.items():
        np.copyto(sh.undo_opt[name], value)
    sh.undo_step = sh.version


def checkpoint_path(directory: str, server_index: int) -> str:
    return os.path.join(directory, f"ps-server-{server_index}.npz")


def save_checkpoint(state: ServerState, directory: str) -> str:
    """Write ``state`` atomically: a temporary file in ``directory``, fsync, rename over
    the previous checkpoint (a crash leaves the old or the new one, never a torn one)."""
    os.makedirs(directory, exist_ok=True)
    path = checkpoint_path(directory, state.server_index)
    progress = state.progress()
    fd, tmp = tempfile.mkstemp(
        prefix=f".ps-server-{state.server_index}-", suffix=".tmp", dir=directory
    )
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **state.to_arrays())  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    state.last_checkpoint_progress = progress
    state.checkpoints_written += 1
    return path


def load_checkpoint(state: ServerState, directory: str) -> bool:
    """Load this server's latest checkpoint from ``directory`` if there is one."""
    path = checkpoint_path(directory, state.server_index)
    if not os.path.exists(path):
        return False
    with np.load(path) as data:
        state.load_arrays({name: data[name] for name in data.files})
    return True
