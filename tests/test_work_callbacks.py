"""``Work.add_done_callback``: called once, by whichever thread completes the operation.

Cases (one spawned job, 2 ranks): a callback added before completion runs on the
progress thread while the caller never waits; one added after completion runs at once on
the caller's thread; several callbacks all run, once each, in order; a callback that
raises is logged and neither breaks the engine nor the other callbacks; a failed
operation (the group closed under it) calls back with its error.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import pytest

import ringcomm as rc


def _callbacks_job(pg: rc.ProcessGroup) -> dict[str, Any]:
    peer = 1 - pg.rank
    out: dict[str, Any] = {}
    if pg.rank == 1:
        for tag in (1, 2, 3):
            pg.send(np.full(1000, tag, np.float32), peer, tag=tag)
        pg.barrier()
        pg.barrier()
        return out

    # 1. Added before completion; nobody waits: the progress thread calls it.
    buf = np.zeros(1000, np.float32)
    fired = threading.Event()
    calls: list[tuple[str, bool, float]] = []

    def on_done(w: rc.Work) -> None:
        calls.append((threading.current_thread().name, w.done(), float(w.wait()[0])))
        fired.set()

    work = pg.irecv(buf, peer, tag=1)
    work.add_done_callback(on_done)
    out["fired"] = fired.wait(20)
    time.sleep(0.05)  # a second call would show up here
    out["calls"] = calls
    out["caller"] = threading.current_thread().name

    # 2. Added after completion: called at once, on this thread.
    now: list[str] = []
    work.add_done_callback(lambda w: now.append(threading.current_thread().name))
    out["immediate"] = now

    # 3. Several callbacks, one of which raises: all run, once each, in order; logged.
    order: list[int] = []
    records: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Catch(level=logging.ERROR)
    logging.getLogger("ringcomm").addHandler(handler)
    try:

        def boom(w: rc.Work) -> None:
            order.append(2)
            raise RuntimeError("callback failure on purpose")

        work = pg.irecv(np.zeros(1000, np.float32), peer, tag=2)
        work.add_done_callback(lambda w: order.append(1))
        work.add_done_callback(boom)
        work.add_done_callback(lambda w: order.append(3))
        work.wait(20)
        work.wait(20)  # waiting again calls nothing again
        out["order"] = order
        out["logged"] = [r.getMessage() for r in records]
        # The engine still works after a callback raised.
        got = pg.recv(np.zeros(1000, np.float32), peer, tag=3)
        out["after"] = float(got[0])
    finally:
        logging.getLogger("ringcomm").removeHandler(handler)
    pg.barrier()

    # 4. A failed operation calls back with its error (a sub-group closed under it).
    sub = pg.new_group([0, 1])
    errors: list[Any] = []
    work = sub.irecv(np.zeros(4, np.float32), peer, tag=9)  # never sent
    work.add_done_callback(lambda w: errors.append(type(w.exception()).__name__))
    sub.close()
    out["failed"] = errors
    pg.barrier()
    return out


@pytest.mark.timeout(90)
def test_done_callbacks(no_child_processes: None) -> None:
    out = rc.spawn(_callbacks_job, 2, timeout_s=60)[0]
    assert out["fired"]
    assert len(out["calls"]) == 1, out["calls"]
    thread, done, first = out["calls"][0]
    assert done and first == 1.0
    assert thread.startswith("ringcomm-progress"), thread  # nobody else drove
    assert out["immediate"] == [out["caller"]]
    assert out["order"] == [1, 2, 3]
    assert len(out["logged"]) == 1 and "callback" in out["logged"][0], out["logged"]
    assert out["after"] == 3.0
    assert out["failed"] == ["GroupClosedError"], out["failed"]
