"""Control messages: the engine's own traffic between ranks (``KIND_CTRL``, group 0).

They are never matched to receivers: :meth:`ringcomm.core.progress.Progress.dispatch` hands
each to the engine's handler. Their tag says what they are; their fingerprint carries the
arguments, which came off the wire, so a handler checks every one (:func:`is_list`) and
caps the text it keeps at :data:`CTRL_TEXT_MAX`. Sending is best effort: a control message
never fails its caller. See docs/architecture.md, "The progress engine".
"""

from __future__ import annotations

import logging
from typing import Any

from ringcomm.transport.base import Transport
from ringcomm.transport.wire import KIND_CTRL, Header, pack_header

__all__ = [
    "CTRL_ABORT",
    "CTRL_BYE",
    "CTRL_PEER_FAILED",
    "CTRL_QUERY",
    "CTRL_STATE",
    "CTRL_TEXT_MAX",
    "bye_frame",
    "is_list",
    "send_ctrl",
]

log = logging.getLogger("ringcomm")

#: Longest text a rank puts in a control message.
CTRL_TEXT_MAX = 2000

#: Goodbye; its fingerprint says how the sender leaves: None (``close()``), or
#: ``[DEPART_EXIT, ""]`` (its process ended without closing), ``[DEPART_ERROR, why]``
#: (it goes down: an uncaught exception, ``abort()``, a signal).
CTRL_BYE = 1
#: ``[global rank, text]``: that rank failed (as the sender learned).
CTRL_PEER_FAILED = 2
#: ``[query id]``: where is the receiver? (a timed-out operation asks its peers)
CTRL_QUERY = 3
#: ``[query id, text]``: the answer to a query.
CTRL_STATE = 4
#: A collective of a group failed at the sender: ``[group id, seq, error type, text, the
#: global rank a PeerFailedError names (-1: none)]``.
CTRL_ABORT = 5


def send_ctrl(transport: Transport, rank: int, peer: int, tag: int, fp: Any) -> None:
    """Queue control message ``tag`` from ``rank`` to global rank ``peer`` (best effort)."""
    header = pack_header(Header(KIND_CTRL, rank, 0, tag, fp=fp))
    try:
        transport.send(peer, None, header, b"", 0)
    except Exception as exc:  # noqa: BLE001 (a control message never fails the caller)
        log.debug("rank %d: control message to rank %d not sent: %r", rank, peer, exc)


def bye_frame(rank: int, fp: Any) -> bytes:
    """A goodbye from ``rank`` as one frame (fingerprint ``fp``, see :data:`CTRL_BYE`)."""
    return pack_header(Header(KIND_CTRL, rank, 0, CTRL_BYE, fp=fp), b"")


def is_list(value: Any, n: int) -> bool:
    """Whether a fingerprint from the wire is a list of ``n`` items."""
    return type(value) is list and len(value) == n
