"""The flight recorder: the last operations of this process, and the report built from them.

Every rank keeps its last ``RINGCOMM_TRACE_ENTRIES`` operations (default
:data:`DEFAULT_ENTRIES`; 0 turns the recorder off) in a ring buffer
(:class:`FlightRecorder`): per operation its group, sequence number, op, dtype and shape,
bytes, algorithm, peers, start and end time (wall clock, so ranks' records line up), and
its state (``running``, ``done``, or ``failed: <the error>`` — for a timeout the error says
where it waited and for whom). It also keeps, per op and size bucket, the count, bytes and
times of every operation (:meth:`FlightRecorder.summary`, DeepSpeed's comms logger's table).

The record is written, one JSON file per rank (``rank<global rank>.json``), to
``RINGCOMM_TRACE_DIR`` when a call of this rank times out or finds a peer failed, on
``SIGUSR1``, when the process ends without ``close()``, and at ``close()`` when
``RINGCOMM_TRACE=1``. :func:`load_dir` reads a directory of them, :func:`desync_report`
says which rank is behind and where every rank waits, :func:`chrome_trace` turns them
into a Chrome/Perfetto trace (one track per rank, one slice per op).
``ringcomm trace DIR [--chrome FILE]`` is the command line of the last two.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_ENTRIES",
    "DONE",
    "E_END",
    "E_STATE",
    "FOLD_BATCH",
    "FOLD_MASK",
    "RUNNING",
    "Entry",
    "FlightRecorder",
    "bus_factor",
    "chrome_trace",
    "desync_report",
    "entry_bytes",
    "entry_dict",
    "entry_state",
    "load_dir",
    "now",
    "size_bucket",
    "summary_table",
    "wall_offset_s",
]

#: Operations each rank remembers by default.
DEFAULT_ENTRIES = 4096
#: Operations the summary's counters take in at a time (a power of two: an inline caller
#: folds when ``seq & FOLD_MASK == 0``).
FOLD_BATCH = 256
FOLD_MASK = FOLD_BATCH - 1
#: The version of the trace file's layout.
FILE_VERSION = 1

#: The clock of start and end times in entries: ``time.monotonic`` (what a call's deadline
#: counts from, so a recorded call reads the clock as often as an unrecorded one); the
#: files hold wall-clock times (:func:`wall_offset_s` added when written), so ranks'
#: records line up.
now = time.monotonic


def wall_offset_s() -> float:
    """Wall clock minus :func:`now`, now (taken per dump: the newest entries, those a
    desync report reads, line up best)."""
    return time.time() - time.monotonic()


RUNNING = "running"
DONE = "done"


# An entry is a list (the cheapest record to build and update from Python: the recorder
# runs on every call, and a slotted object cost ~2 µs more per call in situ); its fields:
(
    E_GROUP,
    E_SEQ,
    E_OP,
    E_DTYPE,
    E_SHAPE,
    E_BYTES,
    E_ALGO,
    E_PEERS,
    E_START,
    E_END,
    E_STATE,
) = range(11)
#: One operation as the recorder keeps it (fields at the ``E_*`` indices).
Entry = list[Any]


def entry_bytes(e: Entry) -> int:
    """An entry's bytes: as recorded, or (recorded as None) its dtype's itemsize times
    its shape's element count (0 without either)."""
    nbytes = e[E_BYTES]
    if nbytes is not None:
        return int(nbytes)
    dtype, shape = e[E_DTYPE], e[E_SHAPE]
    if dtype is None or shape is None:
        return 0
    count = 1
    for d in shape:
        count *= int(d)
    return count * int(getattr(dtype, "itemsize", 0))


def entry_dict(e: Entry, offset_s: float | None = None) -> dict[str, Any]:
    """An entry as the trace file's JSON object, its times on the wall clock (``offset_s``:
    :func:`wall_offset_s`, taken now if None)."""
    if offset_s is None:
        offset_s = wall_offset_s()
    dtype, shape = e[E_DTYPE], e[E_SHAPE]
    return {
        "group": e[E_GROUP],
        "seq": e[E_SEQ],
        "op": e[E_OP],
        "dtype": None if dtype is None else getattr(dtype, "name", str(dtype)),
        "shape": None if shape is None else list(shape),
        "bytes": entry_bytes(e),
        "algo": e[E_ALGO],
        "peers": list(e[E_PEERS]),
        "start_s": e[E_START] + offset_s,
        "end_s": None if e[E_END] is None else e[E_END] + offset_s,
        "state": entry_state(e),
    }


def entry_state(e: Entry) -> str:
    """``running``, ``done`` (ended with its state left ``running``: the hot path only
    stores the end time), or ``failed: <the error>``."""
    state: str = e[E_STATE]
    return DONE if state is RUNNING and e[E_END] is not None else state


def size_bucket(nbytes: int) -> int:
    """The summary's size bucket of ``nbytes``: the next power of two (0 for 0)."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` over ``n`` ranks (docs/contracts.md, JSON output)."""
    if n <= 1:
        return 0.0 if op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all") else 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0


class FlightRecorder:
    """The ring buffer of this process's last ``capacity`` operations (0: records
    nothing), the per-op summary, and where the record goes (``trace_dir``).

    The hot path is one list, one append, one clock read and one store per call (the
    start time is the clock read the call makes for its deadline). An operation is
    pushed (``push(entry)``, an append to :attr:`pending`, the newest entries) as it
    starts, and ended by storing its end time (``entry[E_END] = now()``: its state stays
    ``running`` and reads as ``done``; a failed one gets ``failed: ...`` in
    ``entry[E_STATE]``, :meth:`end`). Every so often :meth:`fold` moves the ended pending
    entries into the ring (:attr:`entries`, the older ones, at most ``capacity``) and adds
    them to the summary's counters, in one loop: inline callers (every blocking
    collective, ``ringcomm.collectives.api``) fold when their group's sequence number is a
    multiple of :data:`FOLD_BATCH` (``seq & FOLD_MASK == 0``: no counter to keep), the
    others (:meth:`done`) when :data:`FOLD_BATCH` entries are pending, and every reader
    before it reads. Between folds each group adds fewer than :data:`FOLD_BATCH` entries.
    """

    def __init__(
        self, capacity: int, rank: int, trace_dir: str | None = None, at_close: bool = False
    ) -> None:
        self.capacity = max(0, int(capacity))
        self.enabled = self.capacity > 0
        self.rank = rank
        self.trace_dir = trace_dir
        self.at_close = at_close
        self.entries: deque[Entry] = deque(maxlen=self.capacity or 1)  # folded, oldest first
        self.pending: list[Entry] = []  # pushed since the last fold (running or ended)
        self._stats: dict[tuple[str, int], list[Any]] = {}  # (op, size bucket) -> stat
        self._lock = threading.Lock()  # dumps (a signal, a worker thread) against each other
        self._fold_lock = threading.Lock()  # folds (a done callback's thread) likewise
        self.dumps = 0
        #: The hot path, bound once (see the class docstring).
        self.push = self.pending.append
        #: :meth:`done` folds once this many entries are pending (FOLD_BATCH more than
        #: the running ones the last fold left: many outstanding receives do not make
        #: every done() fold).
        self.fold_at = FOLD_BATCH

    # -- the hot path ----------------------------------------------------------------
    def start(
        self,
        group: int,
        seq: int,
        op: str,
        dtype: Any,
        shape: tuple[int, ...] | None,
        nbytes: int | None,
        algo: str | None,
        peers: Sequence[int],
    ) -> Entry | None:
        """Record an operation starting now; None when the recorder is off. ``nbytes``
        None: ``dtype.itemsize`` times the elements of ``shape`` (:func:`entry_bytes`)."""
        if not self.enabled:
            return None
        entry = [group, seq, op, dtype, shape, nbytes, algo, peers, now(), None, RUNNING]
        self.push(entry)
        return entry

    def done(self, entry: Entry) -> None:
        """The operation of ``entry`` (not None) ended well: :meth:`end`'s fast path."""
        entry[E_END] = now()
        if len(self.pending) >= self.fold_at:
            self.fold()

    def end(self, entry: Entry | None, error: BaseException | None = None) -> None:
        """The operation of ``entry`` ended (with ``error`` if it failed)."""
        if entry is None:
            return
        if error is None:
            self.done(entry)
            return
        entry[E_STATE] = f"failed: {type(error).__name__}: {error}"
        entry[E_END] = now()

    def fold(self) -> None:
        """Move the ended pending entries into the ring and add the well-ended ones to the
        summary's counters (one loop for a batch: less than a dictionary update on every
        call); running ones stay pending."""
        with self._fold_lock:
            pending = self.pending
            n = len(pending)
            batch = pending[:n]
            del pending[:n]  # (the same list: push stays bound to it; later pushes kept)
            self._fold(batch)
            self.fold_at = len(pending) + FOLD_BATCH

    def _fold(self, batch: list[Entry]) -> None:
        # Per run of calls of one op and size (the common case: one counter update a run,
        # locals per entry; measured 2x faster than updating the counters per entry).
        running: list[Entry] = []
        op, nbytes, world, count, total = None, 0, 0, 0, 0.0
        for e in batch:
            end = e[E_END]
            if end is None:  # still running (asynchronous): folded once it ends
                running.append(e)
                continue
            if e[E_STATE] is not RUNNING:  # failed: in the ring, not in the summary
                continue
            nb = e[E_BYTES]
            if nb is None:
                nb = e[E_BYTES] = entry_bytes(e)
            if e[E_OP] is not op or nb != nbytes:
                if count:
                    self._count(op, nbytes, world, count, total)  # type: ignore[arg-type]
                op, nbytes, world, count, total = e[E_OP], nb, len(e[E_PEERS]), 0, 0.0
            count += 1
            total += end - e[E_START]
        if count:
            self._count(op, nbytes, world, count, total)  # type: ignore[arg-type]
        if running:
            self.pending.extend(running)
            self.entries.extend(e for e in batch if e[E_END] is not None)
        else:
            self.entries.extend(batch)

    def _count(self, op: str, nbytes: int, world: int, count: int, total_s: float) -> None:
        """Add ``count`` calls of ``op`` of ``nbytes`` each, ``total_s`` in all."""
        key = (op, size_bucket(nbytes))
        stat = self._stats.get(key)
        if stat is None:  # count, bytes, total seconds, world size
            stat = self._stats[key] = [0, 0, 0.0, world]
        stat[0] += count
        stat[1] += count * nbytes
        stat[2] += total_s

    def newest(self) -> list[Entry]:
        """The last ``capacity`` entries (folded or not), oldest first (by start time)."""
        both = sorted([*self.entries, *self.pending], key=lambda e: e[E_START])
        return both[-self.capacity :] if self.capacity else []

    # -- reading -----------------------------------------------------------------------
    def records(self) -> list[dict[str, Any]]:
        """The entries, oldest first, as JSON-ready dicts."""
        offset = wall_offset_s()
        return [entry_dict(e, offset) for e in self.newest()]

    def summary(self) -> list[dict[str, Any]]:
        """Per op and size bucket (sorted): ``op``, ``bucket_bytes``, ``count``, ``bytes``,
        ``total_s``, ``median_s`` (of those still in the ring: the newest operations; the
        mean where none is), ``busbw_GBps`` (nccl-tests' bus bandwidth of the mean bytes
        at the median time)."""
        self.fold()
        recent: dict[tuple[str, int], list[float]] = {}
        for e in list(self.entries):
            if entry_state(e) == DONE:
                recent.setdefault((e[E_OP], size_bucket(entry_bytes(e))), []).append(
                    e[E_END] - e[E_START]
                )
        rows = []
        for (op, bucket), (count, nbytes, total_s, world) in sorted(self._stats.items()):
            took = recent.get((op, bucket))
            median = statistics.median(took) if took else (total_s / count if count else 0.0)
            mean_bytes = nbytes / count if count else 0.0
            busbw = mean_bytes / median * bus_factor(op, world) / 1e9 if median > 0 else 0.0
            rows.append(
                {
                    "op": op,
                    "bucket_bytes": bucket,
                    "count": count,
                    "bytes": nbytes,
                    "total_s": total_s,
                    "median_s": median,
                    "busbw_GBps": busbw,
                }
            )
        return rows

    # -- writing -----------------------------------------------------------------------
    def dump(self, reason: str, context: dict[str, Any] | None = None) -> Path | None:
        """Write the record to ``trace_dir``/rank<rank>.json (atomically: a reader never
        sees half a file); None when there is no trace directory or the write failed."""
        if not self.trace_dir or not self.enabled:
            return None
        with self._lock:
            self.dumps += 1
            body = {
                "version": FILE_VERSION,
                "rank": self.rank,
                "pid": os.getpid(),
                "host": os.uname().nodename,
                "reason": reason,
                "dumped_s": time.time(),
                "capacity": self.capacity,
                **(context or {}),
                "entries": self.records(),
            }
            try:
                folder = Path(self.trace_dir)
                folder.mkdir(parents=True, exist_ok=True)
                path = folder / f"rank{self.rank}.json"
                tmp = folder / f".rank{self.rank}.json.{os.getpid()}.tmp"
                tmp.write_text(json.dumps(body, default=str))
                os.replace(tmp, path)
            except OSError:
                return None
            return path


# -- reading a directory of records ------------------------------------------------------
def load_dir(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank's trace file in ``folder`` (``rank*.json``), by rank."""
    files = []
    for path in sorted(Path(folder).glob("rank*.json")):
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a ringcomm trace file: {exc}") from None
        if not isinstance(body, dict) or "entries" not in body or "rank" not in body:
            raise ValueError(f"{path}: not a ringcomm trace file (no rank or entries)")
        files.append(body)
    return sorted(files, key=lambda b: int(b["rank"]))


def _what(e: dict[str, Any]) -> str:
    shape = e.get("shape")
    if e.get("dtype") is None or shape is None:
        return f"{e['op']}()"
    count = 1
    for d in shape:
        count *= int(d)
    return f"{e['op']}({e['dtype']}[{count}])"


def _ranks(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


_WAITING_FOR = re.compile(r"waiting for ranks? (\d+(?:, \d+)*)")
_LAST_CALL = re.compile(r"rank (\d+)'s last call here: ([^;\n]*)")
#: How much later than the first a rank must enter a collective to be named late.
LATE_S = 1.0


def desync_report(files: Sequence[dict[str, Any]], world_size: int | None = None) -> str:
    """Which rank is behind or missing, and where every rank was (a text report).

    The first line is the answer (:func:`_verdict`): the rank that is behind and the
    operation the others wait in ("rank 1 is behind: ranks 0, 2 waited 3.0 s for it in op
    #6 all_reduce(float64[10]); rank 1 entered op #6 8.0 s late"), also when the late rank
    arrived after the others gave up, or left no file; else a mismatch, or "no rank is
    behind". Then, per group seen: every rank's latest operation there (its sequence
    number, what, state, when entered relative to the newest dump). ``world_size``: ranks
    expected (missing files are reported); default: the world size the files record,
    else the highest rank seen + 1.
    """
    if not files:
        return "no trace files"
    now = max(float(f.get("dumped_s", 0.0)) for f in files)
    seen = {int(f["rank"]) for f in files}
    recorded = [int(f["world_size"]) for f in files if isinstance(f.get("world_size"), int)]
    n = world_size or max(recorded, default=0) or max(seen) + 1
    lines = [f"trace files of {_ranks(seen)} (newest dump at {time.ctime(now)})"]
    missing = sorted(set(range(n)) - seen)
    if missing:
        lines.append(
            f"no trace file from {_ranks(missing)} (it did not time out, see a "
            "failure, get SIGUSR1 or end without close())"
        )
    for f in files:
        lines.append(f"rank {f['rank']}: dumped because {f.get('reason', '?')}")
    # group -> rank -> latest entry (by sequence number)
    latest: dict[int, dict[int, dict[str, Any]]] = {}
    for f in files:
        for e in f["entries"]:
            if e.get("algo") == "p2p":  # (numbered by tag, not in the collectives' order)
                continue
            g = int(e["group"])
            last = latest.setdefault(g, {}).get(int(f["rank"]))
            if last is None or int(e["seq"]) >= int(last["seq"]):
                latest[g][int(f["rank"])] = e
    verdicts: list[tuple[int, str]] = []
    for g in sorted(latest):
        by_rank = latest[g]
        where = "the world group" if g == 0 else f"group {g}"
        lines.append(f"{where}:")
        for r in sorted(by_rank):
            e = by_rank[r]
            ago = now - float(e["start_s"])
            state = e["state"]
            state = str(state).replace("\n", "\n      ")  # a progress map, indented
            lines.append(
                f"  rank {r}: op #{e['seq']} {_what(e)} via {e.get('algo')}, entered "
                f"{ago:.1f} s ago, {state}"
            )
        top = max(int(e["seq"]) for e in by_rank.values())
        ahead = {r for r, e in by_rank.items() if int(e["seq"]) == top}
        behind = {r for r in by_rank if r not in ahead}
        waiting = [r for r in ahead if by_rank[r]["state"] != DONE]
        for r in sorted(behind):
            e = by_rank[r]
            ago = now - float(e["start_s"])
            text = f"  rank {r} is at op #{e['seq']} {_what(e)}, entered {ago:.1f} s ago"
            if e["state"] == DONE:
                text += " (finished; it has not entered the next collective)"
            if waiting:
                w = by_rank[waiting[0]]
                text += f"; {_ranks(waiting)} wait in op #{top} {_what(w)} for rank {r}"
            lines.append(text)
        # Same sequence number, different calls: a mismatch.
        calls = {(by_rank[r]["op"], by_rank[r]["dtype"], str(by_rank[r]["shape"])) for r in ahead}
        if len(calls) > 1:
            parts = [f"rank {r}: {_what(by_rank[r])}" for r in sorted(ahead)]
            lines.append(f"  mismatch at op #{top}: " + "; ".join(parts))
        found = _verdict(by_rank, missing if g == 0 else [], now, where)
        if found is not None:
            verdicts.append(found)
    if verdicts:
        answer = min(verdicts, key=lambda v: v[0])[1]
    else:
        answer = "no rank is behind: every rank's latest operation is the same" + (
            f"; no trace file from {_ranks(missing)}" if missing else ""
        )
    return "\n".join([answer, *lines])


def _verdict(
    by_rank: dict[int, dict[str, Any]], missing: list[int], now: float, where: str
) -> tuple[int, str] | None:
    """The answer for one group (its rank -> latest entry): ``(priority, line)``, the
    lowest priority first; None when nothing is wrong there. In order: a mismatch; a rank
    at an older operation than the others; a rank that entered the others' operation late
    (after they gave up: its file then shows the same operation); a rank the others waited
    for that left no file (``missing``, named by their errors if they say)."""
    top = max(int(e["seq"]) for e in by_rank.values())
    ahead = sorted(r for r, e in by_rank.items() if int(e["seq"]) == top)
    behind = sorted(r for r in by_rank if r not in ahead)
    waiting = [r for r in ahead if by_rank[r]["state"] != DONE]
    head = by_rank[waiting[0] if waiting else ahead[0]]
    op = f"op #{top} {_what(head)}"
    suffix = "" if where == "the world group" else f" (in {where})"
    calls = {(by_rank[r]["op"], by_rank[r]["dtype"], str(by_rank[r]["shape"])) for r in ahead}
    if len(calls) > 1:
        parts = "; ".join(f"rank {r}: {_what(by_rank[r])}" for r in ahead)
        return 0, f"mismatch at op #{top}{suffix}: the ranks called different collectives: {parts}"
    if behind:
        one = len(behind) == 1
        waits = (
            f"{_ranks(waiting)} {'wait' if _live(by_rank, waiting) else 'waited'} "
            f"{_waited(by_rank, waiting, now):.1f} s for {'it' if one else 'them'} in {op}"
            if waiting
            else f"{_ranks(ahead)} finished {op}"
        )
        where_at = []
        for r in behind:
            e = by_rank[r]
            done = (
                " (finished; it has not entered the next collective)" if e["state"] == DONE else ""
            )
            where_at.append(f"rank {r} is at op #{e['seq']} {_what(e)}{done}")
        return 1, (
            f"{_ranks(behind)} {'is' if one else 'are'} behind{suffix}: {waits}; "
            + "; ".join(where_at)
        )
    first = min(float(by_rank[r]["start_s"]) for r in ahead)
    late = [r for r in ahead if float(by_rank[r]["start_s"]) - first > LATE_S]
    gave_up = [r for r in ahead if r not in late and str(by_rank[r]["state"]).startswith("failed")]
    if late and gave_up:
        r = max(late, key=lambda x: float(by_rank[x]["start_s"]))
        late_s = float(by_rank[r]["start_s"]) - first
        return 2, (
            f"rank {r} is behind{suffix}: {_ranks(gave_up)} waited "
            f"{_waited(by_rank, gave_up, now):.1f} s for it in {op}; rank {r} entered "
            f"op #{top} {late_s:.1f} s late"
        )
    named: set[int] = set()
    last_calls: dict[int, str] = {}
    for r in waiting:
        state = str(by_rank[r]["state"])
        for m in _WAITING_FOR.finditer(state):
            named |= {int(v) for v in m.group(1).split(", ")}
        for m in _LAST_CALL.finditer(state):
            last_calls.setdefault(int(m.group(1)), m.group(2).strip())
    culprits = sorted(named & set(missing)) or (sorted(missing) if waiting else [])
    if culprits:
        r = culprits[0]
        seen_last = f"; its last call there: {last_calls[r]}" if r in last_calls else ""
        return 3, (
            f"{_ranks(culprits)} {'is' if len(culprits) == 1 else 'are'} behind{suffix} "
            f"(no trace file from it): {_ranks(waiting)} waited "
            f"{_waited(by_rank, waiting, now):.1f} s for it in {op}{seen_last}"
        )
    if named - set(ahead):
        return 4, (
            f"{_ranks(waiting)} waited {_waited(by_rank, waiting, now):.1f} s in {op}"
            f"{suffix} for {_ranks(named - set(ahead))}"
        )
    return None


def _live(by_rank: dict[int, dict[str, Any]], ranks: Sequence[int]) -> bool:
    """Whether any of ``ranks`` is still in its latest operation (not failed)."""
    return any(by_rank[r]["state"] == RUNNING for r in ranks)


def _waited(by_rank: dict[int, dict[str, Any]], ranks: Sequence[int], now: float) -> float:
    """The longest ``ranks`` spent in their latest operation (until it ended, or ``now``)."""
    spans = [
        float(by_rank[r]["end_s"] if by_rank[r]["end_s"] is not None else now)
        - float(by_rank[r]["start_s"])
        for r in ranks
    ]
    return max(spans, default=0.0)


def chrome_trace(files: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A Chrome/Perfetto trace (JSON object format) of the records: one process track per
    rank, one complete slice per operation (a running one ends at its rank's dump)."""
    events: list[dict[str, Any]] = []
    origin = min((float(e["start_s"]) for f in files for e in f["entries"]), default=0.0)
    for f in files:
        rank = int(f["rank"])
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            }
        )
        events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
        for e in f["entries"]:
            start = float(e["start_s"])
            end = e["end_s"] if e["end_s"] is not None else f.get("dumped_s", start)
            events.append(
                {
                    "name": e["op"],
                    "cat": "ringcomm",
                    "ph": "X",
                    "pid": rank,
                    "tid": 0,
                    "ts": (start - origin) * 1e6,
                    "dur": max(0.0, (float(end) - start) * 1e6),
                    "args": {
                        "seq": e["seq"],
                        "group": e["group"],
                        "bytes": e["bytes"],
                        "dtype": e["dtype"],
                        "shape": e["shape"],
                        "algo": e["algo"],
                        "state": e["state"],
                    },
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """:meth:`FlightRecorder.summary` rows as a fixed-width table."""
    head = f"{'op':<16}{'bucket':>10}{'count':>9}{'bytes':>14}{'total s':>10}{'median us':>11}{'busbw GB/s':>12}"
    out = [head]
    for r in rows:
        out.append(
            f"{r['op']:<16}{_size(int(r['bucket_bytes'])):>10}{r['count']:>9}"
            f"{r['bytes']:>14}{r['total_s']:>10.3f}{r['median_s'] * 1e6:>11.1f}"
            f"{r['busbw_GBps']:>12.2f}"
        )
    return "\n".join(out)


def _size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n >> shift}{unit}"
    return str(n)
