"""Forming a ringcomm group from a torch group's store, and checking out of it at shutdown.

One ringcomm group per instance of a torch group: its rank 0 starts a ringcomm store (a
port from the OS) and publishes only its address in the torch store, never the token;
every rank joins it. The settings are the process's environment (torch gives none):
``RINGCOMM_MASTER_ADDR``, else ``MASTER_ADDR``, else 127.0.0.1; ``RINGCOMM_TOKEN``, else a
minted token that reaches each rank sealed. At shutdown rank 0 keeps its store up until
every rank has checked out. The whole protocol: docs/architecture.md, "The torch backend".
"""

from __future__ import annotations

import contextlib
import datetime
import json
from typing import Any

from ringcomm.config import env_master_addr, env_token, environment, security_mode
from ringcomm.errors import RingcommError
from ringcomm.group import ProcessGroup as RcGroup
from ringcomm.group import init_process_group
from ringcomm.rendezvous import StoreServer
from ringcomm.rendezvous.security import job_store
from ringcomm.transport.endpoints import bind_host

__all__ = ["check_out", "form_alone", "form_group"]

#: Keys (in the group's torch store) where rank 0 publishes ringcomm's store address, and
#: the counter of ranks done with it at shutdown, per instance of the group (a torch store
#: outlives ``destroy_process_group()``: torchrun's agent store, a ``store=`` passed again).
STORE_KEY = "ringcomm/store/{}"
CLOSED_KEY = "ringcomm/closed/{}"
#: Counter (in the group's torch store) of joins: every rank of the n-th instance of the
#: group counts once, so ``(count - 1) // world_size`` numbers the instance.
JOINS_KEY = "ringcomm/joins"
#: The ringcomm group's namespace in its own store (one store per instance).
GROUP_NAME = "torch"
#: Longest rank 0 keeps ringcomm's store up at shutdown for the others to check out.
CHECKOUT_MAX_S = 30.0


def form_alone(timeout_s: float) -> RcGroup:
    """The ringcomm group of a torch group of one rank (no store, no peers)."""
    return init_process_group(0, 1, master_port=0, timeout_s=timeout_s, env={})


def form_group(
    store: Any, rank: int, world_size: int, timeout_s: float
) -> tuple[RcGroup, StoreServer | None, int]:
    """This rank's ringcomm group for the torch group whose store is ``store``: the group,
    the ringcomm store this rank hosts (rank 0; None elsewhere) and the instance number."""
    label = f"ringcomm backend rank {rank}"
    server: StoreServer | None = None
    env = environment()  # torch calls us without a config: the settings are the process's
    try:
        instance = (int(store.add(JOINS_KEY, 1)) - 1) // world_size
        key = STORE_KEY.format(instance)
        security = security_mode(env)
        token = None if security == "none" else env_token(env)
        if rank == 0:
            addr = env_master_addr(env)
            server = job_store(
                bind_host(addr),
                0,
                token,
                security,
                world_size,
                GROUP_NAME,
                world_from=f"the torch group of {world_size} ranks",
            )
            token = server.token
            info: dict[str, Any] = {"addr": addr, "port": server.port}  # never the token
            store.set(key, json.dumps(info))
        else:
            info = json.loads(bytes(store.get(key)).decode())
        rc_group = init_process_group(
            rank,
            world_size,
            master_addr=info["addr"],
            master_port=int(info["port"]),
            token=token,
            timeout_s=timeout_s,
            host_store=False,
            env=env,
            group_name=GROUP_NAME,  # a store of its own
        )
    except BaseException as exc:
        if server is not None:
            server.close()
        if isinstance(exc, RingcommError):
            raise RingcommError(f"{label}: forming the ringcomm group failed: {exc}") from exc
        raise
    return rc_group, server, instance


def check_out(
    store: Any,
    server: StoreServer | None,
    instance: int,
    world_size: int,
    timeout_s: float,
    *,
    failed: bool,
) -> None:
    """Tell the others this rank is done with the instance's ringcomm store (best effort:
    torch's store may be gone already). Rank 0 (``server``) serves until every rank has
    checked out, then closes it; the others leave after it. After a failure (``failed``),
    when a rank may be gone for good, nobody waits. The server is closed in any case."""
    closed = CLOSED_KEY.format(instance)
    left = closed + "/left"
    limit = datetime.timedelta(seconds=min(timeout_s, CHECKOUT_MAX_S))
    try:
        # Best effort: torch's store may be gone already (its host exited).
        with contextlib.suppress(Exception):
            if int(store.add(closed, 1)) >= world_size:
                store.set(closed + "/all", b"1")
            if not failed:
                # Not after a failure, when a rank may be gone for good (bounded anyway).
                if server is not None:  # keep serving until every rank is done with it
                    store.wait([closed + "/all"], limit)
                    server.close()
                    store.set(left, b"1")
                else:
                    # Leave after rank 0: where rank 0 hosts torch's store (env://), a
                    # rank that re-initialises first would reach the old one, then lose it.
                    store.wait([left], limit)
    finally:
        if server is not None:
            server.close()
