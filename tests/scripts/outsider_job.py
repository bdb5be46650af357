"""A two-rank job, under any launcher, that an outsider without the token tries to get into.

Rank 0 starts ``outsider.py`` (a process of its own, with no token in its environment)
against rank 1's data endpoints and rank 0's store (when rank 0 serves it), while rank 1
has a receive posted for the tag the forged frames carry. Then the real message goes, and
an all_reduce runs. Each rank reports what it received, its refusal counters, and (rank 0)
what the outsider got: as ``<rank>.json`` in ``$OUTSIDER_REPORT_DIR`` when that is set (a
launcher such as mpirun may interleave the ranks' stdout), else as ``OUTSIDER <rank> <json>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

import ringcomm as rc

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    pg = rc.init_process_group()
    report: dict[str, object] = {"token": pg.core.state.config.token is not None}
    transport = pg.core.progress.transport
    if pg.rank == 1:
        buf = np.full(2, -1, np.int64)
        work = pg.irecv(buf, src=0, tag=9)  # what the forged frames claim to be
        endpoints = [e for e in (transport.ipc_endpoint, transport.tcp_endpoint) if e]
        pg.send(np.frombuffer(json.dumps(endpoints).encode().ljust(1024), np.uint8), 0, tag=1)
        pg.recv(np.zeros(1, np.uint8), 0, tag=2)  # the outsider is done
        deadline = time.monotonic() + 15
        while pg.stats()["auth_failures"] < 2 * 3 and time.monotonic() < deadline:
            work.done()  # drive the engine: a forged frame must not complete the receive
            time.sleep(0.02)
        report["early"] = work.done()
        pg.send(np.zeros(1, np.uint8), 0, tag=3)
        work.wait(timeout_s=30)
        report["received"] = buf.tolist()
    else:
        raw = np.zeros(1024, np.uint8)
        pg.recv(raw, 1, tag=1)
        spec: dict[str, object] = {"endpoints": json.loads(raw.tobytes().decode())}
        server, cfg = pg.core.state.server, pg.core.state.config
        spec["store"] = [cfg.master_addr, pg.core.state.store_port]  # rank 0's or the launcher's
        env = {k: v for k, v in os.environ.items() if "TOKEN" not in k}
        out = subprocess.run(
            [sys.executable, os.path.join(HERE, "outsider.py"), json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        report["outsider"] = json.loads(out.stdout.strip().splitlines()[-1])
        if server is not None:
            report["store_rejected"] = getattr(server, "server", server).rejected  # (a lease on it)
        pg.send(np.zeros(1, np.uint8), 1, tag=2)
        pg.recv(np.zeros(1, np.uint8), 1, tag=3)
        pg.send(np.array([12345, 54321], np.int64), 1, tag=9)
    x = np.full(4, pg.rank + 1.0)
    pg.all_reduce(x)
    report["all_reduce"] = x.tolist()
    report["auth_failures"] = pg.stats()["auth_failures"]
    report_dir = os.environ.get("OUTSIDER_REPORT_DIR")
    if report_dir:
        part = os.path.join(report_dir, f"{pg.rank}.json.part")
        with open(part, "w") as f:
            json.dump(report, f)
        os.replace(part, os.path.join(report_dir, f"{pg.rank}.json"))
    else:
        print(f"OUTSIDER {pg.rank} {json.dumps(report)}", flush=True)
    pg.close()


if __name__ == "__main__":
    main()
