"""A parameter server: one receive loop per worker over a ProcessGroup, shared state.

The p2p layer has no receive-from-any-source, so a server runs one thread per worker, each
blocking on that worker's request stream (:mod:`ringcomm.ps.protocol`), all sharing one
:class:`~ringcomm.ps.state.ServerState` under a condition variable (a pull not allowed yet
waits on it; every push wakes the waiters). Receives and sends are asynchronous
(``irecv(...).wait()``), so the group's progress thread drives the socket meanwhile.

Invariants: a malformed request gets an error reply, its payload read and dropped, and the
server goes on serving everyone (sizes are checked before anything is allocated); a push
costs one copy out of the socket; under bsp a pull sends the shard's parameter zero-copy
outside the lock (no update can happen before the reader pushes again), under ssp/asp a
copy taken under the lock. Details: docs/architecture.md, section "ps/server.py".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ringcomm.errors import (
    CommTimeoutError,
    GroupClosedError,
    MessageMismatchError,
    PeerFailedError,
    RingcommError,
)
from ringcomm.ps import protocol as P
from ringcomm.ps.config import PSConfig
from ringcomm.ps.state import DTYPES, STATUS_OK, ServerState, load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["PSServer"]

log = logging.getLogger(__name__)


class PSServer:
    """Server ``index``'s state and request handling; :meth:`serve` runs it over a group.

    The state outlives a group: a standalone server serves one group after another when
    the job re-forms after a restart (:mod:`ringcomm.ps.membership`).
    """

    def __init__(
        self,
        config: PSConfig,
        index: int = 0,
        *,
        restore: bool = True,
        state: ServerState | None = None,
    ) -> None:
        """``state``: serve that one (made for ``config``, e.g. by
        :meth:`~ringcomm.ps.state.ServerState.rebase`) instead of a fresh one."""
        self.config = config
        self.index = index
        if state is not None and state.config != config:
            raise ValueError(f"ps server {index}: the state given was made for another config")
        self.state = state if state is not None else ServerState(config, index)
        self.cond = threading.Condition()
        self.byes: set[int] = set()
        self.restored = False
        if restore and state is None and config.checkpoint_dir:
            self.restored = load_checkpoint(self.state, config.checkpoint_dir)
            if self.restored:
                log.info(
                    "ps server %d: restored at progress %s", index, self.state.restored_progress
                )
        self._closed = False
        self._interrupted = False

    def interrupt(self) -> None:
        """The group is going away (closed by another thread): wake every request that
        waits on the state, so that its thread sees the closed group and ends."""
        with self.cond:
            self._interrupted = True
            self.cond.notify_all()

    def _check_interrupted(self, w: int, op: int) -> None:
        if self._interrupted:
            raise GroupClosedError(
                f"ps server {self.index}: worker {w}, op {P.OP_NAMES.get(op, op)}: the group was closed"
            )

    # -- serving -----------------------------------------------------------------------
    def serve(self, group: Any, worker_ranks: Sequence[int]) -> bool:
        """Serve the workers (group ranks ``worker_ranks``, worker ``w`` at position ``w``)
        until each said bye (True), or the group failed or was closed (False)."""
        if len(worker_ranks) != self.config.num_workers:
            raise ValueError(
                f"ps server {self.index}: {len(worker_ranks)} worker ranks for "
                f"num_workers={self.config.num_workers}"
            )
        with self.cond:
            self._interrupted = False
            if self.state.needs_resync:  # hellos of an abandoned group do not count
                self.state.hello_clocks.clear()
        errors: list[BaseException] = []
        threads = [
            threading.Thread(
                target=self._loop_guarded,
                args=(group, w, peer, errors),
                name=f"ps-server{self.index}-w{w}",
                daemon=True,
            )
            for w, peer in enumerate(worker_ranks)
            if w not in self.byes
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # a group that was closed (a new epoch) or lost a member ends this serve quietly
        real = [e for e in errors if not isinstance(e, (GroupClosedError, PeerFailedError))]
        if real:
            raise real[0]
        return len(self.byes) >= self.config.num_workers

    def _loop_guarded(self, group: Any, w: int, peer: int, errors: list[BaseException]) -> None:
        try:
            self._loop(group, w, peer)
        except BaseException as exc:  # noqa: BLE001 (reported by serve)
            if not isinstance(exc, (GroupClosedError, PeerFailedError)):
                # the other workers' loops go on until they say bye: say it now, loudly
                log.error("ps server %d: the loop of worker %d failed: %r", self.index, w, exc)
            errors.append(exc)
            with self.cond:
                self.cond.notify_all()

    def _loop(self, g: Any, w: int, peer: int) -> None:
        hdr = np.empty(P.REQUEST_WORDS, np.int64)
        timeout_s = self.config.timeout_s
        while True:
            try:
                g.irecv(hdr, peer, P.TAG_REQUEST).wait(timeout_s=timeout_s)
            except CommTimeoutError:
                continue  # an idle worker is no error; a closed group ends the loop
            except MessageMismatchError as exc:  # not a request header (read and dropped)
                reply, _ = self._error(w, 0, -1, f"malformed request: {exc}", 0, -1)
                g.isend(reply, peer, P.TAG_REPLY).wait(timeout_s=timeout_s)
                continue
            op, key, step, start, nelem, code, extra, _seq = (int(v) for v in hdr)
            payload = None
            problem = self._malformed(op, key, start, nelem, code, extra)
            if op in P.WITH_PAYLOAD:
                if problem is None:
                    payload = np.empty(nelem, DTYPES[code])
                    try:
                        g.irecv(payload, peer, P.TAG_REQUEST).wait(timeout_s=timeout_s)
                    except MessageMismatchError as exc:  # read and dropped: refuse it
                        problem = f"payload: {exc}"
                else:
                    self._discard(g, peer)
            if problem is not None:
                reply, data = self._error(w, op, key, problem, nelem, code)
            else:
                reply, data = self._handle(w, op, key, step, start, nelem, code, extra, payload)
            sends = [g.isend(reply, peer, P.TAG_REPLY)]
            if data is not None:
                sends.append(g.isend(data, peer, P.TAG_REPLY))
            for work in sends:
                work.wait(timeout_s=self.config.timeout_s)
            if op == P.OP_BYE:
                return

    def _malformed(
        self, op: int, key: int, start: int, nelem: int, code: int, extra: int
    ) -> str | None:
        """What is wrong with a request header before anything is allocated for it
        (None: nothing; the shard's own checks follow in :meth:`_handle`)."""
        if op not in P.OP_NAMES:
            return f"unknown op {op}"
        if op not in P.WITH_PAYLOAD and op not in P.REPLY_WITH_DATA:
            return None
        if not 0 <= code < len(DTYPES):
            return f"unknown dtype code {code} (known: 0..{len(DTYPES) - 1})"
        if start < 0 or nelem < 0:
            return f"negative range [{start}:{start + nelem}]"
        if op == P.OP_INIT:
            if not start + nelem <= extra:
                return f"range [{start}:{start + nelem}] is outside the key's {extra} elements"
            if nelem * DTYPES[code].itemsize > self.config.max_shard_bytes:
                return (
                    f"{nelem} {DTYPES[code]} elements exceed max_shard_bytes "
                    f"({self.config.max_shard_bytes})"
                )
            return None
        with self.cond:
            sh = self.state.shard(key, start)
        if sh is None:
            return f"[{start}:{start + nelem}]: no such key (call init first)"
        if sh.nelem != nelem or sh.dtype != DTYPES[code]:
            return f"[{start}:{start + nelem}]: layout differs from {sh.describe()}"
        return None

    def _discard(self, g: Any, peer: int) -> None:
        """Read a refused request's payload and drop it (the next message is a header)."""
        try:
            g.irecv(np.empty(0, np.uint8), peer, P.TAG_REQUEST).wait(
                timeout_s=self.config.timeout_s
            )
        except MessageMismatchError:
            pass  # any payload but an empty one: read and dropped, as wanted

    # -- one request -------------------------------------------------------------------
    def _handle(
        self,
        w: int,
        op: int,
        key: int,
        step: int,
        start: int,
        nelem: int,
        code: int,
        extra: int,
        payload: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        st = self.state
        zero = np.zeros(P.REPLY_WORDS, np.int64)
        if op == P.OP_HELLO:
            with self.cond:
                st.hello(w, step)
                if st.needs_resync:
                    self.cond.notify_all()
                    self.cond.wait_for(
                        lambda: st.resync_ready() or not st.needs_resync or self._interrupted,
                        timeout=self.config.timeout_s,
                    )
                    self._check_interrupted(w, op)
                    if st.needs_resync:
                        if not st.resync_ready():
                            raise CommTimeoutError(
                                f"ps server {self.index}: op hello: only workers "
                                f"{sorted(st.hello_clocks)} reconnected within {self.config.timeout_s:g} s"
                            )
                        st.resync()
                        self.cond.notify_all()
                zero[3] = st.progress()
            return zero, None
        if op == P.OP_STATS:
            with self.cond:
                blob = np.frombuffer(json.dumps(st.stats()).encode(), np.uint8)
            zero[3] = blob.size
            return zero, blob
        if op == P.OP_BYE:
            with self.cond:
                self.byes.add(w)
            return zero, None
        if op == P.OP_INIT:
            assert payload is not None
            with self.cond:
                try:
                    st.init_shard(
                        key, start, start + nelem, extra, DTYPES[code], payload, clock=step
                    )
                except ValueError as exc:
                    return self._error(w, op, key, str(exc), nelem, code)
            return zero, None
        if op not in (P.OP_PUSH, P.OP_PULL, P.OP_PUSH_PULL):
            raise RingcommError(f"ps server {self.index}: worker {w} sent unknown op {op}")
        with self.cond:
            sh = st.shard(key, start)
            if sh is None or sh.nelem != nelem or (code < len(DTYPES) and sh.dtype != DTYPES[code]):
                what = (
                    "no such key (call init first)"
                    if sh is None
                    else f"layout differs from {sh.describe()}"
                )
                return self._error(w, op, key, f"[{start}:{start + nelem}]: {what}", nelem, code)
            status = STATUS_OK
            if payload is not None:
                status = st.push(w, sh, step, payload)
                self.cond.notify_all()
                if st.checkpoint_due():
                    self._checkpoint()
            if op == P.OP_PUSH:
                zero[0], zero[1] = status, sh.version
                return zero, None
            reader = extra
            if not st.pull_ready(sh, reader):
                t0 = time.monotonic()
                self.cond.wait_for(
                    lambda: st.pull_ready(sh, reader) or self._interrupted,
                    timeout=self.config.timeout_s,
                )
                self._check_interrupted(w, op)
                if not st.pull_ready(sh, reader):
                    return self._error(
                        w,
                        op,
                        key,
                        f"pull at clock {reader} not servable after {time.monotonic() - t0:.1f} s "
                        f"(slowest worker at {int(sh.clocks.min())}, version {sh.version})",
                        nelem,
                        code,
                    )
            data, pull_status, gap = st.pull(
                sh, reader, copy=self.config.consistency != "bsp", worker=w
            )
            reply = np.array([max(status, pull_status), sh.version, gap, 0], np.int64)
        return reply, data

    def _error(
        self, w: int, op: int, key: int, text: str, nelem: int, code: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        msg = f"ps server {self.index}: worker {w}, op {P.OP_NAMES.get(op, op)}, key {key}: {text}"
        log.warning("%s", msg)
        reply = np.array([P.STATUS_ERROR, 0, 0, 0], np.int64)
        data = None
        if op in P.REPLY_WITH_DATA:  # the worker posted a receive for the data: fill it
            ok = 0 <= code < len(DTYPES) and nelem >= 0
            if ok and nelem * DTYPES[code].itemsize <= self.config.max_shard_bytes:
                data = np.zeros(nelem, DTYPES[code])
            else:  # no such buffer to fill: an empty message fails the worker's receive
                data = np.zeros(0, np.uint8)
        self.last_error = msg
        return reply, data

    # -- checkpoints -------------------------------------------------------------------
    def _checkpoint(self) -> None:
        """Write the state (caller holds the lock: a consistent snapshot)."""
        if self.config.checkpoint_dir:
            save_checkpoint(self.state, self.config.checkpoint_dir)

    def checkpoint(self) -> None:
        with self.cond:
            self._checkpoint()

    def close(self) -> None:
        """Flush: write a final checkpoint (if checkpointing). Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self.cond:
            if self.config.checkpoint_dir and self.state.shards:
                self._checkpoint()
            self.cond.notify_all()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
