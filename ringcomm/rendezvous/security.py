"""A token for every group: where it comes from when the group forms, and what is said about it.

Every group has a job token unless ``RINGCOMM_SECURITY=none``: the one given
(``token=``, ``RINGCOMM_TOKEN``, or handed over by a launcher: ``ringcomm run``, the ssh
launcher, ``rc.spawn``), else one the store's host mints when it serves the store
(:func:`serve_store`) and hands, sealed under a key exchange, to each other rank on its
first contact (:func:`connect_store`): once per rank, so nobody gets it after the group
formed, and a second claim of a rank is refused loudly. The group then runs on the token
its store connection ended up with (:func:`effective_config`). A job whose ranks span hosts
without encryption gets one warning line (:func:`warn_across_hosts`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from ..config import InitConfig
from ..transport.endpoints import EndpointInfo
from ..transport.session import mint_token
from .store import Store, StoreServer

__all__ = [
    "FRAME_SLACK_BYTES",
    "connect_store",
    "effective_config",
    "frame_limit",
    "job_store",
    "serve_store",
    "warn_across_hosts",
]

log = logging.getLogger("ringcomm")

#: Bytes a frame may hold besides its piece (header, inline payload, CURVE's box).
FRAME_SLACK_BYTES = 64 << 10


def serve_store(cfg: InitConfig, host: str, port: int) -> StoreServer:
    """The group's store, served by this rank (0): :func:`job_store`."""
    return job_store(host, port, cfg.token, cfg.security, cfg.world_size)


def job_store(
    host: str, port: int, token: str | None, security: str, world_size: int
) -> StoreServer:
    """A group's store served by its rank 0 (started): with the given token, or a minted
    one handed to ranks ``1..world_size-1`` once each; without any under ``none``."""
    auth = security != "none"
    claims = None if token or not auth else {f"rank {r}" for r in range(1, world_size)}
    return StoreServer(host, port, token=token, auth=auth,
                       issue="default" if claims is None else claims).start()  # fmt: skip


def connect_store(cfg: InitConfig, host: str, port: int, label: str) -> Store:
    """This rank's store client; without a token it asks for the job's as ``rank N``."""
    return Store(host, port, token=cfg.token, timeout_s=cfg.timeout_s, label=label,
                 claim=f"rank {cfg.rank}", auth=cfg.security != "none")  # fmt: skip


def effective_config(
    cfg: InitConfig, server: StoreServer | None, store: Store | None
) -> InitConfig:
    """``cfg`` with the token the group runs on: the given one, the one the store handed
    out, or (a singleton that served nothing) a fresh one; none under ``none``."""
    if cfg.security == "none" or cfg.token:
        return cfg
    token = (store.token if store is not None else None) or (
        server.token if server is not None else None
    )
    return dataclasses.replace(cfg, token=token or mint_token())


def frame_limit(cfg: InitConfig) -> int:
    """The most bytes one incoming frame of the group may hold (its receive socket's bound)."""
    return cfg.max_piece_bytes + FRAME_SLACK_BYTES


def warn_across_hosts(cfg: InitConfig, infos: Iterable[EndpointInfo]) -> None:
    """Rank 0 says once when the group spans hosts with its traffic readable on the way."""
    if cfg.rank != 0 or len({info.host_id for info in infos}) < 2:
        return
    if cfg.security == "none":
        log.warning(
            "ringcomm: this job spans hosts with RINGCOMM_SECURITY=none: anyone who reaches "
            "its ports can join or inject frames (use the default, or curve to encrypt)"
        )
    elif cfg.security == "handshake":
        log.warning(
            "ringcomm: this job spans hosts with RINGCOMM_SECURITY=handshake: connections are "
            "authenticated but not encrypted (RINGCOMM_SECURITY=curve encrypts them)"
        )
