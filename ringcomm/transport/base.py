"""The transport boundary: the one interface the progress engine sends and receives through.

As gloo's ``transport::Pair`` and ps-lite's ``Van``: the layer above hands a transport whole
messages (a packed header and its payload) for a peer and reads whole messages back; how
each one travels (inline in the header, a same-host datagram, two zmq frames, a
shared-memory slot or a zero-copy frame, by ``nbytes``) is chosen here and nowhere else.

Invariant: messages to one peer are delivered in the order sent, per :class:`Stream` (the
messages of one operation); ``stream=None`` never takes the datagram path (point-to-point
and control messages, whose order must hold across operations). Implementations:
:class:`~ringcomm.transport.zmq_transport.ZmqTransport` and, for tests,
:class:`~ringcomm.transport.memory.MemoryTransport`. The size table and the order rule:
docs/architecture.md, section "transport/base.py".
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

__all__ = [
    "EVENT_DISCONNECTED",
    "EVENT_HANDSHAKE_OK",
    "INLINE_MAX_BYTES",
    "LANE_MAX_PAYLOAD_BYTES",
    "ZERO_COPY_MIN_BYTES",
    "Completion",
    "Stream",
    "Transport",
]

#: Payloads smaller than this ride inside the header frame (one frame per message): it
#: saves a send and a receive call per message, most of an 8-byte message's cost.
INLINE_MAX_BYTES = 4096
#: Largest payload sent as a same-host datagram (beyond it: shared memory or zero-copy).
LANE_MAX_PAYLOAD_BYTES = 64 * 1024
#: Payloads at least this large go zero-copy (or through shared memory): copying smaller
#: ones is cheaper than tracking them (a zero-copy frame costs a free-callback round trip
#: through pyzmq's gc thread).
ZERO_COPY_MIN_BYTES = 64 * 1024

#: Connection events (:meth:`Transport.poll_events`); the values are libzmq's.
EVENT_DISCONNECTED = 0x0200
EVENT_HANDSHAKE_OK = 0x1000


class Stream:
    """The messages of one operation, whose order to each peer the transport keeps.

    It remembers the peers to which one of its messages went over an ordered-only path
    (zmq): its later messages to them must not take a path that could overtake (the
    datagram lane; unix_lane.py, "Order").
    """

    __slots__ = ("ordered",)

    def __init__(self) -> None:
        #: Peers this stream's messages must reach over zmq from now on (None: none yet;
        #: read on every send, so a plain attribute).
        self.ordered: set[int] | None = None

    def may_overtake(self, peer: int) -> bool:
        """Whether a message to ``peer`` may take a path that overtakes zmq."""
        ordered = self.ordered
        return ordered is None or peer not in ordered

    def keep_ordered(self, peer: int) -> None:
        """A message to ``peer`` went over zmq: the rest of the stream to it will too."""
        if self.ordered is None:
            self.ordered = {peer}
        else:
            self.ordered.add(peer)


class Completion(Protocol):
    """What a zero-copy send returns: done once the transport let go of the payload."""

    @property
    def done(self) -> bool: ...


class Transport(Protocol):
    """One rank's end of the data plane (module docstring). Not thread-safe: the
    progress engine calls it under its driver lock, except :meth:`wake` and
    :meth:`send_farewell` (any thread) and :meth:`wait_sent` (no lock)."""

    rank: int
    linger_s: float
    heartbeat_timeout_s: float
    sent_bytes: int
    sent_messages: int
    auth_failures: int
    #: Peers whose receive socket refused this rank's login (a token mismatch).
    refused_by: set[int]

    # Counters of the same-host paths (0 where the transport has none).
    @property
    def lane_messages(self) -> int: ...
    @property
    def shm_pieces(self) -> int: ...
    @property
    def lane_fallbacks(self) -> int: ...

    def peers(self) -> list[int]:
        """Every peer with a known endpoint (global ranks, ascending)."""

    def send(
        self, peer: int, stream: Stream | None, header: bytes, payload: Any, nbytes: int
    ) -> Completion | None:
        """Queue one message: ``header`` (packed without an inline payload) and ``payload``
        (``nbytes`` bytes, anything with the buffer protocol). Returns a completion when
        the payload went zero-copy: do not modify it until that is done.

        ``payload=None``: ``header`` is the whole one-frame message, its payload packed
        inline by the caller (``nbytes < INLINE_MAX_BYTES``; the latency-bound fast lane
        frames once for every peer). The path is still the transport's choice."""

    def send_tracked(self, peer: int, frame: bytes) -> Completion:
        """Queue a one-frame message over the ordered path; done once written out (and
        with it every earlier message to ``peer``)."""

    def send_farewell(self, frame: bytes, peers: Collection[int], timeout_s: float) -> None:
        """Send ``frame`` to ``peers`` without touching the data path (any thread)."""

    def wait_sent(self, completion: Completion, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``completion``; True if done (no lock needed)."""

    def poll(self, timeout_s: float, spin_s: float = 0.0) -> bool:
        """Wait up to ``timeout_s`` for an incoming message (or a wake-up)."""

    def control_waiting(self) -> bool:
        """A cheap look: False when no message that travels outside the same-host lane (a
        control message among them) can be waiting; True when one may be."""
        ...

    def recv_first(self, ready: bool = False) -> tuple[bytes, bool] | None:
        """The next message's header frame and whether a payload frame follows; None
        when nothing is waiting (never blocks)."""

    def recv_payload(self, copy: bool, src: int = -1) -> memoryview | bool:
        """The payload frame after :meth:`recv_first` said one follows (False: bad)."""

    def poll_events(self) -> list[tuple[int, int]]:
        """Connection events since the last look, as ``(peer, event)``."""

    def wake(self) -> None:
        """Interrupt a :meth:`poll` in progress on another thread."""

    def remove_files(self) -> None:
        """Remove what this rank left in the file system (the process is ending)."""

    def close(self, linger_s: float | None = None, abandon: Collection[int] = ()) -> None:
        """Close everything; pending messages get ``linger_s`` (none to ``abandon``)."""
