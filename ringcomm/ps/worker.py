"""The worker side: a key-value client with push/pull handles (ps-lite's KVWorker).

``init``, ``push``, ``pull`` and ``push_pull`` return a :class:`Handle` at once;
``handle.wait()`` blocks until every server holding a piece of the key answered. A key's
pieces (:mod:`ringcomm.ps.slicer`) go to their servers in parallel. ``advance()`` ends a
step: ``push`` sends the current step's gradient, ``pull`` reads for it, ``push_pull`` reads
for the next one. :attr:`KVWorker.pull_gaps` keeps the latest pulls' gaps.

Invariants: buffers are used in place, zero-copy (do not modify ``grad`` or read ``out``
before ``wait()``); a client is used by one thread; after a server restart
(:mod:`ringcomm.ps.membership`) unanswered requests are sent again after a ``hello`` with
this worker's clock, so no push is counted twice. Details: docs/architecture.md, section
"ps/worker.py".
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from ringcomm.errors import GroupClosedError, PeerFailedError, RingcommError
from ringcomm.ps import protocol as P
from ringcomm.ps.slicer import HashSlicer, Piece, Slicer, check_key
from ringcomm.ps.state import DTYPES, STATUS_LOST

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Handle", "KVWorker", "PSRequestError"]


#: What a group that ended says (closed for a new epoch, or a member died): reconnect.
_GROUP_ENDED = (GroupClosedError, PeerFailedError)


class PSRequestError(RingcommError):
    """A server refused a request (unknown key, layout mismatch, pull timed out)."""


class Connector(Protocol):
    def reconnect(self, failed_group: Any) -> tuple[Any, Sequence[int]]:
        """A new group (and the servers' ranks in it) after ``failed_group`` broke."""

    def close(self) -> None:
        """Leave the job (the client is done with it)."""


class _KeyInfo(NamedTuple):
    nelem: int
    dtype: np.dtype
    code: int
    pieces: list[Piece]


class _Part:
    """One request to one server: what to send, where the reply goes, its Work handles."""

    __slots__ = ("data", "data_out", "done", "op", "payload", "rep", "request", "server", "works")

    def __init__(
        self,
        server: int,
        request: np.ndarray,
        payload: np.ndarray | None,
        data_out: np.ndarray | None,
    ) -> None:
        self.server = server
        self.request = request
        self.op = int(request[0])
        self.payload = payload
        self.data_out = data_out
        self.rep = np.zeros(P.REPLY_WORDS, np.int64)
        self.works: list[Any] = []
        self.done = False
        self.data: bytes | None = None

    def finished_ok(self) -> bool:
        return bool(self.works) and all(w.done() and w.exception() is None for w in self.works)


class Handle:
    """The completion of one call (ps-lite's timestamp). ``wait()`` returns ``None``
    (``pull``/``push_pull``: ``out`` holds the values)."""

    def __init__(self, client: KVWorker, parts: list[_Part], what: str) -> None:
        self._client = client
        self._parts = parts
        self._what = what

    def wait(self, timeout_s: float | None = None) -> None:
        self._client._wait_parts(self._parts, self._what, timeout_s)

    def done(self) -> bool:
        return all(p.done or p.finished_ok() for p in self._parts)

    def __repr__(self) -> str:
        return f"<ps Handle {self._what}: {'done' if self.done() else 'pending'}>"


class KVWorker:
    """Worker ``index`` of a parameter-server job, talking to ``server_ranks`` of ``group``.

    Made by :func:`ringcomm.ps.start` (servers inside the job) or
    :func:`ringcomm.ps.membership.connect_worker` (standalone servers).
    """

    def __init__(
        self,
        group: Any,
        index: int,
        server_ranks: Sequence[int],
        *,
        slicer: Slicer | None = None,
        timeout_s: float | None = None,
        connector: Connector | None = None,
    ) -> None:
        self.group = group
        self.index = index
        self.server_ranks = list(server_ranks)
        self.slicer: Slicer = slicer or HashSlicer()
        self.timeout_s = timeout_s if timeout_s is not None else group.timeout_s
        self.connector = connector
        self.clock = 0
        self.pull_gaps: collections.deque[int] = collections.deque(maxlen=1 << 16)
        self.max_pull_gap = 0
        self.lost_pulls = 0
        self.reconnects = 0
        self._keys: dict[int, _KeyInfo] = {}
        self._outstanding: collections.deque[_Part] = collections.deque()
        self._seq = 0
        self._closed = False
        self._hello()

    @property
    def num_servers(self) -> int:
        return len(self.server_ranks)

    # -- the API -----------------------------------------------------------------------
    def init(self, key: int, array: np.ndarray) -> Handle:
        """Register ``key`` with initial value ``array`` (every worker calls it; the first
        init a server receives wins). Fixes the key's length and dtype."""
        check_key(key)
        flat = self._flat(array, "init", key, writeable=False)
        code = self._dtype_code(flat.dtype, key)
        pieces = self.slicer.slice(key, flat.size, flat.itemsize, self.num_servers)
        info = _KeyInfo(flat.size, flat.dtype, code, pieces)
        old = self._keys.get(key)
        if old is not None and (old.nelem, old.dtype) != (info.nelem, info.dtype):
            raise ValueError(
                f"ps worker {self.index}: init of key {key}: {flat.dtype}[{flat.size}] "
                f"differs from its earlier init {old.dtype}[{old.nelem}]"
            )
        self._keys[key] = info
        parts = [
            self._issue(
                pc.server,
                P.request(P.OP_INIT, key, self.clock, pc.start, pc.nelem, code, flat.size),
                flat[pc.start : pc.stop],
                None,
            )
            for pc in pieces
        ]
        return Handle(self, parts, f"init key {key}")

    def push(self, key: int, grad: np.ndarray) -> Handle:
        """Send ``grad`` as this worker's gradient of the current step."""
        info, flat = self._checked(key, grad, "push", writeable=False)
        parts = [
            self._issue(
                pc.server,
                P.request(P.OP_PUSH, key, self.clock, pc.start, pc.nelem, info.code),
                flat[pc.start : pc.stop],
                None,
            )
            for pc in info.pieces
        ]
        return Handle(self, parts, f"push key {key} step {self.clock}")

    def pull(self, key: int, out: np.ndarray) -> Handle:
        """Read the key for the current step into ``out`` (server update: parameters;
        worker update: the averaged gradient of the previous step)."""
        info, flat = self._checked(key, out, "pull", writeable=True)
        parts = [
            self._issue(
                pc.server,
                P.request(P.OP_PULL, key, self.clock, pc.start, pc.nelem, info.code, self.clock),
                None,
                flat[pc.start : pc.stop],
            )
            for pc in info.pieces
        ]
        return Handle(self, parts, f"pull key {key} at clock {self.clock}")

    def push_pull(self, key: int, grad: np.ndarray, out: np.ndarray) -> Handle:
        """Push this step's gradient and read the result for the next step into ``out``."""
        info, gflat = self._checked(key, grad, "push_pull", writeable=False)
        _, oflat = self._checked(key, out, "push_pull", writeable=True)
        c = self.clock
        parts = [
            self._issue(
                pc.server,
                P.request(P.OP_PUSH_PULL, key, c, pc.start, pc.nelem, info.code, c + 1),
                gflat[pc.start : pc.stop],
                oflat[pc.start : pc.stop],
            )
            for pc in info.pieces
        ]
        return Handle(self, parts, f"push_pull key {key} step {c}")

    def advance(self) -> int:
        """End the current step; returns the new clock."""
        self.clock += 1
        return self.clock

    def wait_all(self, timeout_s: float | None = None) -> None:
        """Wait for every request issued so far."""
        self._wait_parts(list(self._outstanding), "wait_all", timeout_s)

    def stats(self) -> list[dict[str, Any]]:
        """Each server's statistics (pull gaps, progress, shards' versions)."""
        self.wait_all()
        out = []
        for s in range(self.num_servers):
            part = self._issue(s, P.request(P.OP_STATS), None, None)
            self._wait_parts([part], "stats", None)
            out.append(json.loads(part.data or b"{}"))
        return out

    def close(self) -> None:
        """Wait for outstanding requests, then tell every server this worker is done (and,
        with standalone servers, leave their group)."""
        if self._closed:
            return
        try:
            self.wait_all()
            parts = [
                self._issue(s, P.request(P.OP_BYE, step=self.clock), None, None)
                for s in range(self.num_servers)
            ]
            self._wait_parts(parts, "bye", None)
        finally:
            self._closed = True
            if self.connector is not None:
                self.connector.close()

    def abandon(self) -> None:
        """The group failed (elastic training goes on in a new group, with a new client):
        wait until every request still outstanding has ended, as they all do with a failed
        group, so that none writes into a caller's buffer later. No bye; the client is
        closed."""
        for part in list(self._outstanding):
            for work in part.works:
                try:
                    work.wait(timeout_s=self.timeout_s)
                except RingcommError:
                    pass
        self._outstanding.clear()
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()

    # -- checks ------------------------------------------------------------------------
    def _flat(self, x: Any, op: str, key: int, writeable: bool) -> np.ndarray:
        if not isinstance(x, np.ndarray):
            raise TypeError(
                f"ps worker {self.index}: {op} key {key}: expected a numpy array, got {type(x).__name__}"
            )
        if not x.flags.c_contiguous:
            raise ValueError(
                f"ps worker {self.index}: {op} key {key}: the array must be C-contiguous"
            )
        if writeable and not x.flags.writeable:
            raise ValueError(
                f"ps worker {self.index}: {op} key {key}: the output array is read-only"
            )
        return x.reshape(-1)

    def _dtype_code(self, dtype: np.dtype, key: int) -> int:
        for i, d in enumerate(DTYPES):
            if d == dtype:
                return i
        raise TypeError(
            f"ps worker {self.index}: key {key}: dtype {dtype} is not one of {[str(d) for d in DTYPES]}"
        )

    def _checked(self, key: int, x: Any, op: str, writeable: bool) -> tuple[_KeyInfo, np.ndarray]:
        info = self._keys.get(key)
        if info is None:
            raise KeyError(f"ps worker {self.index}: {op} key {key}: call init(key, array) first")
        flat = self._flat(x, op, key, writeable)
        if flat.size != info.nelem or flat.dtype != info.dtype:
            raise ValueError(
                f"ps worker {self.index}: {op} key {key}: got {flat.dtype}[{flat.size}], "
                f"the key is {info.dtype}[{info.nelem}]"
            )
        return info, flat

    # -- requests ----------------------------------------------------------------------
    def _issue(
        self,
        server: int,
        request: np.ndarray,
        payload: np.ndarray | None,
        data_out: np.ndarray | None,
    ) -> _Part:
        if self._closed:
            raise RingcommError(f"ps worker {self.index}: the client is closed")
        self._seq += 1
        request[7] = self._seq
        part = _Part(server, request, payload, data_out)
        self._outstanding.append(part)
        try:
            self._send(part)
        except _GROUP_ENDED:
            if self.connector is None:
                raise
            self._recover()  # re-sends every outstanding part, this one included
        return part

    def _send(self, part: _Part) -> None:
        g, dst = self.group, self.server_ranks[part.server]
        works = [g.irecv(part.rep, dst, P.TAG_REPLY)]
        if part.data_out is not None:
            works.append(g.irecv(part.data_out, dst, P.TAG_REPLY))
        works.append(g.isend(part.request, dst, P.TAG_REQUEST))
        if part.payload is not None:
            works.append(g.isend(part.payload, dst, P.TAG_REQUEST))
        part.works = works

    def _wait_parts(self, parts: list[_Part], what: str, timeout_s: float | None) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        for part in parts:
            while not part.done:
                try:
                    for work in part.works:
                        work.wait(timeout_s=t)
                    if part.op == P.OP_STATS and part.data is None:
                        blob = np.empty(int(part.rep[3]), np.uint8)
                        self.group.recv(
                            blob, self.server_ranks[part.server], P.TAG_REPLY, timeout_s=t
                        )
                        part.data = blob.tobytes()
                except _GROUP_ENDED:
                    if self.connector is None:
                        raise
                    self._recover()
                    continue
                self._complete(part, what)

    def _complete(self, part: _Part, what: str) -> None:
        part.done = True
        try:
            self._outstanding.remove(part)
        except ValueError:
            pass
        status = int(part.rep[0])
        if status == P.STATUS_ERROR:
            raise PSRequestError(
                f"ps worker {self.index}: {what}: server {part.server} (rank {self.server_ranks[part.server]}) "
                f"refused op {P.OP_NAMES.get(part.op, part.op)} for key {int(part.request[1])}; see its log"
            )
        if part.op in P.REPLY_WITH_DATA:
            gap = int(part.rep[2])
            self.pull_gaps.append(gap)
            self.max_pull_gap = max(self.max_pull_gap, gap)
            if status == STATUS_LOST:
                self.lost_pulls += 1

    # -- reconnecting --------------------------------------------------------------------
    def _hello(self) -> None:
        parts = []
        for s in range(self.num_servers):
            self._seq += 1
            part = _Part(s, P.request(P.OP_HELLO, step=self.clock, seq=self._seq), None, None)
            self._send(part)
            parts.append(part)
        progress = []
        for part in parts:
            for work in part.works:
                work.wait(timeout_s=self.timeout_s)
            progress.append(int(part.rep[3]))
        # A whole job restarted from checkpoints resumes where the servers left off.
        if progress:
            self.clock = max(self.clock, min(progress))

    def _recover(self) -> None:
        """The group broke: get a new one, say hello, re-send what is unanswered."""
        if self.connector is None:
            raise GroupClosedError(f"ps worker {self.index}: the parameter-server group was closed")
        while True:
            group, servers = self.connector.reconnect(self.group)
            self.group, self.server_ranks = group, list(servers)
            self.reconnects += 1
            try:
                self._hello()
                for part in list(self._outstanding):
                    if part.finished_ok() and part.op != P.OP_STATS:
                        self._complete(part, "reconnect")
                    else:
                        self._send(part)
                return
            except _GROUP_ENDED:
                continue  # it broke again while we re-sent: once more
