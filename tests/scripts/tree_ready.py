"""Start a grandchild in our process group, say "ready", then sleep.

python tree_ready.py [--ignore-sigterm] [--handle-sigterm]

--ignore-sigterm: ignore SIGTERM (the grandchild too); --handle-sigterm: say "got SIGTERM"
and exit 0 on it. Otherwise SIGTERM kills us.
"""

import os
import signal
import subprocess
import sys
import time

if "--ignore-sigterm" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the grandchild
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
if "--handle-sigterm" in sys.argv:

    def on_term(signum, frame):
        print("got SIGTERM", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
print(f"ready {os.getpid()} {child.pid}", flush=True)
time.sleep(60)
