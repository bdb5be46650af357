"""``ringcomm bench OP --hostfile F | -H h1:2,h2:2 [--ssh-config F]``: the sweep across hosts.

The same sweep, table and ``--compare`` as on one host; only how the ranks start differs:

* **ringcomm** (and Gloo with ``--compare gloo``, in the same processes): one job of the ssh
  launcher (``ringcomm run --hostfile ... -m ringcomm.bench.multihost CONFIG``, a child
  process, so the launcher's preflight, token, supervision and teardown are all reused).
  Every rank runs :func:`~ringcomm.bench.collectives.rank_main` and prints one line
  ``RINGCOMM-BENCH-RECORDS {"rank", "hostname", "records"}`` on its stdout, which the
  launcher copies back prefixed ``[rank]``: the records travel over ssh, no shared
  filesystem needed. Every other line goes to the bench's stderr.
* **MPI** (``--compare mpi``): per round, one ringcomm job then one ``mpirun --host
  h1:2,h2:2`` job (ssh through ``plm_rsh_agent "ssh -F CONFIG"``; TCP BTL on the hosts'
  interfaces, see :func:`mpi_hosts_args`); rank 0 prints the gathered records on stdout.

Gloo across hosts: the store is served by rank 0 at ``MASTER_ADDR``, and each rank sets
``GLOO_SOCKET_IFNAME`` (unless the bench's environment sets it, which is then passed on)
to the interface holding the address it reaches ``MASTER_ADDR`` from
(:func:`interface_towards`): hostnames of test-bed hosts may resolve to 127.0.0.1, so
Gloo's default choice (the hostname's address) would be loopback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ringcomm.bench.mpi import MPI_TCP_ARGS, mpirun_command
from ringcomm.bench.report import Result, aggregate, merge_rounds
from ringcomm.bench.spec import BenchConfig
from ringcomm.bench.sweep import MARK, Record
from ringcomm.config import bench_mpi_interfaces, env_master_addr, environment

if TYPE_CHECKING:
    from ringcomm.group import ProcessGroup

__all__ = [
    "MARK",
    "HostsSpec",
    "interface_towards",
    "launcher_argv",
    "mpi_hosts_args",
    "network_towards",
    "parse_records",
    "report",
    "run",
    "run_collecting",
]


@dataclass(frozen=True)
class HostsSpec:
    """Where the ranks run: ``--hostfile`` or ``-H``, ``-n``, ``--ssh-config`` (parsed)."""

    hostfile: str | None
    hosts_option: str | None
    ssh_config: str | None
    nproc: int | None
    placement: tuple[tuple[str, int], ...]  # (host, ranks there), in rank order

    @property
    def world_size(self) -> int:
        return sum(n for _, n in self.placement)

    def describe(self) -> str:
        return ", ".join(f"{h}:{n}" for h, n in self.placement)


def launcher_argv(config: BenchConfig, hosts: HostsSpec) -> list[str]:
    """The ``ringcomm run`` argv of one ringcomm job of ``config`` on ``hosts`` (pure but
    for the environment it forwards)."""
    argv = [sys.executable, "-m", "ringcomm", "run"]
    if hosts.hostfile is not None:
        argv += ["--hostfile", hosts.hostfile]
    else:
        assert hosts.hosts_option is not None
        argv += ["-H", hosts.hosts_option]
    if hosts.ssh_config is not None:
        argv += ["--ssh-config", hosts.ssh_config]
    argv += ["-n", str(hosts.world_size)]
    if config.bind is not None:
        argv += ["--env", f"RINGCOMM_BIND={config.bind}"]
    if "GLOO_SOCKET_IFNAME" in environment():
        argv += ["--env", "GLOO_SOCKET_IFNAME"]
    argv += ["-m", "ringcomm.bench.multihost", json.dumps(dataclasses.asdict(config))]
    return argv


def parse_records(lines: Sequence[str], world_size: int) -> tuple[list[list[Record]], list[str]]:
    """Per-rank records and hostnames from the launcher's output lines (``[r] MARK{...}``)."""
    per_rank: list[list[Record] | None] = [None] * world_size
    hostnames = [""] * world_size
    for line in lines:
        _, sep, payload = line.partition(MARK)
        if not sep:
            continue
        msg = json.loads(payload)
        rank = int(msg["rank"])
        per_rank[rank] = msg["records"]
        hostnames[rank] = str(msg["hostname"])
    missing = [r for r, recs in enumerate(per_rank) if recs is None]
    if missing:
        raise RuntimeError(f"no records from rank(s) {', '.join(map(str, missing))}")
    return [recs or [] for recs in per_rank], hostnames


def run_collecting(argv: list[str], timeout_s: float, what: str) -> tuple[int, list[str]]:
    """Run ``argv``; keep the lines carrying :data:`MARK`, pass the others to stderr
    (also ``ringcomm tune --hostfile``'s probe job, :mod:`ringcomm.tuning.hosts`).

    The child (``ringcomm run`` or ``mpirun``) gets SIGKILL if the bench dies, and its own
    teardown (ssh clients dying with it, remote watchdogs seeing EOF) stops the ranks."""
    from ringcomm.launch.supervise import pdeathsig_preexec

    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=None,
        text=True,
        preexec_fn=pdeathsig_preexec(),  # noqa: PLW1509  (prctl only)
    )
    kept: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if MARK in line:
                kept.append(line)
            else:
                sys.stderr.write(line)
                sys.stderr.flush()

    reader = threading.Thread(target=pump, name="ringcomm-bench-output", daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops every rank (SIGTERM: exit 143)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise RuntimeError(f"{what} timed out after {timeout_s:g} s") from None
    finally:
        reader.join(timeout=10)
    return code, kept


def ringcomm_job(config: BenchConfig, hosts: HostsSpec) -> tuple[list[list[Record]], list[str]]:
    """One ringcomm (+ Gloo) sweep on ``hosts``: per-rank records and hostnames."""
    argv = launcher_argv(config, hosts)
    code, lines = run_collecting(argv, config.timeout_s, "the ringcomm job")
    if code != 0:
        raise RuntimeError(f"the ringcomm job on {hosts.describe()} exited with status {code}")
    return parse_records(lines, config.world_size)


def _host_address(hosts: HostsSpec, host: str) -> str:
    from ringcomm.launch.ssh import SshRunConfig, resolve_hostname

    probe = SshRunConfig(placements=(), target="", ssh_config=hosts.ssh_config)
    return resolve_hostname(probe, host)


def mpi_hosts_args(hosts: HostsSpec, if_include: str | None = None) -> list[str]:
    """mpirun options for ``hosts``: ``--host h:n,...``, ssh with ``--ssh-config``, TCP BTL.

    ``btl_tcp_if_include``/``oob_tcp_if_include``: ``if_include`` (else
    ``RINGCOMM_BENCH_MPI_IF``: interface names or CIDRs), else the network (CIDR) of this
    host's interface towards the first host (``ssh -G``'s HostName), e.g. the test bed's
    10.77.0.0/24: so every host uses the interface on that network, never loopback. (Per-host
    /32s do not work: Open MPI's TCP BTL then mismatches peers.) None found: MPI chooses.
    """
    if if_include is None:
        if_include = bench_mpi_interfaces()
    if if_include is None:
        if_include = network_towards(_host_address(hosts, hosts.placement[0][0]))
    if_args = []
    if if_include is not None:
        if_args = [
            "--mca",
            "btl_tcp_if_include",
            if_include,
            "--mca",
            "oob_tcp_if_include",
            if_include,
        ]
    agent = "ssh -T -x -o BatchMode=yes"
    if hosts.ssh_config is not None:
        agent += f" -F {shlex.quote(hosts.ssh_config)}"
    return [
        "--host",
        ",".join(f"{h}:{n}" for h, n in hosts.placement),
        "--mca",
        "plm_rsh_agent",
        agent,
        *MPI_TCP_ARGS,
        *if_args,
        "-x",
        "PYTHONPATH",
        "--wdir",
        os.getcwd(),
    ]


def mpi_job(config: BenchConfig, hosts: HostsSpec) -> list[list[Record]]:
    """One MPI sweep on ``hosts`` under mpirun; rank 0 prints every rank's records."""
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-mpi-") as tmp:
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            json.dump(dataclasses.asdict(config), f)
        # The config travels on the command line: the remote hosts need not see this file.
        cmd = mpirun_command(config, config_path, "-", hosts_args=mpi_hosts_args(hosts))
        cmd[cmd.index(config_path)] = json.dumps(dataclasses.asdict(config))
        code, lines = run_collecting(cmd, config.timeout_s, "mpirun")
    if code != 0 or not lines:
        raise RuntimeError(f"mpirun exited with status {code}: {shlex.join(cmd)}")
    payload = lines[-1].partition(MARK)[2]
    per_rank: list[list[Record]] = json.loads(payload)
    return per_rank


def run(config: BenchConfig, hosts: HostsSpec) -> tuple[list[Result], list[str]]:
    """The benchmark on ``hosts``: results (as :func:`ringcomm.bench.runner.run`) and the
    hostname every ringcomm rank reported (rank order)."""
    if config.compare != "mpi":
        per_rank, names = ringcomm_job(config, hosts)
        return aggregate(config, per_rank), names
    rounds: list[list[list[Record]]] = []
    hostnames: list[str] = []
    for rnd in range(config.rounds):
        one = dataclasses.replace(config, rounds=1, compare=None, check=config.check and rnd == 0)
        per_rank, hostnames = ringcomm_job(one, hosts)
        rounds.append(per_rank)
        rounds.append(mpi_job(one, hosts))
    return aggregate(config, merge_rounds(rounds)), hostnames


# --------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------


_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B


def _ipv4_of(ifname: str, request: int = _SIOCGIFADDR) -> str | None:
    """The IPv4 address (or with ``_SIOCGIFNETMASK`` the netmask) of ``ifname``."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), request, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def network_towards(addr: str) -> str | None:
    """The network (``a.b.c.d/len``) of this host's interface towards ``addr``; None if
    there is none (no IPv4 route)."""
    import ipaddress

    ifname = interface_towards(addr)
    if ifname is None:
        return None
    local, mask = _ipv4_of(ifname), _ipv4_of(ifname, _SIOCGIFNETMASK)
    if local is None or mask is None:
        return None
    return str(ipaddress.IPv4Network(f"{local}/{mask}", strict=False))


def interface_towards(addr: str) -> str | None:
    """The name of this host's interface holding the address it reaches ``addr`` from
    (the route's source address; on ``addr``'s own host, the interface holding ``addr``,
    not loopback). None if there is no IPv4 route or no such interface."""
    try:
        target = socket.gethostbyname(addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # no packet is sent: it only picks the route
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return None


def config_from_json(text: str) -> BenchConfig:
    fields = json.loads(text)
    fields["devices"] = tuple(fields.get("devices", ("host",)))
    return BenchConfig(**fields)


def main(argv: Sequence[str] | None = None) -> int:
    """On every rank (under ``ringcomm run``): ``python -m ringcomm.bench.multihost CONFIG``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m ringcomm.bench.multihost CONFIG_JSON", file=sys.stderr)
        return 2
    config = config_from_json(args[0])
    import ringcomm as rc
    from ringcomm.bench.collectives import rank_main

    if config.compare == "gloo" and "GLOO_SOCKET_IFNAME" not in environment():
        ifname = interface_towards(env_master_addr())
        if ifname is not None:
            environment()["GLOO_SOCKET_IFNAME"] = ifname
    with rc.init_process_group() as pg:
        report(pg, rank_main(pg, config))
    return 0


def report(pg: ProcessGroup, records: Any) -> None:
    """Print this rank's ``records`` as one marked JSON line (what :func:`run_collecting`
    collects), then wait until every rank has printed its own."""
    msg = {"rank": pg.rank, "hostname": socket.gethostname(), "records": records}
    sys.stdout.write(MARK + json.dumps(msg) + "\n")
    sys.stdout.flush()
    pg.barrier()  # every rank's line is out before any rank leaves


if __name__ == "__main__":
    sys.exit(main())
