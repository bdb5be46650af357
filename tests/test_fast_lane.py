"""The fast lane of small blocking all_reduce (``Progress.exchange``, ``AllReduceDirect.run_now``)
end to end, over sockets.

A blocking all_reduce below the inline size (direct algorithm, or the star at 3 to 4
ranks) runs on the calling thread without inboxes or rounds while the engine is otherwise
idle; on anything unusual it hands the call over to the regular op. Here real processes
over the zmq transport (with its same-host datagram lane) run every dtype and op, some
ranks blocking (the lane) and others async (the regular op) in the same call, and get the
same bits. Every way of leaving the lane (a mismatch, a message that arrived first, another
thread submitting, async work in flight, a late or dead peer) is protocol logic, tested
deterministically over the in-memory transport in test_fast_lane_logic.py.
"""

from __future__ import annotations

import pytest
from fast_lane_calls import CASES, interop_calls, is_blocking

import ringcomm as rc

# The lane is the message path's: on one host collectives would take the shared workspace.
pytestmark = pytest.mark.usefixtures("no_workspace")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_lane_and_regular_path_interoperate(world_size: int) -> None:
    results = rc.spawn(interop_calls, world_size, timeout_s=110)
    for rank, (failures, _, _) in enumerate(results):
        assert failures == [], f"rank {rank}: " + "\n".join(failures)
    assert all(r[1] == results[0][1] for r in results), "results differ between ranks"
    for rank, (_, _, counts) in enumerate(results):
        blocking = sum(1 for i in range(2 * len(CASES)) if is_blocking(i, rank))
        # Every blocking call tries the lane; right after an async call the progress
        # thread may still hold the driver lock (then it is not taken), a peer still busy
        # with the last call may keep the lane past its slice (then it is handed over),
        # else it is done.
        assert sum(counts.values()) == blocking and counts.get("done", 0) > blocking // 4, counts
