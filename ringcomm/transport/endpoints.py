"""Where a rank listens and how a peer is reached (pure helpers plus local-host facts).

Each rank binds one receive socket on an ``ipc://`` path (peers on the same host) and a
``tcp://`` address (peers elsewhere). A peer is reached over ipc:// when it reports the
same host identity, else over tcp://; ``RINGCOMM_TRANSPORT=tcp|ipc|auto`` overrides
(parsed in :mod:`ringcomm.config`, handed to :func:`choose_endpoint` as ``mode``).
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

from ..config import TRANSPORT_MODES  # re-exported: the modes are parsed in ringcomm.config

__all__ = [
    "TRANSPORT_MODES",
    "EndpointInfo",
    "choose_endpoint",
    "host_identity",
    "ipc_path",
    "local_address_towards",
]


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
        return {
            "rank": self.rank,
            "host_id": self.host_id,
            "ipc": self.ipc,
            "tcp": self.tcp,
            "pid": self.pid,
            "version": self.version,
            "lane": self.lane,
            "shm": self.shm,
            "workspace": self.workspace,
            "salt": self.salt,
        }

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


def ipc_path(rank: int) -> str:
    """A fresh, short socket path (AF_UNIX paths are limited to ~107 bytes)."""
    base = tempfile.gettempdir()
    path = os.path.join(base, f"ringcomm-{os.getuid()}-{uuid.uuid4().hex[:12]}-r{rank}.sock")
    if len(path) > 100:
        path = f"/tmp/rc-{uuid.uuid4().hex[:12]}-r{rank}.sock"
    return path


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
