"""Where a rank listens and how a peer is reached (pure helpers plus local-host facts).

Each rank binds one receive socket on an ``ipc://`` path (peers on the same host) and a
``tcp://`` address (peers elsewhere). A peer is reached over ipc:// when it reports the
same host identity, else over tcp://; ``RINGCOMM_TRANSPORT=tcp|ipc|auto`` overrides
(parsed in :mod:`ringcomm.config`, handed to :func:`choose_endpoint` as ``mode``).

Socket files (the ipc:// sockets, the same-host lane's) live in a folder of this process
inside one folder per user (:func:`private_dir`: ``<tmp>/ringcomm-<uid>/<pid>-<start
time>``, both mode 0700, so no other user reaches them). A process that ends normally
removes its folder; one killed (SIGKILL) cannot, so the next process of the same user
removes every folder whose process is gone before it makes its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tempfile
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from ringcomm.config import TRANSPORT_MODES  # re-exported: the modes are parsed in ringcomm.config
from ringcomm.errors import RendezvousError

__all__ = [
    "TRANSPORT_MODES",
    "EndpointInfo",
    "bind_host",
    "choose_endpoint",
    "host_identity",
    "ipc_path",
    "local_address_towards",
    "private_dir",
    "release_private_dir",
    "remove_stale_dirs",
]

_private: list[tuple[int, str]] = []  # (pid, this process's folder), once made


@dataclass(frozen=True)
class EndpointInfo:
    """What a rank publishes through the rendezvous store."""

    rank: int
    host_id: str
    ipc: str | None
    tcp: str | None
    pid: int
    version: str
    #: The same-host lane's socket path (transport/unix_lane.py), None without one.
    lane: str | None = None
    #: Takes part in the shared-memory lane (transport/shm_lane.py) with lane peers.
    shm: bool = False
    #: Takes part in shared workspaces (transport/workspace.py) with same-host peers.
    workspace: bool = False
    #: The salt its peers bind their data-plane logins to (session.py), hex; None: no
    #: PLAIN logins (curve, or no token).
    salt: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EndpointInfo:
        return cls(
            rank=int(d["rank"]),
            host_id=str(d["host_id"]),
            ipc=d.get("ipc"),
            tcp=d.get("tcp"),
            pid=int(d["pid"]),
            version=str(d["version"]),
            lane=d.get("lane"),
            shm=bool(d.get("shm", False)),
            workspace=bool(d.get("workspace", False)),
            salt=d.get("salt"),
        )


def host_identity() -> str:
    """Hostname plus kernel boot id: equal exactly when ipc:// paths are shared."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "-"
    return f"{socket.gethostname()}:{boot}"


def local_address_towards(addr: str, port: int = 9) -> str:
    """The local IP of the interface that routes to ``addr`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(addr, port, socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return "127.0.0.1"
    target = str(infos[0][4][0])
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, port))  # UDP connect only picks a route
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def bind_host(addr: str) -> str:
    """The interface a server meant to be reached at ``addr`` listens on: ``addr``'s IP if
    it is one of this host's, else every interface (``0.0.0.0``: e.g. a NAT address).
    An ``addr`` that does not resolve raises :class:`RendezvousError` naming it."""
    try:
        ip = socket.gethostbyname(addr)
    except OSError as exc:
        raise RendezvousError(f"cannot resolve master address {addr!r}: {exc}") from exc
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return ip
    except OSError:
        return "0.0.0.0"


def ipc_path(rank: int) -> str:
    """A fresh, short socket path in :func:`private_dir` (AF_UNIX paths are limited to
    ~107 bytes)."""
    return os.path.join(private_dir(), f"{uuid.uuid4().hex[:8]}-r{rank}.sock")


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return None


def _user_dir() -> str | None:
    """``<tmp>/ringcomm-<uid>``, mode 0700 and ours (made if missing); None if it cannot be
    trusted (another owner, a link, other modes) or made, or its paths would be too long."""
    uid = os.getuid()
    for base in (tempfile.gettempdir(), "/tmp"):
        path = os.path.join(base, f"ringcomm-{uid}")
        if len(path) > 60:
            continue
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700:
            return path
    return None


def remove_stale_dirs(user_dir: str) -> int:
    """Remove the folders in ``user_dir`` whose process is gone (killed before it could);
    returns how many."""
    removed = 0
    try:
        names = os.listdir(user_dir)
    except OSError:
        return 0
    for name in names:
        pid, dash, start = name.partition("-")
        if not dash or not pid.isdigit():
            continue
        if _start_time(int(pid)) == start:
            continue  # its process is alive
        shutil.rmtree(os.path.join(user_dir, name), ignore_errors=True)
        removed += 1
    return removed


def private_dir() -> str:
    """This process's folder for socket files (module docstring): made at the first call,
    after the stale folders of the user's ended processes are removed."""
    pid = os.getpid()
    if _private and _private[0][0] == pid and os.path.isdir(_private[0][1]):
        return _private[0][1]
    _private.clear()
    user_dir = _user_dir()
    if user_dir is None:  # no trusted per-user folder: one of our own, as before
        path = tempfile.mkdtemp(prefix="ringcomm-", dir="/tmp")
    else:
        remove_stale_dirs(user_dir)
        path = os.path.join(user_dir, f"{pid}-{_start_time(pid) or 0}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    _private.append((pid, path))
    return path


def release_private_dir() -> None:
    """Remove this process's folder if nothing is left in it (its transports closed)."""
    if _private and _private[0][0] == os.getpid():
        with contextlib.suppress(OSError):
            os.rmdir(_private[0][1])


def choose_endpoint(me: EndpointInfo, peer: EndpointInfo, mode: str = "auto") -> str:
    """The endpoint ``me`` connects to for ``peer``: ipc:// on the same host, else tcp://."""
    if mode not in TRANSPORT_MODES:
        raise ValueError(f"transport mode must be one of {TRANSPORT_MODES}, got {mode!r}")
    same_host = me.host_id == peer.host_id
    if mode == "ipc" or (mode == "auto" and same_host and peer.ipc is not None):
        if peer.ipc is None or not same_host:
            raise ValueError(
                f"rank {me.rank}: peer {peer.rank} has no ipc endpoint reachable from here"
            )
        return peer.ipc
    if peer.tcp is None:
        raise ValueError(f"rank {me.rank}: peer {peer.rank} has no tcp endpoint")
    return peer.tcp
