"""Rank FAIL_RANK exits with CODE after DELAY_S; the others say "ready" and sleep.

    python exit_code.py FAIL_RANK CODE [DELAY_S] [--ignore-sigterm]

FAIL_RANK -1: every rank exits with CODE, rank r after (r + 1) * DELAY_S. A negative CODE
is a signal: the rank kills itself with it.
"""

import os
import signal
import sys
import time

fail_rank, code = int(sys.argv[1]), int(sys.argv[2])
delay_s = float(sys.argv[3]) if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else 0.5
rank = int(os.environ["RANK"])
if "--ignore-sigterm" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
if fail_rank == -1:
    delay_s *= rank + 1
if rank == fail_rank or fail_rank == -1:
    time.sleep(delay_s)
    if code < 0:
        os.kill(os.getpid(), -code)
    sys.exit(code)
time.sleep(60)
