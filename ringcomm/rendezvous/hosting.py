"""Store servers this process hosts, shared by the groups that meet at one address.

A process may form several groups one after another or side by side (each in its own key
namespace of the store). Where this process hosts the store at a fixed address (rank 0
under mpirun or by hand: ``MASTER_PORT``), a second group beside a live one meets at the
same address: :func:`serve` hands out a :class:`ServerLease` on the server already running
there (same token) instead of failing to bind the port, and the server closes with its
last lease. Port 0 always starts a new server on a port the OS picks. These servers are
gated (:mod:`ringcomm.rendezvous.join`): a group's namespace admits joins once its host
(this process) joined it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ringcomm.errors import RendezvousError
from ringcomm.rendezvous.security import claims, job_store
from ringcomm.rendezvous.store import StoreServer

__all__ = ["ServerLease", "serve"]


@dataclass
class _Hosted:
    server: StoreServer
    token: str | None
    leases: int


_lock = threading.Lock()
_live: dict[tuple[str, int], _Hosted] = {}  # by (bind host, port)


class ServerLease:
    """One group's hold on a store server (``close()`` is idempotent; the server closes
    when its last lease does)."""

    def __init__(self, key: tuple[str, int], server: StoreServer) -> None:
        self._key = key
        self.server = server
        self.port: int = server.port
        self._closed = False

    @property
    def token(self) -> str | None:
        """The store's token (given, or minted by the server)."""
        return self.server.token

    def refusals(self) -> str:
        """The server's :meth:`~ringcomm.rendezvous.StoreServer.refusals`."""
        return self.server.refusals()

    def close(self) -> None:
        with _lock:
            if self._closed:
                return
            self._closed = True
            hosted = _live.get(self._key)
            if hosted is not None and hosted.server is self.server:
                hosted.leases -= 1
                if hosted.leases > 0:
                    return
                del _live[self._key]
        self.server.close()

    def __repr__(self) -> str:
        return f"ServerLease({self.server!r})"


def serve(
    host: str, port: int, *, token: str | None, security: str, world_size: int, ns: str
) -> ServerLease:
    """A lease on the store served at ``host:port`` by this process for group ``ns`` of
    ``world_size`` ranks: the live one (same token), else a new server (port 0: one the
    OS picks). Without a token the store mints one and hands it to the group's ranks once
    each (:mod:`ringcomm.rendezvous.security`). Raises :class:`RendezvousError` when the
    port is taken, or held by this process's store of another job (token)."""
    with _lock:
        hosted = _live.get((host, port)) if port else None
        if hosted is not None:
            if hosted.token != token or hosted.server.auth != (security != "none"):
                raise RendezvousError(
                    f"cannot serve the store on {host}:{port}: this process serves another "
                    "group's store there, with another token or RINGCOMM_SECURITY"
                )
            hosted.server.allow_claims(claims(world_size, ns))
            hosted.leases += 1
            return ServerLease((host, port), hosted.server)
        server = job_store(host, port, token, security, world_size, ns, gated=True)
        key = (host, server.port)
        _live[key] = _Hosted(server, token, 1)
        return ServerLease(key, server)
