"""Standalone servers: forming the parameter-server group, and re-forming it after a restart.

Servers started on their own (``ringcomm ps-server``) and the job's workers meet through a
*coordinator*: a rendezvous :class:`~ringcomm.rendezvous.Store` that outlives them (the
job's own store, a launcher's, or one started for the purpose), under the key prefix
``ps``. Together they form a process group of ``W + S`` ranks (workers ``0..W-1``, servers
``W..W+S-1``) for the current *epoch*:

1. ``epoch`` (an integer in the coordinator) names the current group. Worker 0 serves that
   epoch's rendezvous store (a fresh one per epoch, so rank keys never collide) and
   publishes its address under ``epoch/<e>/store``; everyone joins with
   :func:`ringcomm.init_process_group`.
2. A restarted server (the coordinator remembers each server's starts) loads its latest
   checkpoint and *abandons* the current epoch: the first to add to ``epoch/<e>/abandon``
   moves ``epoch`` to ``e + 1``. So does any rank whose join of epoch ``e`` timed out.
3. Every member watches ``epoch`` (a thread, every ``poll_s``); when it moves, it closes its
   group, which fails whatever was waiting on it, and joins the new epoch. Workers then say
   hello (their clock) and re-send unanswered requests (:class:`~ringcomm.ps.worker.KVWorker`);
   a restored server moves its clocks up to the workers' (updates since its checkpoint are
   lost: at most one checkpoint interval).

Every wait is bounded: joining an epoch by ``join_timeout_s`` (then that epoch is
abandoned), the whole recovery by ``timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ringcomm.config import environment, security_mode
from ringcomm.errors import CommTimeoutError, RendezvousError, RingcommError
from ringcomm.group import init_process_group
from ringcomm.ps.config import PSConfig
from ringcomm.ps.server import PSServer
from ringcomm.ps.slicer import Slicer
from ringcomm.ps.worker import KVWorker
from ringcomm.rendezvous import Store, StoreServer
from ringcomm.rendezvous.security import job_store

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Membership", "connect_worker", "run_server"]

log = logging.getLogger(__name__)

_PASSED_ENV = ("RINGCOMM_TRANSPORT", "RINGCOMM_CHUNK_BYTES", "RINGCOMM_LOG", "RINGCOMM_SECURITY")


class Membership:
    """One member's view of the epochs: joins, watches, re-joins (see the module doc)."""

    def __init__(
        self,
        coordinator: tuple[str, int],
        *,
        role: str,
        index: int,
        num_workers: int,
        num_servers: int,
        token: str | None = None,
        timeout_s: float = 300.0,
        join_timeout_s: float = 20.0,
        poll_s: float = 0.2,
        host: str = "127.0.0.1",
        prefix: str = "ps",
        on_epoch_end: Callable[[], None] | None = None,
    ) -> None:
        if role not in ("worker", "server"):
            raise ValueError(f"ps: role must be 'worker' or 'server', got {role!r}")
        limit = num_workers if role == "worker" else num_servers
        if not 0 <= index < limit:
            raise ValueError(f"ps: {role} index {index} out of range [0, {limit})")
        self.role, self.index = role, index
        self.num_workers, self.num_servers = num_workers, num_servers
        self.rank = index if role == "worker" else num_workers + index
        self.label = f"ps {role} {index} (rank {self.rank})"
        self.token, self.timeout_s = token, timeout_s
        self.join_timeout_s, self.poll_s, self.host = join_timeout_s, poll_s, host
        self.security = security_mode()
        addr, port = coordinator
        self.coord = Store(
            addr,
            port,
            token=token,
            timeout_s=min(timeout_s, 30.0),
            prefix=prefix,
            label=self.label,
            claim=self.label,
            auth=self.security != "none",
        )
        if self.token is None and self.security != "none":
            self.token = self.coord.token  # the coordinator handed out the job's
        self.epoch = -1
        self.group: Any = None
        self.joins = 0
        self._stores: list[StoreServer] = []  # worker 0: each epoch's rendezvous store
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._closed = False
        self.on_epoch_end = on_epoch_end

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self.num_workers, self.num_workers + self.num_servers))

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.num_workers))

    def current_epoch(self) -> int:
        return self.coord.add("epoch", 0)

    def abandon(self, epoch: int) -> None:
        """Move the job past ``epoch`` (once, however many members ask)."""
        if self.coord.add(f"epoch/{epoch}/abandon", 1) == 1:
            self.coord.add("epoch", 1)

    # -- joining -----------------------------------------------------------------------
    def join(self) -> Any:
        """Join the current epoch's group, later than any joined before (abandoning
        epochs that cannot form)."""
        self._stop_watching()
        if self.group is not None:
            self._close_group()
        deadline = time.monotonic() + self.timeout_s
        epoch = self.current_epoch()
        if epoch <= self.epoch:  # our group failed or closed: only a later epoch can form
            epoch = self._wait_past(self.epoch, deadline)
        while True:
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"{self.label}: op ps.join: no epoch formed within {self.timeout_s:g} s"
                )
            try:
                group = self._form(epoch)
                break
            except (RendezvousError, CommTimeoutError) as exc:
                log.info("%s: epoch %d did not form (%s); abandoning it", self.label, epoch, exc)
                self.abandon(epoch)
                epoch = self._wait_past(epoch, deadline)
        self.group, self.epoch = group, epoch
        self.joins += 1
        self._watch_stop = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch,
            args=(group, epoch, self._watch_stop),
            name=f"ps-watch-{self.role}{self.index}",
            daemon=True,
        )
        self._watcher.start()
        return group

    def _wait_past(self, epoch: int, deadline: float) -> int:
        while time.monotonic() < deadline:
            e = self.current_epoch()
            if e > epoch:
                return e
            time.sleep(self.poll_s)
        raise CommTimeoutError(
            f"{self.label}: op ps.join: epoch {epoch} was abandoned and no new one began"
        )

    def _form(self, epoch: int) -> Any:
        key = f"epoch/{epoch}/store"
        if self.rank == 0 and self.coord.try_get(key) is None:
            world = self.num_workers + self.num_servers
            server = job_store(self.host, 0, self.token, self.security, world, _epoch_ns(epoch))
            self._stores.append(server)
            self.coord.set(key, f"{self.host}:{server.port}")
        where = self.coord.get(key, timeout_s=self.join_timeout_s).decode()
        host, port = where.rsplit(":", 1)
        inherited = environment()
        env = {k: inherited[k] for k in _PASSED_ENV if k in inherited}
        return init_process_group(
            self.rank,
            self.num_workers + self.num_servers,
            master_addr=host,
            master_port=int(port),
            timeout_s=self.join_timeout_s,
            token=self.token,
            host_store=False,
            env=env,
            group_name=_epoch_ns(epoch),  # its own store: no process-wide count
        )

    def _watch(self, group: Any, epoch: int, stop: threading.Event) -> None:
        while not stop.wait(self.poll_s):
            try:
                moved = self.current_epoch() > epoch
            except RingcommError:
                continue  # the coordinator is busy or briefly gone: look again
            if moved:
                log.info("%s: epoch %d ended; closing its group", self.label, epoch)
                try:
                    group.close()
                except Exception:
                    log.exception("%s: closing the group of epoch %d", self.label, epoch)
                if self.on_epoch_end is not None:
                    self.on_epoch_end()
                return

    def _stop_watching(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=10.0)
        self._watcher = None

    def _close_group(self) -> None:
        try:
            self.group.close()
        except Exception:
            log.exception("%s: closing the group of epoch %d", self.label, self.epoch)
        self.group = None

    # -- the KVWorker's connector ----------------------------------------------------------
    def reconnect(self, failed_group: Any) -> tuple[Any, list[int]]:
        """The group of the next epoch (waits for one to begin)."""
        return self.join(), self.server_ranks

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_watching()
        if self.group is not None:
            group_store = self._stores[-1] if self._stores else None
            self._close_group()
            if group_store is not None:  # let the other members check out before it goes
                try:
                    with Store(self.host, group_store.port, token=self.token, timeout_s=10.0) as s:
                        s.wait(["__all_closed__"], timeout_s=10.0)
                except RingcommError:
                    pass
        for server in self._stores:
            server.close()
        self._stores.clear()
        self.coord.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_worker(
    coordinator: tuple[str, int],
    index: int,
    num_workers: int,
    num_servers: int,
    *,
    token: str | None = None,
    timeout_s: float = 300.0,
    join_timeout_s: float = 20.0,
    slicer: Slicer | None = None,
    host: str = "127.0.0.1",
) -> KVWorker:
    """Worker ``index``'s client of standalone servers; ``close()`` also leaves the group."""
    m = Membership(
        coordinator,
        role="worker",
        index=index,
        num_workers=num_workers,
        num_servers=num_servers,
        token=token,
        timeout_s=timeout_s,
        join_timeout_s=join_timeout_s,
        host=host,
    )
    try:
        group = m.join()
        return KVWorker(
            group, index, m.server_ranks, slicer=slicer, timeout_s=timeout_s, connector=m
        )
    except BaseException:
        m.close()
        raise


def run_server(
    coordinator: tuple[str, int],
    index: int,
    num_servers: int,
    config: PSConfig,
    *,
    token: str | None = None,
    join_timeout_s: float = 20.0,
    host: str = "127.0.0.1",
) -> PSServer:
    """Serve as standalone server ``index`` until every worker said bye; returns the server
    (closed: its final checkpoint written). A restart (this index started before, per the
    coordinator) restores the latest checkpoint and makes the job re-form."""
    server = PSServer(config, index)
    with Membership(
        coordinator,
        role="server",
        index=index,
        num_workers=config.num_workers,
        num_servers=num_servers,
        token=token,
        timeout_s=config.timeout_s,
        join_timeout_s=join_timeout_s,
        host=host,
        on_epoch_end=server.interrupt,
    ) as m:
        starts = m.coord.add(f"server/{index}/starts", 1)
        if starts > 1:
            log.info(
                "%s: restart %d (restored: %s); re-forming the job",
                m.label,
                starts - 1,
                server.restored,
            )
            m.abandon(m.current_epoch())
        try:
            while True:
                group = m.join()
                if server.serve(group, m.worker_ranks):
                    break
        finally:
            server.close()
    return server


def _epoch_ns(epoch: int) -> str:
    """The namespace of epoch ``epoch``'s group (in a store of its own)."""
    return f"ps-epoch-{epoch}"
