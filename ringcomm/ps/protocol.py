"""The messages between workers and servers (over a ProcessGroup's tagged p2p).

The p2p layer matches a receive on (source, tag) and needs the buffer's exact size, with no
receive-from-any-source. So each side keeps one ordered stream per peer: a server runs one
receive loop per worker on tag :data:`TAG_REQUEST`, and every request is a fixed-size
``int64[8]`` header, followed (for ops that carry data) by the payload as a second message
on the same tag, whose size the header gave. Replies go back on :data:`TAG_REPLY`: an
``int64[4]`` header, then, for pulls, the data, received zero-copy into the caller's output
array (a view of it, for a key split over servers). Replies come in request order, so a
worker posts its receives when it sends the request.

Request header: ``[op, key, step, start, nelem, dtype code, extra, seq]``; ``extra`` is the
reader's clock for pulls, the key's total length for ``INIT``. Reply header:
``[status, version, gap, extra]`` (``extra``: bytes of JSON that follow a ``STATS`` reply).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "OP_BYE",
    "OP_HELLO",
    "OP_INIT",
    "OP_NAMES",
    "OP_PULL",
    "OP_PUSH",
    "OP_PUSH_PULL",
    "OP_STATS",
    "REPLY_WORDS",
    "REQUEST_WORDS",
    "TAG_REPLY",
    "TAG_REQUEST",
]

# Tags inside the parameter server's own sub-group (its own tag space).
TAG_REQUEST = 0x5053_0001
TAG_REPLY = 0x5053_0002

OP_INIT = 1
OP_PUSH = 2
OP_PULL = 3
OP_PUSH_PULL = 4
OP_HELLO = 5
OP_STATS = 6
OP_BYE = 7
OP_NAMES = {
    OP_INIT: "init",
    OP_PUSH: "push",
    OP_PULL: "pull",
    OP_PUSH_PULL: "push_pull",
    OP_HELLO: "hello",
    OP_STATS: "stats",
    OP_BYE: "bye",
}
#: Ops whose request carries a payload; ops whose reply does.
WITH_PAYLOAD = frozenset({OP_INIT, OP_PUSH, OP_PUSH_PULL})
REPLY_WITH_DATA = frozenset({OP_PULL, OP_PUSH_PULL})

REQUEST_WORDS = 8
REPLY_WORDS = 4
STATUS_ERROR = -1


def request(
    op: int,
    key: int = 0,
    step: int = 0,
    start: int = 0,
    nelem: int = 0,
    dtype_code: int = 0,
    extra: int = 0,
    seq: int = 0,
) -> np.ndarray:
    return np.array([op, key, step, start, nelem, dtype_code, extra, seq], np.int64)
