"""The probe of ``ringcomm tune --hostfile`` (ringcomm.tuning.hosts.probe) on pretend hosts,
small: prints the rank's report as the ssh job's ranks do.

    ringcomm run -n N tune_probe.py HOSTS
        HOSTS: the host of each rank, e.g. 0,0,1,1
"""

from __future__ import annotations

import json
import os
import socket
import sys

HOSTS = [int(h) for h in sys.argv[1].split(",")]
RANK = int(os.environ["RINGCOMM_RANK"])
os.environ["RINGCOMM_HOST_ID"] = f"pretend-host-{HOSTS[RANK]}"  # before the group forms

import ringcomm as rc  # noqa: E402
from ringcomm.bench.multihost import MARK  # noqa: E402
from ringcomm.tuning.hosts import probe  # noqa: E402

KiB = 1 << 10
SPECS = [
    ("cross", 4 * KiB, None),
    ("cross", 256 * KiB, None),
    ("host", 256 * KiB, None),
    ("flat", 256 * KiB, None),
    ("hier", 256 * KiB, 256 * KiB),
    ("hier", 256 * KiB, 64 * KiB),
]


def main() -> None:
    with rc.init_process_group(timeout_s=60) as pg:
        report = probe(pg, SPECS, iters=2, warmup=1)
        msg = {"rank": pg.rank, "hostname": socket.gethostname(), "records": report}
        print(MARK + json.dumps(msg), flush=True)
        pg.barrier()


if __name__ == "__main__":
    main()
