"""Hierarchical collectives (ringcomm.collectives.hierarchy) on pretend hosts: each rank's
``RINGCOMM_HOST_ID`` says which host it is on, so ranks of different "hosts" talk over
tcp:// and share no memory, ranks of one host use their workspace. The matrix
(tests/scripts/hier_check.py): all_reduce over dtypes x ops x counts 0, 1, M-1, M, M+1,
2M+1, 1000, 100003 (M: pieces, the most ranks on one host); reduce_scatter, all_gather,
broadcast (every source at some counts) and barrier over dtypes x ops x counts 0, 1, M+1,
7, 1000, 20001 and a 2-d row; against NumPy; integers exact; every rank's result
bit-identical; the hierarchical path really taken (or not, when flat)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from ringcomm.collectives.hierarchy import MIN_STEP_S, step_s
from ringcomm.core.deadline import Deadline
from ringcomm.schedule.topology import hier_plan, piece_bounds, topology

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "hier_check.py"
sys.path.insert(0, str(REPO / "benchmarks"))
import netns_hosts  # noqa: E402

ALL_REDUCE = "all_reduce"
OTHERS = "reduce_scatter,all_gather,broadcast,barrier"


def _run(
    hosts: list[int],
    algo: str,
    *launch: str,
    segment_bytes: int | None = None,
    collectives: str = ALL_REDUCE,
) -> str:
    where = list(launch) or ["-n", str(len(hosts))]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if segment_bytes is not None:
        env["HIER_SEGMENT_BYTES"] = str(segment_bytes)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringcomm",
            "run",
            *where,
            str(SCRIPT),
            "real" if launch else ",".join(map(str, hosts)),
            algo,
            collectives,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("hosts", "algo", "segment_bytes"),
    [
        ([0, 0, 1, 1], "auto", None),  # 2 hosts x 2
        ([0, 0, 1, 1], "auto", 4096),  # segments of 4 KiB: many overlapped segments
        ([0, 0, 0, 1, 1, 1], "hier", 4096),  # 2 hosts x 3, segments
        ([0, 1, 0, 1], "hier", None),  # a launcher's round-robin order: hosts not contiguous
        ([0, 0, 0, 1], "auto", None),  # uneven: 3 + 1
        ([0, 1, 1, 2, 2, 2], "hier", None),  # 3 hosts: 1 + 2 + 3
        ([0, 0, 1, 1], "ring", None),  # the flat ring stays an option
    ],
)
def test_the_all_reduce_matrix_on_pretend_hosts(
    hosts: list[int], algo: str, segment_bytes: int | None
) -> None:
    _check(_run(hosts, algo, segment_bytes=segment_bytes), hosts, algo)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("hosts", "algo", "segment_bytes"),
    [
        ([0, 0, 1], "hier", 4096),  # uneven 2 + 1, segments of 4 KiB
        ([0, 0, 0, 1, 2, 2], "hier", None),  # 3 hosts: 3 + 1 + 2
        ([0, 1, 1, 1], "auto", None),  # 1 + 3
        ([0, 0, 1, 1], "auto", 16384),  # 2 hosts x 2: overlapped segments
        ([0, 1, 0, 1], "hier", None),  # round-robin ranks, hosts of one size
        ([0, 1, 1, 0, 2], "hier", None),  # not contiguous, uneven: 2 + 2 + 1
        ([0, 0, 1, 1], "ring", None),  # the flat algorithms by name
        ([0, 0, 1], "env", None),  # RINGCOMM_ALGO=ring: flat
    ],
)
def test_the_other_collectives_on_pretend_hosts(
    hosts: list[int], algo: str, segment_bytes: int | None
) -> None:
    stdout = _run(hosts, algo, segment_bytes=segment_bytes, collectives=OTHERS)
    _check(stdout, hosts, algo, OTHERS)


@pytest.mark.timeout(300)
def test_the_flat_rings_walk_the_hosts_in_order() -> None:
    # A launcher's round-robin placement (h0 h1 h0 h1 h2): the flat ring algorithms and the
    # broadcast chain visit the ranks host by host (0 2 1 3 4), each host boundary crossed
    # once; every result still right and bit-identical.
    hosts = [0, 1, 0, 1, 2]
    every = f"{ALL_REDUCE},{OTHERS}"
    stdout = _run(hosts, "ring", collectives=every)
    _check(stdout, hosts, "ring", every)
    order = topology([str(h) for h in hosts]).ring_order
    assert order == (0, 2, 1, 3, 4)
    right = {order[k]: order[(k + 1) % len(order)] for k in range(len(order))}
    peers = re.findall(r"^\[\d+\] PEERS (\d+) (\S+) \[(.*)\]$", stdout, re.MULTILINE)
    seen = defaultdict(set)
    for rank, name, sent_to in peers:
        assert sent_to == str(right[int(rank)]), (rank, name, sent_to)
        seen[name].add(int(rank))
    for name in ("all_reduce:ring", "reduce_scatter:ring", "all_gather:ring"):
        assert seen[name] == set(range(5)), seen
    assert seen["broadcast:chain"] == {0, 2, 1, 3}, seen  # the chain from 0 ends at 4


def _netns_run(
    tmp_path: Path,
    hosts: int,
    slots: str,
    ranks: list[int],
    collectives: str,
    prefix: str,
    subnet: str,
) -> str:
    """The matrix on real hosts (network namespaces with sshd, benchmarks/netns_hosts.py);
    ``slots``: the hostfile's lines' slots, e.g. "2,1,2"."""
    why = netns_hosts.unavailable()
    if why is not None:
        pytest.skip(f"network-namespace hosts: {why}")
    bed = netns_hosts.start(hosts=hosts, rate="none", prefix=prefix, slots=2, subnet=subnet)
    try:
        hostfile = tmp_path / "hosts"
        hostfile.write_text("".join(f"h{h} slots={s}\n" for h, s in enumerate(slots.split(","))))
        stdout = _run(
            ranks,
            "auto",
            "--hostfile",
            str(hostfile),
            "--ssh-config",
            str(bed.ssh_config),
            collectives=collectives,
        )
    finally:
        netns_hosts.stop(prefix)
    topo = re.findall(r"^\[\d+\] TOPO (\d+) (\(.*?\)) ", stdout, re.MULTILINE)
    assert {t for _, t in topo} == {str(tuple(ranks))}, topo  # the hosts as ringcomm saw them
    return stdout


@pytest.mark.needs_ssh
@pytest.mark.timeout(300)
def test_the_all_reduce_matrix_on_three_netns_hosts(tmp_path: Path) -> None:
    # 2 + 1 + 2 ranks
    stdout = _netns_run(tmp_path, 3, "2,1,2", [0, 0, 1, 2, 2], ALL_REDUCE, "rchier", "10.75.0")
    _check(stdout, [0, 0, 1, 2, 2], "auto")


@pytest.mark.needs_ssh
@pytest.mark.timeout(300)
def test_the_other_collectives_on_two_netns_hosts(tmp_path: Path) -> None:
    # 2 + 1 ranks: the uneven pieces over real tcp:// between namespaces
    stdout = _netns_run(tmp_path, 2, "2,1", [0, 0, 1], OTHERS, "rchier2", "10.76.0")
    _check(stdout, [0, 0, 1], "auto", OTHERS)


def _check(stdout: str, hosts: list[int], algo: str, collectives: str = ALL_REDUCE) -> None:
    """Every rank done, nothing wrong, the path expected, every case bit-identical."""
    n = len(hosts)
    done = re.findall(r"^\[\d+\] DONE (\d+) bad=(\d+) hier=(\S+)$", stdout, re.MULTILINE)
    assert sorted(int(r) for r, _, _ in done) == list(range(n)), stdout[-2000:]
    assert all(bad == "0" for _, bad, _ in done), [
        line for line in stdout.splitlines() if "CASE" in line and " 0 " in line
    ][:10]
    flat = algo in ("ring", "env")
    for _, _, hier in done:
        calls = {k: int(v) for k, v in (kv.split(":") for kv in hier.split(","))}
        for name in collectives.split(","):
            # barrier: 12 rounds; the rest: hundreds of cases each
            assert (calls[name] == 0) if flat else (calls[name] >= 12), (name, calls)
    digests: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for _, dtype, op, count, ok, digest in re.findall(
        r"^\[\d+\] CASE (\d+) (\S+) (\S+) (\S+) ([01]) (\w+)$", stdout, re.MULTILINE
    ):
        assert ok == "1", (dtype, op, count)
        digests[(dtype, op, count)].add(digest)
    want_cases = 250 if collectives == ALL_REDUCE else 400
    assert len(digests) > want_cases, len(digests)
    assert all(len(d) == 1 for d in digests.values()), [
        k for k, d in digests.items() if len(d) > 1
    ][:5]
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

    with rc.init_process_group(0, 1, master_addr="127.0.0.1", master_port=0) as pg:
        for name, call in [
            ("all_reduce", lambda: pg.all_reduce(np.ones(3), algo="hier")),
            ("reduce_scatter", lambda: pg.reduce_scatter(np.ones((1, 3)), algo="hier")),
            ("all_gather", lambda: pg.all_gather(np.ones(3), algo="hier")),
            ("broadcast", lambda: pg.broadcast(np.ones(3), algo="hier")),
            ("barrier", lambda: pg.barrier(algo="hier")),
        ]:
            with pytest.raises(ValueError, match=f"{name}: algo 'hier' needs a group spanning"):
                call()
        # asynchronous calls stay flat: "hier" then leaves the choice to the flat rules
        assert pg.all_gather(np.ones(3), async_op=True, algo="hier").wait().shape == (1, 3)


def test_the_steps_of_a_hierarchical_call_share_its_deadline() -> None:
    # Each step gets what is left of the call's timeout_s (not the whole of it again), and
    # at least MIN_STEP_S once it has passed: the call ends within its timeout_s.
    deadline = Deadline(5.0)
    left = step_s(deadline)
    assert 4.0 < left <= 5.0
    assert step_s(deadline) <= left  # what is left, never more
    assert not deadline.expired()
    passed = Deadline(5.0, start=time.monotonic() - 6.0)  # the deadline has passed
    assert passed.expired() and passed.remaining() < 0
    assert step_s(passed) == MIN_STEP_S
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Deadline(0.0)
