"""Forming a world group: from a resolved config to a :class:`GroupCore`.

The steps, in order (config -> store -> transport -> progress -> core): :func:`meet` (where
the group meets; rank 0 serves the store), :func:`connect` (every rank joins the group's
key namespace, where a disagreement is refused at once), then :func:`form_world` (bind the
receive sockets, publish this rank's endpoints under ``rank/<r>``, wait for everyone's,
connect to every peer, start the progress engine, make the core). Send sockets choose
ipc:// for peers on this host, tcp:// for the others.

Guarantees: every rank forms its groups in the same order and sees the same cost model
(rank 0's); whatever a step raises, what it opened is closed (the caller closes the store
and server it passed in). Shrink, grow and rejoin form their groups with
:func:`form_world` too (:mod:`ringcomm.core.regroup`). docs/architecture.md, "Forming a group".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable

from ringcomm._version import __version__
from ringcomm.config import InitConfig, binds_to_core
from ringcomm.core import lifecycle
from ringcomm.core.group_core import (
    WORLD_GROUP_ID,
    GroupCore,
    ProcessState,
    install_trace_signal,
    setup_workspace,
    wait_in_slices,
)
from ringcomm.core.progress import MAX_UNEXPECTED_BYTES, MAX_UNEXPECTED_MESSAGES, Progress
from ringcomm.device.xp import select_device
from ringcomm.errors import CommTimeoutError, RendezvousError, RingcommError
from ringcomm.rendezvous import Store, StoreServer, meeting
from ringcomm.rendezvous import security as rz_security
from ringcomm.rendezvous.hosting import ServerLease
from ringcomm.transport.endpoints import (
    EndpointInfo,
    bind_host,
    choose_endpoint,
    host_identity,
    local_address_towards,
)
from ringcomm.transport.wire import WIRE_VERSION
from ringcomm.transport.workspace import AVAILABLE as WORKSPACE_AVAILABLE
from ringcomm.transport.zmq_transport import ZmqTransport
from ringcomm.tuning.costmodel import CostModel, load_tune_file

__all__ = [
    "COST_MODEL_KEY",
    "VERSION",
    "WATCH_SLICE_S",
    "bind_to_core",
    "connect",
    "enable_log",
    "form_world",
    "meet",
    "share_cost_model",
    "store_view",
    "wait_all",
]

#: What a rank's join says of its version: the package's and the wire format's.
VERSION = f"ringcomm {__version__} (wire format {WIRE_VERSION})"

#: The store key under which rank 0 shares its cost model as the world group forms.
COST_MODEL_KEY = "costmodel"

#: How long a watched wait (:func:`wait_all`) waits between two calls of its watch.
WATCH_SLICE_S = 0.1


def meet(cfg: InitConfig, ns: str, label: str) -> tuple[InitConfig, ServerLease | None]:
    """Where group ``ns`` meets: ``cfg`` with the store's address and port, and rank 0's
    lease on the server it hosts (None: a launcher or another process hosts it)."""
    port = cfg.master_port
    if cfg.rank != 0 or cfg.store_external or (cfg.world_size == 1 and port == 0):
        if cfg.torch_store is not None and cfg.world_size > 1 and not cfg.store_external:
            addr, port = meeting.read_address(cfg, ns, label)
            return dataclasses.replace(cfg, master_addr=addr, master_port=port), None
        return cfg, None
    server = _serve(cfg, ns, label)
    if server is None:  # another rank 0 serves it: meet there (and be refused)
        return cfg, None
    port = server.port
    addr = cfg.master_addr
    if cfg.torch_store is not None:
        addr = local_address_towards(cfg.torch_store.host, cfg.torch_store.port) or addr
        theirs = meeting.publish_address(cfg, ns, addr, port, label)
        if theirs is not None:  # another rank 0 published first: meet there
            server.close()
            addr, port = theirs
            return dataclasses.replace(cfg, master_addr=addr, master_port=port), None
    return dataclasses.replace(cfg, master_addr=addr, master_port=port), server


def _serve(cfg: InitConfig, ns: str, label: str) -> ServerLease | None:
    """Rank 0 serves group ``ns``'s store at the master address and port; None: another
    rank 0 already serves it there. A port that is taken says which setting chose it."""
    port = cfg.master_port
    join = meeting.join_request(cfg, ns, VERSION)
    try:
        return meeting.serve_store(cfg, bind_host(cfg.master_addr), port, join, label)
    except RendezvousError as exc:
        if cfg.master_port_origin is None:
            raise RendezvousError(f"{label}: {exc}") from exc
        how = (
            "mpirun -x MASTER_PORT=29500"
            if cfg.source == "mpirun"
            else "export MASTER_PORT=29500 before srun"
        )
        raise RendezvousError(
            f"{label}: {exc}. Port {port} was {cfg.master_port_origin} and is taken: "
            f"set MASTER_PORT (or RINGCOMM_MASTER_PORT) to a free port, e.g. {how}"
        ) from exc
    except (RingcommError, ValueError):
        raise
    except Exception as exc:
        raise RendezvousError(
            f"{label}: cannot serve the rendezvous store on {cfg.master_addr}:{port}: {exc}"
        ) from exc


def connect(
    cfg: InitConfig, ns: str, server: ServerLease | None, label: str
) -> tuple[InitConfig, Store | None]:
    """After :func:`meet`: ``cfg`` with the token the group uses, and this rank's store
    connection (None: a singleton without a launcher's store). It joins group ``ns``
    (refused at once on a disagreement), except a restarted rank (``cfg.restart`` > 0 at
    a launcher's store), which asks the survivors instead (:func:`~ringcomm.core.regroup.
    rejoin`). The caller closes the store and ``server`` if a later step raises."""
    if server is not None:  # rank 0: its store's token (given, or minted there)
        cfg = rz_security.effective_config(cfg, server.token)
    rejoins = cfg.restart > 0 and cfg.store_external
    store: Store | None = None
    if cfg.world_size > 1 and not rejoins:
        join = meeting.join_request(cfg, ns, VERSION, opens=server is not None)
        store = meeting.connect_and_join(cfg, join, label)
    elif cfg.world_size > 1 or cfg.store_external:
        store = rz_security.connect_store(cfg, cfg.master_addr, cfg.master_port, label, ns)
    try:
        return rz_security.effective_config(cfg, None if store is None else store.token), store
    except BaseException:
        if store is not None:
            store.close()
        raise


def form_world(
    cfg: InitConfig,
    store: Store | None,
    server: StoreServer | ServerLease | None,
    port: int,
    epoch: int = 0,
    watch: Callable[[], None] | None = None,
    namespace: str = "",
) -> GroupCore:
    """The core of the world group of ``cfg`` meeting through ``store`` (None: a
    singleton), whose server listens on ``port`` (``server``: here). The caller closes
    ``store`` and ``server`` if this raises. ``watch``: called between slices of the wait
    for the others (it raises to give up). ``epoch``: how many shrinks and grows led here;
    ``namespace``: the group instance's keys in the store (what shrink and grow use)."""
    net: ZmqTransport | None = None
    try:
        net = _open_transport(cfg, port)
        me = _endpoint_info(cfg, net)
        infos, model = _exchange(cfg, store, server, me, watch)
        _connect_peers(cfg, net, me, infos)
        _place_rank(cfg)
        progress = _progress(cfg, net)
        state = ProcessState(cfg, progress, store, server, cfg.effective_chunk_bytes)
        state.peers = infos
        state.costmodel = model
        state.epoch = epoch
        state.store_port = port
        state.namespace = namespace
        lifecycle.register(state)  # however the process ends, it leaves (lifecycle.py)
        install_trace_signal(state)  # RINGCOMM_TRACE_DIR: SIGUSR1 writes the flight record
        core = GroupCore(state, range(cfg.world_size), WORLD_GROUP_ID)
        core.workspace = setup_workspace(core)
        return core
    except BaseException:
        if net is not None:
            net.close(0.0)
        raise


def _open_transport(cfg: InitConfig, port: int) -> ZmqTransport:
    """This rank's transport: its receive sockets bound (tcp:// on the interface towards
    the store's host), no peer known yet."""
    return ZmqTransport(
        cfg.rank,
        tcp_host=local_address_towards(cfg.master_addr, port or 9),
        use_ipc=cfg.transport != "tcp",
        token=cfg.token,
        security=cfg.security,
        lane=cfg.local_lane,
        shm=cfg.shm,
        max_message_bytes=rz_security.frame_limit(cfg),
    )


def _endpoint_info(cfg: InitConfig, net: ZmqTransport) -> EndpointInfo:
    """What this rank publishes of itself: where and how its peers reach it."""
    return EndpointInfo(
        rank=cfg.rank,
        host_id=cfg.host_id or host_identity(),
        ipc=net.ipc_endpoint,
        tcp=net.tcp_endpoint,
        pid=os.getpid(),
        version=__version__,
        lane=net.lane_endpoint,
        shm=net.shm_enabled,
        workspace=cfg.workspace and WORKSPACE_AVAILABLE,
        salt=net.auth_salt,
    )


def _exchange(
    cfg: InitConfig,
    store: Store | None,
    server: StoreServer | ServerLease | None,
    me: EndpointInfo,
    watch: Callable[[], None] | None,
) -> tuple[dict[int, EndpointInfo], CostModel | None]:
    """Publish ``me``, wait for every rank's endpoints (a wait that times out says which
    ranks the store turned away), share rank 0's cost model; every rank's info by rank."""
    infos = {cfg.rank: me}
    keys = [f"rank/{r}" for r in range(cfg.world_size)]
    if store is not None:
        store.set(f"rank/{cfg.rank}", json.dumps(me.to_dict()).encode())
        try:
            if watch is None:
                meeting.wait_for_ranks(store, keys, cfg, f"rank {cfg.rank}")
            else:
                wait_all(store, keys, cfg.timeout_s, watch)
        except CommTimeoutError as exc:  # say so if the store turned ranks away
            if server is None or not server.refusals():
                raise
            raise CommTimeoutError(f"{exc}{server.refusals()}") from exc
    model = share_cost_model(cfg, store, watch)
    if store is not None:
        for r in range(cfg.world_size):
            infos[r] = EndpointInfo.from_dict(json.loads(store.get(keys[r])))
    return infos, model


def _connect_peers(
    cfg: InitConfig, net: ZmqTransport, me: EndpointInfo, infos: dict[int, EndpointInfo]
) -> None:
    """Check every rank's version, give the transport each peer's endpoint (ipc:// and the
    same-host lane on this host, else tcp://), connect to all, set up shared memory."""
    label = f"rank {cfg.rank}"
    for r, info in infos.items():
        if info.version != __version__:
            raise RendezvousError(
                f"{label}: rank {r} runs ringcomm {info.version}, this rank {__version__}"
            )
        if r != cfg.rank:
            try:
                endpoint = choose_endpoint(me, info, cfg.transport)
            except ValueError as exc:
                raise RendezvousError(str(exc)) from exc
            net.set_peer_endpoint(r, endpoint, info.salt)
            if info.lane is not None and endpoint.startswith("ipc://"):
                net.set_peer_lane(r, info.lane)
    rz_security.warn_across_hosts(cfg, infos.values())
    net.connect_all()  # every peer, now: liveness is watched on these connections
    try:
        net.setup_shm([r for r, info in infos.items() if info.shm], cfg.timeout_s)
    except RingcommError as exc:
        raise RendezvousError(str(exc)) from exc  # (it names this rank)


def _place_rank(cfg: InitConfig) -> None:
    """Where this rank runs: its core (:func:`bind_to_core`, when the config says so), its
    GPU (with CuPy), and its debug log."""
    if binds_to_core(cfg.bind, cfg.local_world_size, len(os.sched_getaffinity(0))):
        bind_to_core(cfg.local_rank)
    select_device(cfg.local_rank)  # with CuPy: GPU LOCAL_RANK % GPUs, unless chosen
    if cfg.log_debug:
        enable_log(logging.DEBUG)


def _progress(cfg: InitConfig, net: ZmqTransport) -> Progress:
    """The progress engine over ``net``, with the config's limits on unexpected messages."""
    messages = cfg.max_unexpected_messages
    nbytes = cfg.max_unexpected_bytes
    return Progress(
        net,
        cfg.rank,
        max_unexpected_messages=MAX_UNEXPECTED_MESSAGES if messages is None else messages,
        max_unexpected_bytes=MAX_UNEXPECTED_BYTES if nbytes is None else nbytes,
        log_ops=cfg.log_debug,
    )


def wait_all(
    store: Store, keys: list[str], timeout_s: float, watch: Callable[[], None] | None
) -> None:
    """``store.wait(keys)``; with ``watch``, in slices with ``watch()`` between them."""
    if watch is None:
        store.wait(keys, timeout_s=timeout_s)
        return
    wait_in_slices(
        store,
        keys,
        time.monotonic() + timeout_s,
        WATCH_SLICE_S,
        lambda last: None if last else watch(),
    )


def share_cost_model(
    cfg: InitConfig, store: Store | None, watch: Callable[[], None] | None
) -> CostModel | None:
    """Rank 0's cost model (RINGCOMM_TUNE_FILE), the same on every rank (so they choose
    alike even where hosts hold different files): rank 0 reads the file and publishes it,
    or why it is bad, and then raises; the others read that and raise too."""
    if cfg.rank == 0:
        error = None
        try:
            model = load_tune_file(cfg.tune_file, required=cfg.tune_file_required)
        except ValueError as exc:
            model, error = None, str(exc)
        if store is not None:
            shared = {"model": None if model is None else model.to_dict(), "error": error}
            store.set(COST_MODEL_KEY, json.dumps(shared).encode())
        if error is not None:
            raise RendezvousError(f"rank 0: {error}")
        return model
    if store is None:
        return None
    wait_all(store, [COST_MODEL_KEY], cfg.timeout_s, watch)
    shared = json.loads(store.get(COST_MODEL_KEY))
    if shared["error"] is not None:
        raise RendezvousError(f"rank {cfg.rank}: rank 0's cost model: {shared['error']}")
    return None if shared["model"] is None else CostModel.from_dict(shared["model"])


def store_view(store: Store, namespace: str, sub: str = "") -> Store:
    """The view of ``store`` at ``namespace/sub`` (either may be empty)."""
    prefix = "/".join(p for p in (namespace, sub) if p)
    return store.prefixed(prefix) if prefix else store


def bind_to_core(local_rank: int) -> None:
    """Run the calling thread (the one driving this rank's collectives) on one core:
    ``local_rank`` modulo the cores it may use. Threads started before (libzmq's I/O
    thread) keep their placement; threads started later by this one inherit it.

    When: :func:`ringcomm.config.binds_to_core` (the one rule; ``ringcomm bench`` uses it
    too). Why (``RINGCOMM_BIND``, by default when a host has more ranks than cores): left
    to the OS, ranks that wait for small messages were stacked on one core in about half
    the jobs, and small all_reduces took nearly twice as long; bound round-robin they
    stayed steady (benchmarks/results/local_lane.md). Such ranks get less than a core
    each anyway (torchrun, for the same reason, starts them with OMP_NUM_THREADS=1). Not
    with as many ranks as cores: bound, large messages lost there, and unbound their
    small ones were steady.
    """
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[local_rank % len(cores)]})


def enable_log(level: int = logging.DEBUG) -> None:
    """RINGCOMM_LOG=debug (op start/end lines) or info (the group's summary) on stderr
    (unless the app set up logging)."""
    logger = logging.getLogger("ringcomm")
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("ringcomm %(asctime)s %(message)s"))
        logger.addHandler(handler)
