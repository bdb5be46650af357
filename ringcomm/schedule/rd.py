"""Recursive-doubling allreduce plan for small messages, any world size (pure).

MPICH's ``MPIR_Allreduce_intra_recursive_doubling``: with ``p2`` the largest power of two
``<= n`` and ``rem = n - p2``, the first ``2 * rem`` ranks pair up (odd ranks send to the
even one and sit out), the ``p2`` left exchange whole buffers with partner ``newrank ^ mask``
for ``mask = 1, 2, 4, ...``, and the even ranks send the result back to their odd partner.

Invariant: every rank ends with identical bits, on every run: in every combination the
operand from the lower rank is on the left (:attr:`RdStep.incoming_first`), so the result
is one fixed bracketing of ``x[0] op ... op x[n-1]`` in rank order. The steps and the
proof: docs/architecture.md, section "schedule/rd.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["RdKind", "RdStep", "rd_allreduce_plan"]

RdKind = Literal["send", "recv_reduce", "exchange", "send_result", "recv_result"]


@dataclass(frozen=True)
class RdStep:
    """One step of a rank's plan.

    ``kind``:

    * ``"send"``: pre-step, send the local buffer to ``peer`` (then wait for the result).
    * ``"recv_reduce"``: pre-step, receive ``peer``'s buffer and reduce it into the local one.
    * ``"exchange"``: send the local buffer to ``peer`` and receive ``peer``'s; reduce it in
      only after the outgoing data is safe (sent, or copied into the message).
    * ``"send_result"``: post-step, send the final buffer to ``peer``.
    * ``"recv_result"``: post-step, receive the final buffer from ``peer`` (overwrite).

    ``incoming_first``: for reducing steps, compute ``incoming (op) local`` instead of
    ``local (op) incoming`` (pass it to ``ops.reduce_into``); true exactly when ``peer`` is
    the lower rank, so the lower rank's operand is always on the left.
    """

    kind: RdKind
    peer: int
    incoming_first: bool = False


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")


def _old_rank(newrank: int, rem: int) -> int:
    # Inverse of the renumbering: the first `rem` newranks are the even ranks 0, 2, ...
    return newrank * 2 if newrank < rem else newrank + rem


def rd_allreduce_plan(rank: int, world_size: int) -> list[RdStep]:
    """The ordered steps ``rank`` carries out; ``[]`` for a world of one."""
    _check_rank(rank, world_size)
    p2 = 1 << (world_size.bit_length() - 1)  # largest power of two <= world_size
    rem = world_size - p2
    steps: list[RdStep] = []
    # Pre-step: fold the first 2*rem ranks pairwise, odd into even.
    if rank < 2 * rem:
        if rank % 2 == 1:
            return [RdStep("send", rank - 1), RdStep("recv_result", rank - 1)]
        steps.append(RdStep("recv_reduce", rank + 1))
        newrank = rank // 2
    else:
        newrank = rank - rem
    # Exchanges among the p2 remaining ranks, lower rank's data always on the left.
    mask = 1
    while mask < p2:
        peer = _old_rank(newrank ^ mask, rem)
        steps.append(RdStep("exchange", peer, incoming_first=peer < rank))
        mask <<= 1
    # Post-step: hand the result back to the odd partner that sat out.
    if rank < 2 * rem:
        steps.append(RdStep("send_result", rank + 1))
    return steps
