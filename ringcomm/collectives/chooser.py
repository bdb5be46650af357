"""Where a call's algorithm is chosen: one :class:`Plan` per call.

:func:`plan` answers for a call of a group: its algorithm (the ``algo=`` keyword, else
``RINGCOMM_ALGO``, else the group's workspace or device windows, else the cost model, else
the measured switch points: :func:`choose_algorithm`), its piece size (the cost model's;
None: the group's) and, on a group spanning hosts with several ranks on one, whether it runs
hierarchically and in what segments. :mod:`ringcomm.collectives.api` checks the arguments
and runs the plan; nothing else chooses.

A cost model (``RINGCOMM_TUNE_FILE``) is asked through the group's :class:`ModelChooser`: it
prices the registry's algorithms at the group's world shape per size bucket, cached, so a
call with a model costs a dictionary lookup. docs/architecture.md ("One collective call")
has the rules in full.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringcomm.collectives.registry import (
    ALGORITHMS,
    HIER_ALGO,
    IPC_ALGO,
    UNEVEN_ALGORITHMS,
    WORKSPACE_ALGO,
    get_algorithm,
)
from ringcomm.tuning.costmodel import ALGORITHMS as MODEL_ALGORITHMS
from ringcomm.tuning.costmodel import HIER_SEGMENT_BYTES, CostModel, predict

if TYPE_CHECKING:
    from ringcomm.core.group_core import GroupCore

__all__ = [
    "ALL_REDUCE_DIRECT_MAX_BYTES",
    "ALL_REDUCE_DIRECT_MAX_WORLD",
    "ALL_REDUCE_RD_MAX_BYTES",
    "ALL_REDUCE_STAR_MAX_BYTES",
    "ALL_REDUCE_STAR_MAX_WORLD",
    "BROADCAST_TREE_MAX_BYTES",
    "CHUNK_CANDIDATES",
    "MODELLED",
    "REGISTRY_NAMES",
    "SEGMENT_CANDIDATES",
    "ModelChoice",
    "ModelChooser",
    "Plan",
    "choose_algorithm",
    "hier_fits",
    "model_chooser",
    "plan",
    "plan_scatter",
    "plan_uneven",
    "plan_without_workspace",
    "size_bucket",
]

#: all_reduce takes recursive doubling up to this many bytes, the ring above. Measured
#: (benchmarks/results/collectives_switch.md, W=2 and W=4, ipc://, 2 shared cores): rd
#: 0.5-0.75x the ring's time up to 512 KiB, even at 1 MiB, 1.2-1.9x from 2 MiB on. (rd
#: moves log2(n) buffers per rank, the ring 2(n-1)/n: at larger n the crossover falls.)
ALL_REDUCE_RD_MAX_BYTES = 512 * 1024
#: all_reduce takes the one-step direct exchange up to this many bytes on at most
#: ALL_REDUCE_DIRECT_MAX_WORLD ranks. Measured (collectives_switch.md, "direct vs rd"):
#: direct/rd 0.67-0.82 at W=3 (rd needs a pre- and post-step there), 0.87-1.0 at W=4,
#: even at W=2 (both are one exchange), 0.94-1.0 at W=5, 1.03-1.18 at W=6 and W=8.
ALL_REDUCE_DIRECT_MAX_BYTES = 32 * 1024
ALL_REDUCE_DIRECT_MAX_WORLD = 4
#: all_reduce takes the star (through rank 0) up to this many bytes on 3 to
#: ALL_REDUCE_STAR_MAX_WORLD ranks, ahead of direct and rd. Measured (2 cores, same-host
#: lane, benchmarks/results/local_lane.md): 8 B star/direct 0.57 at W=3, 0.6 at W=4,
#: 0.5 at W=5 and W=8 (star/rd 0.2-0.3 at W=5 and 8); 1 KiB even to 0.6 at W=4, 0.5 at
#: W=8; 4 KiB (past the fast lane) star 1.1-1.5x direct at W=3. At W=2 direct is one
#: exchange, the star two hops (24 vs 16 us).
ALL_REDUCE_STAR_MAX_BYTES = 1024
ALL_REDUCE_STAR_MAX_WORLD = 8
#: broadcast takes the binomial tree up to this many bytes, the pipelined chain above.
#: Measured alongside (W=4 and W=8): within noise of each other up to 4 MiB on one host,
#: the tree a little ahead at W=8; the chain is kept for large messages, where its
#: one-send-per-rank matters once links (not cores) are the limit.
BROADCAST_TREE_MAX_BYTES = 1024 * 1024

#: The cost model's algorithm names -> the registry's (the model's others, ``ps`` and an
#: all_reduce ``tree``, are not registry algorithms and never chosen).
REGISTRY_NAMES: dict[str, str] = {
    "ring": "ring",
    "rd": "rd",
    "tree": "tree",
    "chain": "chain",
    "hierarchical": HIER_ALGO,
}
#: Collectives the chooser prices, and the factor from the registry's ``nbytes`` of a call
#: (what ``choose_algorithm`` is given: all_gather's is one rank's input) to the model's
#: size (the per-rank buffer as nccl-tests counts it: all_gather's output).
MODELLED: dict[str, bool] = {
    "all_reduce": False,
    "reduce_scatter": False,
    "all_gather": True,  # times world_size
    "broadcast": False,
}
#: Piece sizes the chooser considers (besides the group's own): 256 KiB to 8 MiB.
CHUNK_CANDIDATES: tuple[int, ...] = tuple(256 << 10 << i for i in range(6))
#: Segment sizes of a hierarchical call (bytes of the per-rank buffer) a model with a CPU
#: term considers: 1 MiB to 16 MiB.
SEGMENT_CANDIDATES: tuple[int, ...] = tuple(1 << 20 << i for i in range(5))
#: Most cached answers per chooser (emptied when full: sizes that keep changing).
MAX_CACHED = 4096
_UNKNOWN = object()  # not in the cache yet (None is an answer)
#: A piece size other than the group's is taken only if it is predicted this much faster.
CHUNK_GAIN = 0.02


def size_bucket(nbytes: int) -> int:
    """The size a call of ``nbytes`` is priced at: the least ``round(2 ** (k / 4))`` (k a
    whole number) that is at least ``nbytes``; 0 and 1 as they are. Idempotent."""
    if nbytes <= 1:
        return max(0, nbytes)
    k = math.ceil(4 * math.log2(nbytes))
    while round(math.pow(2, k / 4)) < nbytes:
        k += 1
    while round(math.pow(2, (k - 1) / 4)) >= nbytes:
        k -= 1
    return round(math.pow(2, k / 4))


@dataclass(frozen=True)
class ModelChoice:
    """The cheapest algorithm (the registry's name), the piece size to run it with (None:
    the group's), its predicted time and, for ``hier``, the segment size (None: the
    hierarchy's own, 8 MiB)."""

    algo: str
    chunk_bytes: int | None
    time_s: float
    segment_bytes: int | None = None


class ModelChooser:
    """One group's choices from ``model`` (docs/architecture.md, "One collective call").

    ``registry``: collective -> the algorithm names the registry runs for it.
    ``chunk_bytes``: the group's piece size; ``choose_chunk``: whether the model may pick
    another (False when the user set one).
    """

    def __init__(
        self,
        model: CostModel,
        hosts: int,
        ranks_per_host: int,
        world_size: int,
        registry: Mapping[str, Collection[str]],
        *,
        chunk_bytes: int,
        choose_chunk: bool = True,
    ) -> None:
        if hosts < 1 or ranks_per_host < 1 or world_size < 1:
            raise ValueError(f"a world of {hosts} x {ranks_per_host} ({world_size} ranks)?")
        self.model = model
        self.hosts = hosts
        self.ranks_per_host = ranks_per_host
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.choose_chunk = choose_chunk
        #: Calls of at most this many bytes (the registry's count) run with the group's
        #: piece size whatever the model says: one piece at every size it considers.
        self.one_piece_bytes = min(CHUNK_CANDIDATES[0], chunk_bytes)
        self.candidates: dict[tuple[str, bool], tuple[str, ...]] = {}
        for collective in MODELLED:
            table = registry.get(collective, ())
            for hier in (False, True):
                self.candidates[(collective, hier)] = tuple(
                    m
                    for m in MODEL_ALGORITHMS[collective]
                    if REGISTRY_NAMES.get(m) in table
                    or (hier and REGISTRY_NAMES.get(m) == HIER_ALGO)
                )
        self._answers: dict[tuple[str, int, bool], ModelChoice | None] = {}
        self._priced: dict[tuple[str, int, bool], ModelChoice | None] = {}
        self._segments: dict[tuple[str, int], int | None] = {}
        #: Whether the model chooses hier's segment size (it prices the CPU).
        self.choose_segment = model.cpu is not None

    def choose(self, collective: str, nbytes: int, hier: bool = False) -> ModelChoice | None:
        """The choice for a call of ``nbytes`` (the registry's count, see :data:`MODELLED`);
        ``hier``: the group runs the hierarchical algorithm (the caller takes a ``"hier"``
        answer). None: the model does not price this collective here."""
        key = (collective, nbytes, hier)
        answer = self._answers.get(key, _UNKNOWN)
        if answer is _UNKNOWN:
            if len(self._answers) >= MAX_CACHED:
                self._answers.clear()
            answer = self._answers[key] = self._choose(collective, nbytes, hier)
        return answer  # type: ignore[return-value]

    def hier_segment(self, collective: str, nbytes: int) -> int | None:
        """The segment size of a hierarchical call of ``nbytes`` (the registry's count),
        whatever chose hier: the model's cheapest of :data:`SEGMENT_CANDIDATES`; None (the
        hierarchy's own) when the model does not price the CPU or this collective."""
        per_rank = MODELLED.get(collective)
        if (
            per_rank is None
            or not self.choose_segment
            or "hierarchical" not in MODEL_ALGORITHMS[collective]
        ):
            return None
        key = (collective, nbytes)
        if key not in self._segments:
            if len(self._segments) >= MAX_CACHED:
                self._segments.clear()
            size = size_bucket(nbytes * self.world_size if per_rank else nbytes)
            base = self.model.replace(chunk_bytes=self.chunk_bytes)
            self._segments[key] = self._hier_time(base, collective, size)[1]
        return self._segments[key]

    def _hier_time(self, model: CostModel, collective: str, size: int) -> tuple[float, int | None]:
        """hier's predicted time and segment size (None: :data:`HIER_SEGMENT_BYTES`); a
        segment other than that only if it is predicted :data:`CHUNK_GAIN` faster. (A
        model without a CPU term prices hier as it did before it had one: steps one after
        another, :func:`ringcomm.tuning.costmodel.predict`.)"""
        t = self._time(model, collective, "hierarchical", size)
        best, segment = t, None
        if self.choose_segment:
            for c in SEGMENT_CANDIDATES:
                if c == HIER_SEGMENT_BYTES:
                    continue
                tc = self._time(model, collective, "hierarchical", size, c)
                if tc < best and tc < t * (1 - CHUNK_GAIN):
                    best, segment = tc, c
        return best, segment

    def _choose(self, collective: str, nbytes: int, hier: bool) -> ModelChoice | None:
        per_rank = MODELLED.get(collective)
        if per_rank is None:
            return None
        size = size_bucket(nbytes * self.world_size if per_rank else nbytes)
        key = (collective, size, hier)
        if key not in self._priced:
            if len(self._priced) >= MAX_CACHED:
                self._priced.clear()
            self._priced[key] = self.price(collective, size, hier)
        return self._priced[key]

    def price(self, collective: str, size: int, hier: bool = False) -> ModelChoice | None:
        """The cheapest candidate at the model's ``size`` (not bucketed, not cached)."""
        names = self.candidates.get((collective, hier), ())
        if not names:
            return None
        base = self.model.replace(chunk_bytes=self.chunk_bytes)
        chunks = [c for c in CHUNK_CANDIDATES if c != self.chunk_bytes]
        best: ModelChoice | None = None
        for name in names:
            algo = REGISTRY_NAMES[name]
            if algo == HIER_ALGO:
                t, segment = self._hier_time(base, collective, size)
                choice = ModelChoice(algo, None, t, segment)
                if best is None or choice.time_s < best.time_s:
                    best = choice
                continue
            t = self._time(base, collective, name, size)
            choice = ModelChoice(algo, None, t)
            if self.choose_chunk:  # (hier's pieces are its sub-groups')
                for c in chunks:
                    tc = self._time(base.replace(chunk_bytes=c), collective, name, size)
                    if tc < choice.time_s and tc < t * (1 - CHUNK_GAIN):
                        choice = ModelChoice(algo, c, tc)
            if best is None or choice.time_s < best.time_s:
                best = choice
        return best

    def _time(
        self, model: CostModel, collective: str, name: str, size: int, segment: int | None = None
    ) -> float:
        return predict(
            model, collective, name, self.hosts, self.ranks_per_host, size, segment_bytes=segment
        ).time_s


def choose_algorithm(
    collective: str,
    requested: str | None,
    env_algo: str | None,
    nbytes: int,
    world_size: int = 2,
    *,
    local: bool = False,
    model: ModelChooser | None = None,
    hier: bool = False,
    device: bool = False,
) -> str:
    """The algorithm to run: ``requested`` (the ``algo=`` keyword), else ``env_algo``
    (``RINGCOMM_ALGO``) when it names one of this collective's algorithms, else
    :data:`WORKSPACE_ALGO` when the group has a workspace (``local``), else by size.

    By size: all_reduce's ``star`` and ``direct`` at their measured switch points (the cost
    model does not price them), then, with a cost model loaded (``model``, see
    :class:`ModelChooser`), the algorithm it predicts cheapest for the
    collectives it prices; else the measured switch points. ``hier``: the group runs the
    hierarchical all_reduce, so the model may answer :data:`HIER_ALGO`.

    An ``algo=`` naming no algorithm of the collective raises ValueError (``"shm"``
    without a workspace too); so does a ``RINGCOMM_ALGO`` that names no algorithm of any
    collective.

    ``device``: the call's arrays are device arrays on a group with a workspace: then
    :data:`IPC_ALGO` is the default, and ``"shm"`` asks for it too (``"ipc"`` anywhere else
    is a ValueError, but on a barrier, which has no arrays: there it is ``"shm"``).
    """
    table = ALGORITHMS.get(collective) or UNEVEN_ALGORITHMS[collective]
    if requested in (IPC_ALGO, WORKSPACE_ALGO) and device:
        return IPC_ALGO
    if requested == IPC_ALGO:
        if collective == "barrier":
            requested = WORKSPACE_ALGO if local else None
        elif world_size == 1:
            return next(iter(table))
        else:
            raise ValueError(
                f"algo {IPC_ALGO!r} needs device arrays (CuPy) on a group whose ranks share "
                "one host and a workspace"
            )
    if requested is not None:
        if requested == WORKSPACE_ALGO:
            if world_size == 1 and not local:
                return next(iter(table))  # a group of one needs no workspace
            if not local:
                raise ValueError(
                    f"algo {WORKSPACE_ALGO!r} needs a group whose ranks share one host and a "
                    "workspace, and host (NumPy) arrays"
                )
            return requested
        get_algorithm(collective, requested)
        return requested
    if env_algo:
        if env_algo in table:
            return env_algo
        if env_algo not in (WORKSPACE_ALGO, HIER_ALGO, IPC_ALGO) and not any(
            env_algo in t for t in ALGORITHMS.values()
        ):
            names = sorted(
                {a for t in ALGORITHMS.values() for a in t} | {WORKSPACE_ALGO, HIER_ALGO, IPC_ALGO}
            )
            raise ValueError(f"RINGCOMM_ALGO={env_algo!r} names no algorithm; known: {names}")
    if device:
        return IPC_ALGO
    if local:
        return WORKSPACE_ALGO
    if collective == "all_reduce":
        if 3 <= world_size <= ALL_REDUCE_STAR_MAX_WORLD and nbytes <= ALL_REDUCE_STAR_MAX_BYTES:
            return "star"
        if nbytes <= ALL_REDUCE_DIRECT_MAX_BYTES and world_size <= ALL_REDUCE_DIRECT_MAX_WORLD:
            return "direct"
    if model is not None:
        choice = model.choose(collective, nbytes, hier)
        if choice is not None:
            return choice.algo
    if collective == "all_reduce":
        return "rd" if nbytes <= ALL_REDUCE_RD_MAX_BYTES else "ring"
    if collective == "broadcast":
        return "tree" if nbytes <= BROADCAST_TREE_MAX_BYTES else "chain"
    return next(iter(table))


# -- the plan of one call ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Plan:
    """How one call runs: ``algo`` (a registry name, or :data:`WORKSPACE_ALGO`,
    :data:`IPC_ALGO`, :data:`HIER_ALGO`), ``chunk_bytes`` (the cost model's piece size;
    None: the group's) and ``segment_bytes`` (a hierarchical call's segments; None: the
    hierarchy's own). Plans are shared (:func:`_plan_of`): never modified."""

    algo: str
    chunk_bytes: int | None = None
    segment_bytes: int | None = None

    @property
    def hier(self) -> bool:
        return self.algo == HIER_ALGO


_PLANS: dict[tuple[str, int | None, int | None], Plan] = {}


def _plan_of(algo: str, chunk_bytes: int | None = None, segment_bytes: int | None = None) -> Plan:
    """The one :class:`Plan` of these fields (a call builds none: a dictionary lookup)."""
    key = (algo, chunk_bytes, segment_bytes)
    found = _PLANS.get(key)
    if found is None:
        if len(_PLANS) >= MAX_CACHED:
            _PLANS.clear()
        found = _PLANS[key] = Plan(algo, chunk_bytes, segment_bytes)
    return found


#: The collectives a cost model prices hierarchically.
MODEL_HIER = frozenset(op for op, algos in MODEL_ALGORITHMS.items() if "hierarchical" in algos)


def plan(
    group: GroupCore,
    collective: str,
    requested: str | None,
    nbytes: int,
    host: bool,
    what: str,
    hier: bool = False,
) -> Plan:
    """The plan of a call of ``nbytes`` (``choose_algorithm``'s count; ``host``: its arrays
    are NumPy's), ``requested`` by ``algo=``. ``hier``: the call may run hierarchically
    (blocking, :func:`hier_fits`, not an integer mean); it does unless a cost model
    predicts a flat algorithm cheaper. ``algo="hier"`` where it does not: the flat rules."""
    if hier and _goes_hier(group, collective, requested, nbytes):
        segment = None
        if group.state.costmodel is not None:
            model = model_chooser(group)
            segment = None if model is None else model.hier_segment(collective, nbytes)
        return _plan_of(HIER_ALGO, None, segment)
    if requested == HIER_ALGO:
        requested = None
    algo = _pick(group, collective, requested, nbytes, host, what)
    model = group.chooser
    if model is None or nbytes <= model.one_piece_bytes:
        return _plan_of(algo)
    return _plan_of(algo, _model_chunk(group, model, collective, algo, requested, nbytes))


def hier_fits(group: GroupCore, collective: str, requested: str | None) -> bool:
    """Whether a blocking ``collective`` may run hierarchically: a group spanning hosts
    with several ranks on one of them, and neither ``requested`` (``algo=``) nor
    ``RINGCOMM_ALGO`` naming a flat algorithm; ``algo="hier"`` on a group it does not fit:
    ValueError. A group it fits is checked usable here (the hierarchy's calls are its
    sub-groups')."""
    if requested is not None and requested != HIER_ALGO:
        return False
    env = group.config.algo
    if requested is None and env is not None and env != HIER_ALGO:
        return False
    topo = group.topology
    fits = topo.num_hosts >= 2 and topo.max_local_size >= 2
    if requested == HIER_ALGO and not fits:
        raise ValueError(
            f"rank {group.rank}: {collective}: algo {HIER_ALGO!r} needs a group spanning "
            f"hosts with several ranks on one ({topo.num_hosts} host(s), at most "
            f"{topo.max_local_size} rank(s) on one)"
        )
    if fits:
        group.check_usable(collective)
    return fits


def _goes_hier(group: GroupCore, collective: str, requested: str | None, nbytes: int) -> bool:
    """After :func:`hier_fits`: yes when ``algo`` or ``RINGCOMM_ALGO`` says ``"hier"``, or
    without a cost model; with one, for the collectives it prices hierarchically, when it
    predicts hier cheapest at that size (the others: always)."""
    if requested is not None or group.config.algo is not None or collective not in MODEL_HIER:
        return True
    model = model_chooser(group)
    if model is None:
        return True
    algo = choose_algorithm(
        collective, None, None, nbytes, group.world_size, model=model, hier=True
    )
    return algo == HIER_ALGO


def _pick(
    group: GroupCore, collective: str, requested: str | None, nbytes: int, host: bool, what: str
) -> str:
    """The flat algorithm of a call (:func:`choose_algorithm` with what the group knows)."""
    env = group.config.algo
    if requested is None and group.workspace is not None and not env:
        if host:  # the common case on one host, without the general rule
            return WORKSPACE_ALGO
        if group.device_windows:
            return IPC_ALGO
    same_host = group.workspace is not None or group.workspace_pending
    local = host and same_host
    device = not host and same_host and group.device_windows
    try:
        if group.state.costmodel is None:
            return choose_algorithm(
                collective, requested, env, nbytes, group.world_size, local=local, device=device
            )
        return choose_algorithm(
            collective,
            requested,
            env,
            nbytes,
            group.world_size,
            local=local,
            model=group.chooser or model_chooser(group),
            device=device,
        )
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def _model_chunk(
    group: GroupCore,
    model: ModelChooser,
    collective: str,
    algo: str,
    requested: str | None,
    nbytes: int,
) -> int | None:
    """The cost model's piece size for a call it chose ``algo`` for, when no piece size
    was set (``chunk_bytes=`` / RINGCOMM_CHUNK_BYTES / ``pg.chunk_bytes``); None: the
    group's."""
    if requested is not None or not model.choose_chunk or group.chunk_bytes != model.chunk_bytes:
        return None
    env = group.config.algo
    if env and env in ALGORITHMS[collective]:
        return None
    choice = model.choose(collective, nbytes)
    return choice.chunk_bytes if choice is not None and choice.algo == algo else None


def model_chooser(group: GroupCore) -> ModelChooser | None:
    """The group's cost-model choices, made at its first call for its world shape (hosts
    from the endpoints published at rendezvous); None when the process loaded no model
    (RINGCOMM_TUNE_FILE) or the group has one rank."""
    chooser = group.chooser
    model = group.state.costmodel
    if chooser is not None or model is None or group.world_size < 2:
        return chooser  # type: ignore[no-any-return]
    topo = group.topology
    chooser = group.chooser = ModelChooser(
        model,
        topo.num_hosts,
        topo.max_local_size,
        group.world_size,
        ALGORITHMS,
        chunk_bytes=group.chunk_bytes,
        choose_chunk=group.config.chunk_bytes is None,
    )
    return chooser


def plan_scatter(
    group: GroupCore, requested: str | None, host: bool, no_arrays: bool, what: str
) -> Plan:
    """scatter's plan (a rank may pass ``x=None``, not knowing where the source's rows
    live): on a group of one host, :data:`IPC_ALGO` when asked for (``algo=``, or
    ``RINGCOMM_ALGO`` on a rank with a device array; ``no_arrays``: this rank passed
    neither ``x`` nor ``out``), else device arrays take :data:`WORKSPACE_ALGO` on host
    copies; elsewhere as :func:`plan`."""
    if requested == HIER_ALGO:
        requested = None
    same_host = group.workspace is not None or group.workspace_pending
    env_ipc = requested is None and group.config.algo == IPC_ALGO and group.device_windows
    if same_host and (requested == IPC_ALGO or (env_ipc and not host)):
        if host or no_arrays:
            raise ValueError(
                f"{what}: algo {IPC_ALGO!r} needs a device array on every rank (x on src, "
                "x or out elsewhere)"
            )
        return _plan_of(IPC_ALGO)
    if not host and same_host:
        return _plan_of(WORKSPACE_ALGO)
    return plan(group, "scatter", requested, 0, host, what)


def plan_uneven(group: GroupCore, collective: str, nbytes: int, host: bool, what: str) -> Plan:
    """The plan of an uneven collective (no ``shm`` for host arrays; device arrays on a
    group with a workspace take ``ipc``)."""
    device = (
        not host
        and group.device_windows
        and (group.workspace is not None or group.workspace_pending)
    )
    try:
        return _plan_of(
            choose_algorithm(
                collective, None, group.config.algo, nbytes, group.world_size, device=device
            )
        )
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def plan_without_workspace(group: GroupCore, collective: str, nbytes: int) -> str:
    """The algorithm of a call planned for the workspace (or its device windows) on a
    sub-group that found at its first call it has none: as any group without one."""
    return choose_algorithm(collective, None, group.config.algo, nbytes, group.world_size)
