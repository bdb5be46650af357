"""A multi-host test bed on one machine: network-namespace "hosts" with sshd.

    python benchmarks/netns_hosts.py start [--hosts 2] [--rate 1gbit|10gbit|none] [--prefix rc]
    python benchmarks/netns_hosts.py status [--prefix rc]
    python benchmarks/netns_hosts.py stop [--prefix rc]

``start`` makes H namespaces ``{prefix}h0..`` (needs root and ``ip netns add``). Each has:

* its own hostname ``h0``, ``h1``, ... (sshd runs under ``unshare --uts``, so every session
  it starts, hence every rank, sees that hostname: ringcomm treats them as different hosts
  and talks tcp:// between them);
* a veth pair: ``eth0`` inside, ``{prefix}v{i}`` in the root namespace on the bridge
  ``{prefix}br`` (10.77.0.1/24, ``--subnet``); host i is 10.77.0.(10+i); loopback up;
* with ``--rate R``: ``tc qdisc add dev VETH root tbf rate R burst 256kb latency 20ms`` on
  both ends of the veth (each direction of the link shaped; netem is not needed);
* an sshd on port 22 of its address, key-only (a key pair generated in the state dir).

The state dir ``/tmp/ringcomm-netns/{prefix}/`` holds the keys, ``ssh_config`` (``Host h0``
... with ``HostName``, ``StrictHostKeyChecking no``), ``hostfile`` (``h0 slots=2`` ...),
``env.sh`` and the sshd logs and pids. The namespaces share this machine's filesystem, so
the same python (venv) and checkout work on every "host". ``start`` first stops what an
earlier start of the same prefix left, so it is safe to re-run; ``stop`` removes
everything (sshd and every process in the namespaces, the namespaces, the bridge, the
state dir) and is safe when nothing is there.

Python API (tests use it as a fixture)::

    bed = start(hosts=2, rate="none")   # -> Testbed(.hostfile, .ssh_config, .addresses, ...)
    ...
    stop()                              # or bed.stop()
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

STATE_ROOT = Path("/tmp/ringcomm-netns")
SUBNET = "10.77.0"  # the default /24; the bridge is .1, host i is .(10+i)
RATES = ("none", "1gbit", "10gbit")
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
__all__ = ["Testbed", "main", "start", "status", "stop", "unavailable"]


@dataclass
class Testbed:
    """What :func:`start` made."""

    prefix: str
    state_dir: Path
    hostfile: Path
    ssh_config: Path
    identity: Path
    hostnames: list[str] = field(default_factory=list)  # h0, h1, ... (ssh aliases too)
    addresses: list[str] = field(default_factory=list)  # 10.77.0.10, ...
    namespaces: list[str] = field(default_factory=list)
    interface: str = "eth0"  # the veth end inside every namespace
    subnet: str = f"{SUBNET}.0/24"
    rate: str = "none"

    def env(self) -> dict[str, str]:
        """Variables to export so the bench and launcher find the test bed."""
        return {
            "RINGCOMM_NETNS_HOSTFILE": str(self.hostfile),
            "RINGCOMM_NETNS_SSH_CONFIG": str(self.ssh_config),
            "GLOO_SOCKET_IFNAME": self.interface,
        }

    def exec_argv(self, host: int, *argv: str) -> list[str]:
        """Run ``argv`` in host ``host``'s namespace with its hostname."""
        script = f'hostname {self.hostnames[host]} && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.namespaces[host],
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            script,
            "sh",
            *argv,
        ]

    def stop(self) -> None:
        stop(self.prefix)


def unavailable() -> str | None:
    """Why the test bed cannot start here (None: it can)."""
    for tool in ("ip", "tc", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, util-linux, openssh-client)"
    if not os.path.exists(SSHD):
        return "needs sshd (openssh-server)"
    if os.geteuid() != 0:
        return "needs root (ip netns add, sshd)"
    probe = f"rcprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if res.returncode != 0:
        return f"'ip netns add' is not permitted here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def _run(*argv: str) -> None:
    res = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {res.stderr.strip()}")


def _quiet(*argv: str) -> str:
    res = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)
    return res.stdout


def _check_prefix(prefix: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
        raise ValueError(f"--prefix must be 1-8 lowercase letters/digits, got {prefix!r}")


def _names(prefix: str) -> tuple[list[str], list[str], str]:
    """Namespaces and root-side veths of ``prefix`` that exist now, and its bridge name."""
    ns = [
        line.split()[0]
        for line in _quiet("ip", "netns", "list").splitlines()
        if line.split() and re.fullmatch(rf"{prefix}h\d+", line.split()[0])
    ]
    links = []
    for line in _quiet("ip", "-o", "link", "show").splitlines():
        parts = line.split(":")
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if re.fullmatch(rf"{prefix}v\d+", name):
                links.append(name)
    return sorted(ns), sorted(links), f"{prefix}br"


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop(prefix: str = "rc") -> None:
    """Remove everything a :func:`start` of ``prefix`` made (safe when nothing is there)."""
    _check_prefix(prefix)
    state = STATE_ROOT / prefix
    namespaces, links, bridge = _names(prefix)
    for ns in namespaces:  # sshd, its sessions, and anything else started in there
        for _ in range(3):
            pids = [int(p) for p in _quiet("ip", "netns", "pids", ns).split()]
            if not pids:
                break
            for pid in pids:
                _kill_pid(pid)
            time.sleep(0.1)
    for pidfile in state.glob("sshd_*.pid") if state.is_dir() else []:
        try:
            _kill_pid(int(pidfile.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
    for link in links:
        subprocess.run(["ip", "link", "del", link], check=False, capture_output=True)
    subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)
    shutil.rmtree(state, ignore_errors=True)
    if STATE_ROOT.is_dir() and not any(STATE_ROOT.iterdir()):
        STATE_ROOT.rmdir()


def _shape(dev: str, rate: str, ns: str | None = None) -> None:
    pre = ["ip", "netns", "exec", ns] if ns else []
    _run(
        *pre,
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        "256kb",
        "latency",
        "20ms",
    )


def _sshd_config(state: Path, address: str, i: int) -> str:
    return "\n".join(
        [
            "Port 22",
            f"ListenAddress {address}",
            f"HostKey {state / 'hostkey'}",
            f"PidFile {state / f'sshd_{i}.pid'}",
            f"AuthorizedKeysFile {state / 'authorized_keys'}",
            "StrictModes no",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "PermitRootLogin prohibit-password",
            "MaxStartups 200",
            "MaxSessions 200",
            "ClientAliveInterval 5",
            "ClientAliveCountMax 3",
            "UseDNS no",
            "PrintMotd no",
            "X11Forwarding no",
            f"SetEnv PATH={os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
            "LogLevel ERROR",
            "",
        ]
    )


def _client_config(bed: Testbed) -> str:
    lines = []
    for name, addr in zip(bed.hostnames, bed.addresses):
        lines += [
            f"Host {name} {addr}",
            f"  HostName {addr}",
            "  Port 22",
            "  User root",
            f"  IdentityFile {bed.identity}",
            "  IdentitiesOnly yes",
            "  StrictHostKeyChecking no",
            "  UserKnownHostsFile /dev/null",
            "  BatchMode yes",
            "  LogLevel ERROR",
        ]
    return "\n".join(lines) + "\n"


def _wait_listening(address: str, log: Path, popen: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20.0
    while True:
        if popen.poll() is not None:
            raise RuntimeError(
                f"sshd on {address} exited {popen.returncode}: {log.read_text(errors='replace')}"
            )
        try:
            with socket.create_connection((address, 22), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"sshd not listening on {address}:22") from None
            time.sleep(0.05)


def start(
    hosts: int = 2, rate: str = "none", prefix: str = "rc", slots: int = 2, subnet: str = SUBNET
) -> Testbed:
    """Make the test bed (see the module docstring); stop what an earlier start left first.

    ``subnet``: the first three octets of its /24 (two test beds at once need two prefixes
    and two subnets). On any failure everything made so far is removed before the error
    propagates.
    """
    _check_prefix(prefix)
    if not 1 <= hosts <= 200:
        raise ValueError(f"hosts must be in 1..200, got {hosts}")
    if rate not in RATES and not re.fullmatch(r"\d+(\.\d+)?[kmg]?(bit|bps)", rate):
        raise ValueError(f"rate must be one of {', '.join(RATES)} (or a tc rate), got {rate!r}")
    if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
        raise ValueError(f"subnet must look like 10.77.0, got {subnet!r}")
    why = unavailable()
    if why:
        raise RuntimeError(f"netns test bed: {why}")
    used = _quiet("ip", "-o", "-4", "addr")
    if f" {subnet}." in used and f"{prefix}br" not in used:
        raise RuntimeError(f"subnet {subnet}.0/24 is in use by another interface")
    stop(prefix)
    state = STATE_ROOT / prefix
    try:
        return _start(hosts, rate, prefix, slots, state, subnet)
    except BaseException:
        stop(prefix)
        raise


def _start(hosts: int, rate: str, prefix: str, slots: int, state: Path, net: str) -> Testbed:
    state.mkdir(parents=True, mode=0o700)
    bed = Testbed(
        prefix,
        state,
        state / "hostfile",
        state / "ssh_config",
        state / "id_ed25519",
        subnet=f"{net}.0/24",
        rate=rate,
    )
    for key in (bed.identity, state / "hostkey"):
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ringcomm-netns", "-f", str(key))
    shutil.copy(f"{bed.identity}.pub", state / "authorized_keys")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
    bridge = f"{prefix}br"
    _run("ip", "link", "add", bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{net}.1/24", "dev", bridge)
    _run("ip", "link", "set", bridge, "up")
    for i in range(hosts):
        ns, veth, peer = f"{prefix}h{i}", f"{prefix}v{i}", f"{prefix}p{i}"
        addr = f"{net}.{10 + i}"
        _run("ip", "netns", "add", ns)
        bed.namespaces.append(ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", ns)
        _run("ip", "-n", ns, "link", "set", peer, "name", bed.interface)
        _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", bed.interface)
        _run("ip", "-n", ns, "link", "set", bed.interface, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "set", veth, "master", bridge)
        _run("ip", "link", "set", veth, "up")
        if rate != "none":
            _shape(veth, rate)
            _shape(bed.interface, rate, ns)
        bed.hostnames.append(f"h{i}")
        bed.addresses.append(addr)
    for i, addr in enumerate(bed.addresses):
        conf = state / f"sshd_{i}.conf"
        conf.write_text(_sshd_config(state, addr, i))
        log_path = state / f"sshd_{i}.log"
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                bed.exec_argv(i, SSHD, "-D", "-e", "-f", str(conf)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # outlives `start` (the CLI exits; stop kills it)
            )
        _wait_listening(addr, log_path, popen)
    bed.ssh_config.write_text(_client_config(bed))
    (state / "subnet").write_text(net + "\n")
    bed.hostfile.write_text("".join(f"{h} slots={slots}\n" for h in bed.hostnames))
    (state / "env.sh").write_text("".join(f"export {k}={v}\n" for k, v in bed.env().items()))
    return bed


def status(prefix: str = "rc") -> str:
    """One line per namespace (and whether its sshd answers); "" when nothing is up."""
    _check_prefix(prefix)
    namespaces, links, _ = _names(prefix)
    if not namespaces and not links and not (STATE_ROOT / prefix).exists():
        return ""
    lines = [
        f"state dir {STATE_ROOT / prefix}"
        + ("" if (STATE_ROOT / prefix).exists() else " (missing)")
    ]
    net = SUBNET
    try:
        net = (STATE_ROOT / prefix / "subnet").read_text().strip()
    except OSError:
        pass
    for ns in namespaces:
        i = int(ns[len(prefix) + 1 :])
        addr = f"{net}.{10 + i}"
        try:
            with socket.create_connection((addr, 22), timeout=1.0):
                sshd = "sshd up"
        except OSError:
            sshd = "sshd DOWN"
        qdisc = _quiet("tc", "qdisc", "show", "dev", f"{prefix}v{i}").split("\n")[0].strip()
        npids = len(_quiet("ip", "netns", "pids", ns).split())
        lines.append(f"{ns}: h{i} {addr} {sshd}, {npids} process(es); {qdisc}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="netns_hosts.py", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    p.add_argument("--slots", type=int, default=2, help="slots per host in the hostfile")
    p.add_argument("--rate", default="none", help="link rate: 1gbit, 10gbit or none")
    p.add_argument("--prefix", default="rc", help="name prefix of namespaces and links")
    p.add_argument("--subnet", default=SUBNET, help="first three octets of the /24 (10.77.0)")
    args = p.parse_args(argv)
    if args.action == "stop":
        stop(args.prefix)
        print(f"stopped {args.prefix}")
        return 0
    if args.action == "status":
        text = status(args.prefix)
        print(text or f"{args.prefix}: not running")
        return 0 if text else 1
    try:
        bed = start(args.hosts, args.rate, args.prefix, args.slots, args.subnet)
    except (RuntimeError, ValueError) as exc:
        print(f"netns_hosts.py: error: {exc}", file=sys.stderr)
        return 1
    hosts = ", ".join(f"{h}={a}" for h, a in zip(bed.hostnames, bed.addresses))
    print(f"# {len(bed.hostnames)} hosts ({hosts}), rate {bed.rate}, interface {bed.interface}")
    print(f"hostfile:   {bed.hostfile}")
    print(f"ssh_config: {bed.ssh_config}")
    for k, v in bed.env().items():
        print(f"export {k}={v}")
    print(
        f"# e.g. ringcomm bench all_reduce --hostfile {bed.hostfile} --ssh-config "
        f"{bed.ssh_config} -b 1M -e 64M --compare mpi"
    )
    print(f"# stop: python {sys.argv[0]} stop --prefix {bed.prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
