"""Say "ready", then sleep; on SIGINT/SIGTERM say which signal came and exit 0.

python sleep_ready.py [--no-handlers]
"""

import signal
import sys
import time


def on_signal(signum, frame):
    print(f"got {signal.Signals(signum).name}", flush=True)
    sys.exit(0)


if "--no-handlers" not in sys.argv:
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
print("ready", flush=True)
time.sleep(60)
