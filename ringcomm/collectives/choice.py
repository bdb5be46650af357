"""The algorithm and piece size of a call, from a cost model (pure: no sockets).

A group that loaded a cost model (``RINGCOMM_TUNE_FILE``, written by ``ringcomm tune``;
:mod:`ringcomm.tuning.costmodel`) asks its :class:`ModelChooser` instead of the measured switch
points, for the collectives the model prices (:data:`MODELLED`). The chooser prices every
algorithm the registry runs for the collective (the model's names mapped by
:data:`REGISTRY_NAMES`; ``hier`` only where the caller says the group runs it) at the
group's world shape, ``hosts`` x ``ranks_per_host`` (hosts of different sizes: priced as
``hosts`` hosts of the largest size, the busiest host setting the pace), and, unless the
piece size was set (``chunk_bytes=`` / ``RINGCOMM_CHUNK_BYTES`` / ``pg.chunk_bytes``), each
of them at every piece size of :data:`CHUNK_CANDIDATES`; the cheapest wins (ties: the
model's table order, then the group's own piece size). ``hier`` is priced in segments
(:mod:`ringcomm.collectives.hierarchy` runs it so); a model with a CPU term (``ringcomm tune
--hostfile``, :class:`ringcomm.tuning.costmodel.CpuModel`) also chooses its segment size among
:data:`SEGMENT_CANDIDATES` (:meth:`ModelChooser.hier_segment`): small segments shorten the
part of the pipeline that does not overlap where a link bounds it, large ones cost less CPU
per byte where the cores do. Without one, hier keeps its 8 MiB segments (a model that does
not price the CPU cannot see what a segment costs).

Sizes are priced per bucket (:func:`size_bucket`: four per octave, at the bucket's upper
end), so every size of a bucket gets one answer, and answers are cached per (collective,
bytes): a call with a model loaded costs a dictionary lookup.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ringcomm.tuning.costmodel import ALGORITHMS as MODEL_ALGORITHMS
from ringcomm.tuning.costmodel import HIER_SEGMENT_BYTES, CostModel, predict

__all__ = [
    "CHUNK_CANDIDATES",
    "HIER",
    "MODELLED",
    "REGISTRY_NAMES",
    "SEGMENT_CANDIDATES",
    "ModelChoice",
    "ModelChooser",
    "size_bucket",
]

#: The registry's name of the hierarchical algorithm (ringcomm.collectives.hierarchy, run by the group).
HIER = "hier"
#: The cost model's algorithm names -> the registry's (the model's others, ``ps`` and an
#: all_reduce ``tree``, are not registry algorithms and never chosen).
REGISTRY_NAMES: dict[str, str] = {
    "ring": "ring",
    "rd": "rd",
    "tree": "tree",
    "chain": "chain",
    "hierarchical": HIER,
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
    """One group's choices from ``model`` (module docstring).

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
                    if REGISTRY_NAMES.get(m) in table or (hier and REGISTRY_NAMES.get(m) == HIER)
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
            if algo == HIER:
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
