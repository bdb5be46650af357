"""The torch ProcessGroup of the ringcomm backend, and torch's creator that forms it.

:class:`RingcommProcessGroup` subclasses ``dist.ProcessGroup`` (``dist._Backend`` cannot be
subclassed from Python): torch reads its identity and calls its collective and
point-to-point methods, each of which hands torch's arguments to the function of the same
concern (:mod:`~ringcomm.torch_backend.reductions`, :mod:`~ringcomm.torch_backend.movement`,
:mod:`~ringcomm.torch_backend.p2p`) over the group's
:class:`~ringcomm.torch_backend.core.BackendCore`. Shutting down closes the ringcomm groups,
then checks out of the instance's store (:func:`~ringcomm.torch_backend.store.check_out`).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from ringcomm.group import ProcessGroup as RcGroup
from ringcomm.rendezvous import StoreServer
from ringcomm.torch_backend import movement, p2p, reductions
from ringcomm.torch_backend.core import BackendCore
from ringcomm.torch_backend.store import check_out, form_alone, form_group
from ringcomm.torch_backend.work import RingcommWork

__all__ = ["BACKEND_NAME", "RingcommProcessGroup", "create_process_group"]

#: The name to pass to ``dist.init_process_group`` / ``dist.new_group(backend=...)``.
BACKEND_NAME = "ringcomm"

Tensors = list[torch.Tensor]


class RingcommProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on a ringcomm group (CPU and CUDA tensors)."""

    def __init__(
        self,
        rc_group: RcGroup,
        timeout_s: float,
        *,
        store_server: StoreServer | None = None,
        torch_store: Any = None,
        instance: int = 0,
    ) -> None:
        super().__init__(rc_group.rank, rc_group.world_size)  # type: ignore[call-arg]
        self._core = BackendCore(rc_group, timeout_s)
        self._store_server = store_server
        self._torch_store = torch_store
        self._instance = instance
        self._group_name = ""
        self._group_desc = ""

    # -- identity (torch reads these through its C++ ProcessGroup) -------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def ringcomm_group(self) -> RcGroup:
        """The ringcomm group underneath (for stats or ringcomm calls of your own)."""
        return self._core.rc

    def __repr__(self) -> str:
        rc = self._core.rc
        return f"<RingcommProcessGroup rank {rc.rank}/{rc.world_size} {self._group_name!r}>"

    # -- reductions (ringcomm.torch_backend.reductions) -------------------------------
    def allreduce(self, tensors: Tensors, opts: Any = None) -> RingcommWork:  # type: ignore[override]
        return reductions.allreduce(self._core, tensors, opts)

    def allreduce_coalesced(self, tensors: Tensors, opts: Any = None) -> RingcommWork:
        return reductions.allreduce_coalesced(self._core, tensors, opts)

    def reduce(self, tensors: Tensors, opts: Any = None) -> RingcommWork:  # type: ignore[override]
        return reductions.reduce(self._core, tensors, opts)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> RingcommWork:
        return reductions.reduce_scatter_single(self._core, output, input, opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(
        self, outputs: Tensors, inputs: Tensors, opts: Any = None
    ) -> RingcommWork:
        return reductions.reduce_scatter_tensor_coalesced(self._core, outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
        self, outputs: Tensors, inputs: list[Tensors], opts: Any = None
    ) -> RingcommWork:
        return reductions.reduce_scatter(self._core, outputs, inputs, opts)

    # -- data movement (ringcomm.torch_backend.movement) ------------------------------
    def broadcast(self, tensors: Tensors, opts: Any = None) -> RingcommWork:  # type: ignore[override]
        return movement.broadcast(self._core, tensors, opts)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> RingcommWork:
        return movement.allgather_base(self._core, output, input, opts)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: Tensors, inputs: Tensors, opts: Any = None
    ) -> RingcommWork:
        return movement.allgather_into_tensor_coalesced(self._core, outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def allgather(  # type: ignore[override]
        self, outputs: list[Tensors], inputs: Tensors, opts: Any = None
    ) -> RingcommWork:
        return movement.allgather(self._core, outputs, inputs, opts)

    def allgather_coalesced(
        self, outputs: list[Tensors], inputs: Tensors, opts: Any = None
    ) -> RingcommWork:
        return movement.allgather_coalesced(self._core, outputs, inputs, opts)

    def gather(  # type: ignore[override]
        self, outputs: list[Tensors], inputs: Tensors, opts: Any = None
    ) -> RingcommWork:
        return movement.gather(self._core, outputs, inputs, opts)

    def scatter(  # type: ignore[override]
        self, outputs: Tensors, inputs: list[Tensors], opts: Any = None
    ) -> RingcommWork:
        return movement.scatter(self._core, outputs, inputs, opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> RingcommWork:
        return movement.alltoall_base(
            self._core, output, input, output_split_sizes, input_split_sizes, opts
        )

    def alltoall(self, outputs: Tensors, inputs: Tensors, opts: Any = None) -> RingcommWork:
        return movement.alltoall(self._core, outputs, inputs, opts)

    def barrier(self, opts: Any = None) -> RingcommWork:
        return movement.barrier(self._core, opts)

    # -- point-to-point (ringcomm.torch_backend.p2p) ---------------------------------
    def monitored_barrier(
        self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """Gloo's monitored barrier (``dist.monitored_barrier`` refuses any backend not
        named gloo: call ``pg.monitored_barrier(timeout)``)."""
        p2p.monitored_barrier(self._core, timeout, wait_all_ranks)

    def send(self, tensors: Tensors, dst: int, tag: int) -> RingcommWork:
        return p2p.send(self._core, tensors, dst, tag)

    def recv(self, tensors: Tensors, src: int, tag: int) -> RingcommWork:
        return p2p.recv(self._core, tensors, src, tag)

    def recv_anysource(self, tensors: Tensors, tag: int) -> RingcommWork:
        """``dist.recv(t)`` without ``src``; the work's ``_source_rank()`` names the sender."""
        return p2p.recv_anysource(self._core, tensors, tag)

    # -- shutting down -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close the ringcomm group (called by ``dist.destroy_process_group``); idempotent."""
        core = self._core
        if core.shut:
            return
        core.close()
        if self._torch_store is None or core.rc.world_size == 1:
            return
        check_out(
            self._torch_store,
            self._store_server,
            self._instance,
            core.rc.world_size,
            core.timeout_s,
            failed=core.failure is not None,
        )

    def abort(self) -> None:
        """Shut down without waiting for the other ranks to check out."""
        self._core.note_failure(RuntimeError("the process group was aborted"))
        self.shutdown()

    def __del__(self) -> None:  # best effort: never leave sockets or threads behind
        core = getattr(self, "_core", None)
        if core is None or core.shut:
            return
        core.shut = True
        # try/except, not contextlib.suppress: at interpreter teardown the module's globals
        # (contextlib among them) may be None already.
        try:
            core.completer.close(0.1)
            core.rc.close()
        except Exception:  # noqa: BLE001, S110 (best effort in a finaliser)
            pass
        if self._store_server is not None:
            try:
                self._store_server.close()
            except Exception:  # noqa: BLE001, S110 (best effort in a finaliser)
                pass


def create_process_group(
    store: Any, rank: int, world_size: int, timeout: datetime.timedelta
) -> RingcommProcessGroup:
    """torch's creator (``register_backend``): form a ringcomm group for this torch group
    (:func:`~ringcomm.torch_backend.store.form_group`)."""
    timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 1800.0
    if world_size == 1:
        return RingcommProcessGroup(form_alone(timeout_s), timeout_s)
    rc_group, server, instance = form_group(store, rank, world_size, timeout_s)
    return RingcommProcessGroup(
        rc_group, timeout_s, store_server=server, torch_store=store, instance=instance
    )
