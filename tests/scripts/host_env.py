"""Print where a rank runs and what it was given, as one JSON line: ``HOST {...}``.

python host_env.py [VAR...]   (extra variables to report, e.g. propagated ones)
"""

import json
import os
import socket
import sys

NAMES = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RINGCOMM_RANK",
    "RINGCOMM_WORLD_SIZE",
    "RINGCOMM_MASTER_ADDR",
    "RINGCOMM_MASTER_PORT",
    "RINGCOMM_STORE_EXTERNAL",
    *sys.argv[1:],
]
info = {name: os.environ.get(name) for name in NAMES}
info["hostname"] = socket.gethostname()
info["cwd"] = os.getcwd()
info["token_len"] = len(os.environ.get("RINGCOMM_TOKEN", ""))
info["stdin_is_devnull"] = os.path.samefile("/proc/self/fd/0", os.devnull)
print("HOST " + json.dumps(info))
