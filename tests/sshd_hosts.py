"""Real sshd "hosts" for the ssh launcher's tests (no mocks).

:class:`SshdHosts` starts one ``sshd -D -e -f CONF`` per host with keys generated in a temp
dir, and writes an ssh_config with ``Host node1..nodeN`` aliases (plus ``unreachable``,
a port nobody listens on) to pass as ``ringcomm run --ssh-config``. Two modes:

* ``loopback``: the hosts listen on 127.0.0.2, 127.0.0.3, ... (no setup; one kernel
  hostname, so ranks talk over ipc:// as on one machine);
* ``netns``: every host is a network namespace with its own hostname (``unshare --uts``),
  joined by veth pairs to a bridge the test creates, addresses in a private /24 that no
  interface of this machine uses; ranks talk over tcp:// between namespaces. Needs root and
  ``ip netns add``; :func:`netns_unavailable` says why not. Namespaces and bridges left by
  a killed run (named after a pid that no longer exists) are removed first.

Teardown stops every sshd, kills whatever its sessions left, and removes what was created.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
_NS_PREFIX = "rcssh"  # namespaces rcssh<pid>n<i>, bridge rcssh<pid>b, veths rcssh<pid>v<i>
_NS_NAME = re.compile(rf"^{_NS_PREFIX}(\d+)[nbv]\d*$")


def sshd_unavailable() -> str | None:
    """Why real-sshd tests cannot run here (None: they can)."""
    if not os.path.exists(SSHD) or shutil.which("ssh") is None or not shutil.which("ssh-keygen"):
        return "needs openssh-server and openssh-client (sshd, ssh, ssh-keygen)"
    if os.geteuid() != 0:
        return "needs root (sshd privilege separation, logging in as the test user)"
    return None


def netns_unavailable() -> str | None:
    """Why the netns mode cannot run here (None: it can)."""
    why = sshd_unavailable()
    if why:
        return why
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2 (ip) and util-linux (unshare)"
    probe = f"{_NS_PREFIX}{os.getpid()}n99"
    res = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if res.returncode != 0:
        return f"'ip netns add' is not permitted here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def _run(*argv: str) -> None:
    res = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {res.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def remove_stale_netns() -> None:
    """Remove namespaces and links of earlier runs whose process is gone."""
    res = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            for pid in subprocess.run(
                ["ip", "netns", "pids", name], check=False, capture_output=True, text=True
            ).stdout.split():
                _kill(int(pid))
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    res = subprocess.run(["ip", "-o", "link", "show"], check=False, capture_output=True, text=True)
    for line in res.stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = _NS_NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            subprocess.run(["ip", "link", "del", name], check=False, capture_output=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    return children


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    children = _children_map()
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def processes_with_cmdline(needle: str, *, exclude: tuple[int, ...] = ()) -> list[tuple[int, str]]:
    """(pid, cmdline) of live, non-zombie processes whose command line contains ``needle``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in cmdline and state != "Z":
            found.append((int(name), cmdline))
    return found


def _die_with_parent() -> Callable[[], None] | None:
    """sshd gets SIGKILL if the test process dies (Linux), so a killed run leaves none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return lambda: libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _free_subnet() -> str:
    """A 10.23x.y.0/24 prefix ("10.23x.y") that no interface here uses."""
    used = subprocess.run(
        ["ip", "-o", "-4", "addr"], check=False, capture_output=True, text=True
    ).stdout
    for second in (233, 234, 235):
        for third in range((os.getpid() % 200) + 1, 255):
            prefix = f"10.{second}.{third}"
            if f" {prefix}." not in used:
                return prefix
    raise RuntimeError("no free 10.23x.y.0/24 subnet")


@dataclass
class Host:
    alias: str  # the ssh_config Host name
    address: str  # where its sshd listens (as every other host reaches it)
    port: int
    hostname: str  # what socket.gethostname() says on it
    popen: subprocess.Popen[bytes] | None = None


class SshdHosts:
    """``n`` sshd hosts; use as a context manager. See the module docstring."""

    def __init__(self, root: Path, mode: str = "loopback", n: int = 3) -> None:
        if mode not in ("loopback", "netns"):
            raise ValueError(f"mode must be loopback or netns, got {mode!r}")
        self.root, self.mode, self.n = Path(root), mode, n
        self.hosts: list[Host] = []
        self.ssh_config = self.root / "ssh_config"
        self.identity = self.root / "id_ed25519"
        self._namespaces: list[str] = []
        self._links: list[str] = []
        #: This machine as every host reaches it (netns: the bridge's address).
        self.launcher_address = "127.0.0.1"

    # -- setup ---------------------------------------------------------------------------
    def __enter__(self) -> SshdHosts:  # noqa: PYI034  (a plain class, not subclassed)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation
        for key in (self.identity, self.root / "hostkey"):
            _run(
                "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ringcomm-test", "-f", str(key)
            )
        shutil.copy(f"{self.identity}.pub", self.root / "authorized_keys")
        if self.mode == "netns":
            self._make_netns()
        else:
            for i in range(1, self.n + 1):
                addr = f"127.0.0.{i + 1}"
                self.hosts.append(Host(f"node{i}", addr, _free_port(addr), socket.gethostname()))
        for i, host in enumerate(self.hosts, 1):
            conf = self.root / f"sshd_{i}.conf"
            conf.write_text(self._sshd_config(host, i))
            log = open(self.root / f"sshd_{i}.log", "wb")  # noqa: SIM115  (held by sshd)
            argv = [SSHD, "-D", "-e", "-f", str(conf)]
            if self.mode == "netns":
                ns = self._namespaces[i - 1]
                script = f"hostname {host.hostname} && exec {' '.join(argv)}"
                argv = ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "sh", "-c", script]
            host.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=_die_with_parent(),  # noqa: PLW1509  (prctl only)
            )
            log.close()
        for i, host in enumerate(self.hosts, 1):
            self._wait_listening(host, i)
        self.ssh_config.write_text(self._client_config())

    def _make_netns(self) -> None:
        remove_stale_netns()
        pid = os.getpid()
        prefix = _free_subnet()
        bridge = f"{_NS_PREFIX}{pid}b"
        _run("ip", "link", "add", bridge, "type", "bridge")
        self._links.append(bridge)
        _run("ip", "addr", "add", f"{prefix}.1/24", "dev", bridge)
        self.launcher_address = f"{prefix}.1"
        _run("ip", "link", "set", bridge, "up")
        for i in range(1, self.n + 1):
            ns, veth, peer = f"{_NS_PREFIX}{pid}n{i}", f"{_NS_PREFIX}{pid}v{i}", f"rcpeer{pid}"
            _run("ip", "netns", "add", ns)
            self._namespaces.append(ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer[:15])
            self._links.append(veth)
            _run("ip", "link", "set", peer[:15], "netns", ns)
            _run("ip", "-n", ns, "link", "set", peer[:15], "name", "eth0")
            addr = f"{prefix}.{i + 1}"
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "set", veth, "master", bridge)
            _run("ip", "link", "set", veth, "up")
            self.hosts.append(Host(f"node{i}", addr, 22, f"rcnode{i}"))

    def _sshd_config(self, host: Host, i: int) -> str:
        return "\n".join(
            [
                f"Port {host.port}",
                f"ListenAddress {host.address}",
                f"HostKey {self.root / 'hostkey'}",
                f"PidFile {self.root / f'sshd_{i}.pid'}",
                f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                "StrictModes no",  # the keys live in a world-writable temp dir
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
                "LogLevel ERROR",
                "",
            ]
        )

    def _client_config(self) -> str:
        lines = []
        common = [
            f"  IdentityFile {self.identity}",
            "  IdentitiesOnly yes",
            "  User root",
            "  StrictHostKeyChecking no",
            "  UserKnownHostsFile /dev/null",
            "  BatchMode yes",
            "  LogLevel ERROR",
        ]
        for host in self.hosts:
            lines += [f"Host {host.alias}", f"  HostName {host.address}", f"  Port {host.port}"]
            lines += common
        # Nobody listens there: connection refused at once.
        lines += ["Host unreachable", "  HostName 127.0.0.1", f"  Port {_free_port('127.0.0.1')}"]
        lines += common
        return "\n".join(lines) + "\n"

    def _wait_listening(self, host: Host, i: int, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert host.popen is not None
            if host.popen.poll() is not None:
                log = (self.root / f"sshd_{i}.log").read_text(errors="replace")
                raise RuntimeError(f"sshd for {host.alias} exited {host.popen.returncode}: {log}")
            try:
                with socket.create_connection((host.address, host.port), timeout=1.0):
                    return
            except OSError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"sshd for {host.alias} not listening on {host.address}:{host.port}"
                    ) from None
                time.sleep(0.05)

    # -- use -----------------------------------------------------------------------------
    @property
    def aliases(self) -> list[str]:
        return [h.alias for h in self.hosts]

    def session_processes(self) -> list[int]:
        """Every process the sshds' sessions are running now."""
        out = []
        for host in self.hosts:
            if host.popen is not None and host.popen.poll() is None:
                out += descendants(host.popen.pid)
        return out

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        for host in self.hosts:
            if host.popen is None:
                continue
            for pid in descendants(host.popen.pid):  # what sessions left, if anything
                _kill(pid)
            if host.popen.poll() is None:
                host.popen.terminate()
            try:
                host.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                host.popen.kill()
                host.popen.wait()
        for ns in self._namespaces:
            for pid in subprocess.run(
                ["ip", "netns", "pids", ns], check=False, capture_output=True, text=True
            ).stdout.split():
                _kill(int(pid))
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], check=False, capture_output=True)
        self._namespaces, self._links = [], []
