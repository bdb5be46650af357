"""Job start-to-finish time of ``ringcomm run``: local mode vs ssh mode (real sshd hosts).

Starts 3 loopback sshd hosts (tests/sshd_hosts.py; needs root and openssh-server), then times
``ringcomm run`` of a script that forms the group and does one barrier-like all_reduce, local
``-n W`` and ssh ``-H node1:K,node2:K,node3:K`` (W = 3K), alternating A B A B; prints the
medians and the ssh/local ratio. The ssh mode adds a preflight round (one ssh per host,
importing ringcomm there) and one ssh connection per rank.

    python benchmarks/ssh_launch.py [--per-host 2] [--repeats 5] [--mode loopback|netns]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from sshd_hosts import SshdHosts  # noqa: E402 (from tests/, put on the path above)

JOB = """\
import numpy as np
import ringcomm as rc
with rc.init_process_group(timeout_s=60) as pg:
    x = np.ones(4)
    pg.all_reduce(x)
    assert x[0] == pg.world_size
"""


def timed(argv: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    res = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{argv} failed ({res.returncode}): {res.stderr[-2000:]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mode", default="loopback", choices=["loopback", "netns"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, SshdHosts(Path(tmp) / "hosts", args.mode) as hosts:
        script = Path(tmp) / "job.py"
        script.write_text(JOB)
        world = 3 * args.per_host
        run = [sys.executable, "-m", "ringcomm", "run"]
        local_argv = [*run, "-n", str(world), str(script)]
        spec = ",".join(f"{a}:{args.per_host}" for a in hosts.aliases)
        ssh_argv = [*run, "--ssh-config", str(hosts.ssh_config), "-H", spec, str(script)]
        local_t, ssh_t = [], []
        timed(local_argv), timed(ssh_argv)  # warm caches
        for _ in range(args.repeats):
            local_t.append(timed(local_argv))
            ssh_t.append(timed(ssh_argv))
        lm, sm = statistics.median(local_t), statistics.median(ssh_t)
        print(
            f"# ringcomm run, W={world} ({args.per_host} per host, {args.mode}), "
            f"{args.repeats} alternating repeats, medians"
        )
        print(f"local -n {world}: {lm:.2f} s   (all: {', '.join(f'{t:.2f}' for t in local_t)})")
        print(f"ssh -H {spec}: {sm:.2f} s   (all: {', '.join(f'{t:.2f}' for t in ssh_t)})")
        print(f"ssh / local: {sm / lm:.2f}x")


if __name__ == "__main__":
    main()
