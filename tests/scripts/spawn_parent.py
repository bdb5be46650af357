"""Parent for the orphan test: supervise N spawned ranks that say "ready" and hang.

    python spawn_parent.py N

The test SIGKILLs this process once every rank said ready and checks the ranks go away.
"""

import sys
import time

from ringcomm.launch.spawn import _run_ranks


def hang(rank: int, world_size: int) -> None:
    print(f"ready {rank}", flush=True)
    time.sleep(300)


if __name__ == "__main__":
    _run_ranks(hang, int(sys.argv[1]))
