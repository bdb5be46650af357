"""Say "ready <RINGCOMM_TOKEN>" (so a test can look for the token in every ``ps`` line),
then sleep; SIGTERM kills us."""

import os
import time

print(f"ready {os.environ.get('RINGCOMM_TOKEN', '')}", flush=True)
time.sleep(60)
