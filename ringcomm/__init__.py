"""ringcomm: a from-scratch collective-communication runtime in Python over ZeroMQ.

    import ringcomm as rc
    with rc.init_process_group() as pg:       # rank/world/master from args or environment
        pg.send(x, dst=1, tag=7)
        pg.recv(y, src=0, tag=7)

See docs/contracts.md for the contracts; ``ringcomm.errors`` for the error tree.
"""

from __future__ import annotations

from ringcomm._version import __version__
from ringcomm.core.p2p import ANY_SOURCE
from ringcomm.core.work import Work
from ringcomm.errors import (
    AuthenticationError,
    CollectiveMismatchError,
    CommTimeoutError,
    GroupClosedError,
    MessageMismatchError,
    PeerFailedError,
    QueueLimitError,
    RankFailedError,
    RendezvousError,
    RingcommError,
)
from ringcomm.group import ProcessGroup, init_process_group
from ringcomm.launch import spawn
from ringcomm.ops import ReduceOp

__all__ = [
    "ANY_SOURCE",
    "AuthenticationError",
    "CollectiveMismatchError",
    "CommTimeoutError",
    "GroupClosedError",
    "MessageMismatchError",
    "PeerFailedError",
    "ProcessGroup",
    "QueueLimitError",
    "RankFailedError",
    "ReduceOp",
    "RendezvousError",
    "RingcommError",
    "Work",
    "__version__",
    "init_process_group",
    "spawn",
]
