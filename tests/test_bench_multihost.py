"""``ringcomm bench --hostfile / -H`` across real hosts: network namespaces with their own
hostnames and sshd (``benchmarks/netns_hosts.py``, started once for the module, rate none).

Each test runs the bench CLI as a child process, as a user would, over 2 hosts; the table
must have a row for every size with 0 wrong values, the ranks must report the hostnames of
different namespaces, and ``--compare gloo|mpi`` must give their rows too. The fixture's
finalizer stops the test bed and checks that no namespace, link or process is left.
Skipped with the reason where namespaces cannot be made (not root, no ``ip netns``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import netns_hosts  # noqa: E402

PREFIX = "rctest"
SUBNET = "10.76.0"  # not the default bed's 10.77.0: a user's bed may be up
pytestmark = [pytest.mark.needs_ssh, pytest.mark.timeout(120)]


def _leftovers() -> list[str]:
    namespaces, links, bridge = netns_hosts._names(PREFIX)
    out = namespaces + links
    shown = subprocess.run(["ip", "link", "show", bridge], capture_output=True, check=False)
    if shown.returncode == 0:
        out.append(bridge)
    if (netns_hosts.STATE_ROOT / PREFIX).exists():
        out.append(str(netns_hosts.STATE_ROOT / PREFIX))
    return out


@pytest.fixture(scope="module")
def bed() -> Iterator[netns_hosts.Testbed]:
    why = netns_hosts.unavailable()
    if why is not None:
        pytest.skip(f"network-namespace hosts: {why}")
    testbed = netns_hosts.start(hosts=2, rate="none", prefix=PREFIX, slots=2, subnet=SUBNET)
    try:
        yield testbed
    finally:
        netns_hosts.stop(PREFIX)
    assert _leftovers() == [], "the test bed left something behind"


def _bench(bed: netns_hosts.Testbed, tmp_path: Path, *args: str) -> tuple[str, list[Any]]:
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("GLOO_SOCKET_IFNAME", None)  # each host finds its own interface
    argv = [
        sys.executable,
        "-m",
        "ringcomm",
        "bench",
        *args,
        "--ssh-config",
        str(bed.ssh_config),
        "--iters",
        "2",
        "--warmup",
        "1",
        "--check",
        "-q",
        "--json",
        str(out),
    ]
    res = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100, check=False
    )
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return res.stdout, rows


def _check_rows(rows: list[Any], impls: set[str], sizes: list[int], world: int) -> None:
    assert {r["impl"] for r in rows} == impls
    for impl in impls:
        mine = [r for r in rows if r["impl"] == impl]
        assert [r["bytes"] for r in mine] == sizes, impl
        assert all(r["errors"] == 0 for r in mine), mine
        assert all(r["world_size"] == world and r["time_us"] > 0 for r in mine)


def test_bench_across_two_hosts(bed: netns_hosts.Testbed, tmp_path: Path) -> None:
    stdout, rows = _bench(
        bed, tmp_path, "all_reduce", "-H", "h0:1,h1:1", "-b", "8", "-e", "4K", "-f", "8"
    )
    _check_rows(rows, {"ringcomm"}, [8, 64, 512, 4096], 2)
    assert "# ranks 0 on h0; 1 on h1 (2 hosts)" in stdout, stdout
    assert "Out of bounds values : 0 OK" in stdout


def test_hostfile_two_ranks_per_host(bed: netns_hosts.Testbed, tmp_path: Path) -> None:
    stdout, rows = _bench(
        bed,
        tmp_path,
        "all_gather",
        "--hostfile",
        str(bed.hostfile),
        "-b",
        "64",
        "-e",
        "1K",
        "-f",
        "4",
    )
    _check_rows(rows, {"ringcomm"}, [64, 256, 1024], 4)
    assert "# ranks 0-1 on h0; 2-3 on h1 (2 hosts)" in stdout, stdout


@pytest.mark.needs_torch
def test_compare_gloo_across_hosts(bed: netns_hosts.Testbed, tmp_path: Path) -> None:
    stdout, rows = _bench(
        bed,
        tmp_path,
        "all_reduce",
        "-H",
        "h0:1,h1:1",
        "-b",
        "1K",
        "-e",
        "64K",
        "-f",
        "64",
        "--compare",
        "gloo",
    )
    _check_rows(rows, {"ringcomm", "gloo"}, [1024, 65536], 2)
    assert "ringcomm/gloo busbw ratio" in stdout


@pytest.mark.needs_mpi
def test_compare_mpi_across_hosts(bed: netns_hosts.Testbed, tmp_path: Path) -> None:
    stdout, rows = _bench(
        bed,
        tmp_path,
        "reduce_scatter",
        "-H",
        "h0:1,h1:1",
        "-b",
        "1K",
        "-e",
        "64K",
        "-f",
        "64",
        "--compare",
        "mpi",
        "--rounds",
        "1",
    )
    _check_rows(rows, {"ringcomm", "mpi"}, [1024, 65536], 2)
    assert "ringcomm/mpi busbw ratio" in stdout


def test_placement_line_and_records() -> None:
    from ringcomm.bench.multihost import MARK, parse_records
    from ringcomm.cli.bench import placement_line

    assert placement_line(["a", "a", "b"]).startswith("# ranks 0-1 on a; 2 on b (2 hosts)")
    lines = [
        f"[1] {MARK}" + json.dumps({"rank": 1, "hostname": "b", "records": [{"x": 1}]}),
        "[0] other output",
        f"[0] {MARK}" + json.dumps({"rank": 0, "hostname": "a", "records": []}),
    ]
    assert parse_records(lines, 2) == ([[], [{"x": 1}]], ["a", "b"])
    with pytest.raises(RuntimeError, match="rank"):
        parse_records(lines[:2], 2)


def test_launcher_and_mpirun_argv() -> None:
    from ringcomm.bench.multihost import HostsSpec, config_from_json, launcher_argv, mpi_hosts_args
    from ringcomm.bench.spec import BenchConfig

    hosts = HostsSpec(None, "a:2,b:1", "/cfg", None, (("a", 2), ("b", 1)))
    config = BenchConfig(op="all_reduce", world_size=3, multihost=True, devices=("host",))
    argv = launcher_argv(config, hosts)
    assert argv[1:6] == ["-m", "ringcomm", "run", "-H", "a:2,b:1"]
    assert argv[argv.index("--ssh-config") + 1] == "/cfg" and argv[argv.index("-n") + 1] == "3"
    assert argv[-3:-1] == ["-m", "ringcomm.bench.multihost"]
    assert config_from_json(argv[-1]) == config  # the config travels whole
    mpi = mpi_hosts_args(hosts, if_include="10.1.2.0/24")
    assert mpi[mpi.index("--host") + 1] == "a:2,b:1"
    assert "ssh -T -x -o BatchMode=yes -F /cfg" in mpi
    assert mpi[mpi.index("btl_tcp_if_include") + 1] == "10.1.2.0/24"
