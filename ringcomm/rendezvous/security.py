"""A token for every group: where it comes from when the group forms, and what is said about it.

Every group has a job token unless ``RINGCOMM_SECURITY=none``: the one given
(``token=``, ``RINGCOMM_TOKEN``, or handed over by a launcher: ``ringcomm run``, the ssh
launcher, ``rc.spawn``), else one the store's host mints when it serves the store
(:func:`job_store`, :mod:`ringcomm.rendezvous.hosting`) and hands, sealed under a key
exchange, to each other rank on its first contact (:func:`connect_store`): once per rank
of each group meeting there (:func:`claims`), so nobody gets it after the group formed,
and a second claim of a rank is refused loudly. The group then runs on the token
its store connection ended up with (:func:`effective_config`). A job whose ranks span hosts
without encryption gets one warning line (:func:`warn_across_hosts`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from ringcomm.config import InitConfig
from ringcomm.rendezvous.join import claim
from ringcomm.rendezvous.store import Store, StoreServer
from ringcomm.transport.endpoints import EndpointInfo
from ringcomm.transport.session import mint_token

__all__ = [
    "FRAME_SLACK_BYTES",
    "claim",
    "claims",
    "connect_store",
    "effective_config",
    "frame_limit",
    "job_store",
    "warn_across_hosts",
]

log = logging.getLogger("ringcomm")

#: Bytes a frame may hold besides its piece (header, inline payload, CURVE's box).
FRAME_SLACK_BYTES = 64 << 10


def claims(world_size: int, ns: str) -> set[str]:
    """The claims a group's store honours (once each): its ranks but 0, the store's host."""
    return {claim(r, ns) for r in range(1, world_size)}


def job_store(
    host: str,
    port: int,
    token: str | None,
    security: str,
    world_size: int,
    ns: str,
    *,
    world_from: str | None = None,
    gated: bool = False,
) -> StoreServer:
    """A group's store served by its rank 0 (started): with the given token, or a minted
    one handed to ranks ``1..world_size-1`` of group ``ns`` once each; without any under
    ``none``. ``world_from``: the store binds every group to ``world_size`` (join.py)."""
    auth = security != "none"
    issued = None if token or not auth else claims(world_size, ns)
    return StoreServer(
        host,
        port,
        token=token,
        auth=auth,
        gated=gated,
        issue="default" if issued is None else issued,
        world_size=None if world_from is None else world_size,
        world_from=world_from or "the launcher",
    ).start()


def connect_store(
    cfg: InitConfig,
    host: str,
    port: int,
    label: str,
    ns: str,
    *,
    token: str | None = None,
    connect_timeout_s: float | None = None,
) -> Store:
    """This rank's store client; without a token (``token`` or ``cfg.token``) it asks for
    the job's as its rank of group ``ns``."""
    return Store(
        host,
        port,
        token=token or cfg.token,
        timeout_s=cfg.timeout_s,
        label=label,
        connect_timeout_s=connect_timeout_s,
        claim=claim(cfg.rank, ns),
        auth=cfg.security != "none",
    )


def effective_config(cfg: InitConfig, *tokens: str | None) -> InitConfig:
    """``cfg`` with the token the group runs on: the given one, else the first of
    ``tokens`` (the store's host's minted one, the one the store handed out), else (a
    singleton that served nothing) a fresh one; none under ``none``."""
    if cfg.security == "none" or cfg.token:
        return cfg
    token = next((t for t in tokens if t), None)
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
