"""A rendezvous that disagrees, under any launcher: ``python join_mismatch.py MODE``.

MODE ``world``: this rank passes ``world_size=launched + 1``; ``world_port``: the same with
the store's port passed by hand (so the store's host refuses it, not the configuration);
``dup``: ranks 0, 1, 1, ... (``rank=min(rank, 1)``). Prints ``REFUSED <rank> <seconds>
<message>`` (or ``FORMED <rank>``) and exits 0, so that every rank reports.
"""

from __future__ import annotations

import os
import sys
import time

import ringcomm as rc
from ringcomm.config import resolve_init_config

mode = sys.argv[1]
launched = resolve_init_config()
kwargs: dict[str, object] = {"timeout_s": 30.0}
if mode in ("world", "world_port"):
    kwargs["world_size"] = launched.world_size + 1
if mode == "world_port":
    kwargs["rank"] = launched.rank
    kwargs["master_port"] = int(os.environ["RINGCOMM_MASTER_PORT"])
if mode == "dup":
    kwargs["rank"] = min(launched.rank, 1)
t0 = time.monotonic()
try:
    pg = rc.init_process_group(**kwargs)  # type: ignore[arg-type]
except rc.RendezvousError as exc:
    msg = str(exc).replace("\n", " ")
    print(f"REFUSED {launched.rank} {time.monotonic() - t0:.2f} {msg}", flush=True)
else:
    print(f"FORMED {launched.rank}", flush=True)
    pg.close()
