"""Print what a rank sees: its launcher variables as JSON, a stderr line, argv, and a last
line without a newline."""

import json
import os
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
]
env = {name: os.environ.get(name) for name in NAMES}
env["token_len"] = len(os.environ.get("RINGCOMM_TOKEN", ""))
print("ENV " + json.dumps(env))
print("ARGV " + json.dumps(sys.argv[1:]))
print(f"to stderr from {os.environ['RANK']}", file=sys.stderr)
sys.stdout.write(f"no newline from {os.environ['RANK']}")
