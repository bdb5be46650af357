"""Hierarchical all_reduce (ringcomm.hierarchy) on pretend hosts: each rank's
``RINGCOMM_HOST_ID`` says which host it is on, so ranks of different "hosts" talk over
tcp:// and share no memory, ranks of one host use their workspace. The matrix
(tests/scripts/hier_check.py): dtypes x ops x counts 0, 1, M-1, M, M+1, 2M+1, 1000,
100003 (M: pieces, the most ranks on one host), against NumPy; integers exact; every
rank's result bit-identical; the hierarchical path really taken (or not, when flat)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from ringcomm.schedule.topology import hier_plan, piece_bounds, topology

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "hier_check.py"
sys.path.insert(0, str(REPO / "benchmarks"))
import netns_hosts  # noqa: E402


def _run(hosts: list[int], algo: str, *launch: str, segment_bytes: int | None = None) -> str:
    where = list(launch) or ["-n", str(len(hosts))]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if segment_bytes is not None:
        env["HIER_SEGMENT_BYTES"] = str(segment_bytes)
    out = subprocess.run(
        [sys.executable, "-m", "ringcomm", "run", *where, str(SCRIPT),
         "real" if launch else ",".join(map(str, hosts)), algo],
        check=False, capture_output=True, text=True, timeout=240,
        cwd=REPO, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("hosts", "algo", "segment_bytes"), [
    ([0, 0, 1, 1], "auto", None),   # 2 hosts x 2
    ([0, 0, 1, 1], "auto", 4096),   # segments of 4 KiB: many overlapped segments
    ([0, 0, 0, 1, 1, 1], "hier", 4096),  # 2 hosts x 3, segments
    ([0, 1, 0, 1], "hier", None),   # a launcher's round-robin order: hosts not contiguous
    ([0, 0, 0, 1], "auto", None),   # uneven: 3 + 1
    ([0, 1, 1, 2, 2, 2], "hier", None),  # 3 hosts: 1 + 2 + 3
    ([0, 0, 1, 1], "ring", None),   # the flat ring stays an option
])  # fmt: skip
def test_the_all_reduce_matrix_on_pretend_hosts(
    hosts: list[int], algo: str, segment_bytes: int | None
) -> None:
    _check(_run(hosts, algo, segment_bytes=segment_bytes), hosts, algo)


@pytest.mark.needs_ssh
@pytest.mark.timeout(300)
def test_the_all_reduce_matrix_on_three_netns_hosts(tmp_path: Path) -> None:
    # Real hosts (network namespaces with sshd, benchmarks/netns_hosts.py): 2 + 1 + 2 ranks.
    why = netns_hosts.unavailable()
    if why is not None:
        pytest.skip(f"network-namespace hosts: {why}")
    bed = netns_hosts.start(hosts=3, rate="none", prefix="rchier", slots=2, subnet="10.75.0")
    try:
        hostfile = tmp_path / "hosts"
        hostfile.write_text("h0 slots=2\nh1 slots=1\nh2 slots=2\n")
        stdout = _run([0, 0, 1, 2, 2], "auto", "--hostfile", str(hostfile),
                      "--ssh-config", str(bed.ssh_config))  # fmt: skip
    finally:
        netns_hosts.stop("rchier")
    _check(stdout, [0, 0, 1, 2, 2], "auto")
    topo = re.findall(r"^\[\d+\] TOPO (\d+) (\(.*?\)) ", stdout, re.MULTILINE)
    assert {t for _, t in topo} == {"(0, 0, 1, 2, 2)"}, topo  # the hosts as ringcomm saw them


def _check(stdout: str, hosts: list[int], algo: str) -> None:
    """Every rank done, nothing wrong, the path expected, every case bit-identical."""
    n = len(hosts)
    done = re.findall(r"^\[\d+\] DONE (\d+) bad=(\d+) hier_calls=(\d+)$", stdout, re.MULTILINE)
    assert sorted(int(r) for r, _, _ in done) == list(range(n)), stdout[-2000:]
    assert all(bad == "0" for _, bad, _ in done), [line for line in stdout.splitlines()
                                                   if line.startswith("CASE") and " 0 " in line][:10]  # fmt: skip
    calls = {int(c) for _, _, c in done}
    assert (calls == {0}) if algo == "ring" else (min(calls) > 200), calls
    digests: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for _, dtype, op, count, ok, digest in re.findall(
        r"^\[\d+\] CASE (\d+) (\S+) (\S+) (\d+) ([01]) (\w+)$", stdout, re.MULTILINE
    ):
        assert ok == "1", (dtype, op, count)
        digests[(dtype, op, count)].add(digest)
    assert len(digests) > 250 and all(len(d) == 1 for d in digests.values()), [
        k for k, d in digests.items() if len(d) > 1][:5]  # fmt: skip
    topo = topology([str(h) for h in hosts])
    for line in re.findall(r"^\[\d+\] TOPO (\d+) .*$", stdout, re.MULTILINE):
        assert int(line) < n
    assert len(topo.ring_order) == n


def test_the_topology_and_the_pieces() -> None:
    topo = topology(["b", "a", "b", "a", "c"])
    assert topo.hosts == ((0, 2), (1, 3), (4,))
    assert topo.host_of == (0, 1, 0, 1, 2)
    assert [topo.local_rank(r) for r in range(5)] == [0, 0, 1, 1, 0]
    assert topo.leaders == (0, 1, 4) and topo.ring_order == (0, 2, 1, 3, 4)
    assert topo.max_local_size == 2 and not topo.uniform
    plan = hier_plan(topo)
    assert plan.pieces == 2
    assert plan.owners == ((0, 1, 4), (2, 3, 4))  # host c's one rank owns both pieces
    assert plan.owned_by(4) == [0, 1] and plan.owned_by(2) == [1]
    assert piece_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert piece_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert piece_bounds(0, 2) == [(0, 0), (0, 0)]


def test_hier_on_a_group_it_does_not_fit_is_a_clear_error() -> None:
    import numpy as np

    import ringcomm as rc

    with (rc.init_process_group(0, 1, master_addr="127.0.0.1", master_port=0) as pg,
          pytest.raises(ValueError, match="algo 'hier' needs a group spanning hosts")):  # fmt: skip
        pg.all_reduce(np.ones(3), algo="hier")
