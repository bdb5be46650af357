"""What every call of one torch group needs: its ringcomm group and the steps around a call.

A call starts with :meth:`BackendCore.start` (the group is open; the call's device scope
begins on this thread; :meth:`BackendCore.start_with` also fills in torch's default options),
makes its ringcomm calls through :meth:`BackendCore.call` (ordered after the caller's stream;
a failure worded as torch words it and noted for shutdown; :meth:`BackendCore.call_with`
passes the options' ``asyncOp`` and timeout), and
ends with :meth:`BackendCore.issue`, which wraps them in the :class:`RingcommWork` it
returns. The collective and point-to-point modules are functions of a ``BackendCore``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringcomm.core.work import Work as RcWork
from ringcomm.errors import RingcommError
from ringcomm.group import ProcessGroup as RcGroup
from ringcomm.torch_backend.device import DeviceBinding, current_call, start_call
from ringcomm.torch_backend.tensors import Post, check_tensor, is_async, timeout_of
from ringcomm.torch_backend.work import Completer, RingcommWork, torch_wording

__all__ = ["BackendCore"]


class BackendCore:
    """One torch group's ringcomm group (and a second one over the same ranks, whose tags
    are the backend's own point-to-point steps), its default timeout, the thread that
    completes futures nobody waits for, its device and its first failure."""

    def __init__(self, rc_group: RcGroup, timeout_s: float) -> None:
        self.rc = rc_group
        # Point-to-point collectives of ours (uneven all-to-all) use their own tag space.
        p2p = rc_group.new_group(range(rc_group.world_size))
        assert p2p is not None  # every rank is a member
        self.rc_p2p: RcGroup = p2p
        self.monitored_seq = 0  # monitored barriers so far (their tags)
        self.timeout_s = timeout_s
        self.completer = Completer(f"r{rc_group.rank}")
        self.binding = DeviceBinding()  # this rank's device, at its first device call
        self.shut = False
        self.failure: BaseException | None = None  # the first failed operation's error

    def what(self, name: str) -> str:
        """How errors name the call ``name`` on this rank."""
        return f"ringcomm backend rank {self.rc.rank}: {name}"

    def start(self, name: str) -> str:
        """First thing of every call: the group is open; the call's scope starts. Returns
        :meth:`what` of the call."""
        what = self.what(name)
        if self.shut:
            raise RuntimeError(f"{what}: the process group was shut down")
        start_call(what, self.binding)
        return what

    def start_with(self, name: str, opts: Any, options: Callable[[], Any]) -> tuple[str, Any]:
        """:meth:`start` of a call taking torch options: its :meth:`what` and ``opts``
        (None: torch's defaults, ``options()``)."""
        return self.start(name), (opts if opts is not None else options())

    def timeout_of(self, opts: Any) -> float:
        """The call's timeout: torch's options, else the group's."""
        return timeout_of(opts, self.timeout_s)

    def one(self, tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        """The one tensor of a call that takes a list of one."""
        if len(tensors) != 1:
            raise ValueError(f"{what}: expected one tensor per call, got {len(tensors)}")
        return check_tensor(tensors[0], what)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ringcomm (device calls: ordered after the caller's stream); note a failure
        raised at once (blocking calls) for shutdown."""
        try:
            with current_call().ordered():
                return fn(*args, **kwargs)
        except RingcommError as exc:
            error = torch_wording(exc, self.what(getattr(fn, "__name__", "call")))
            self.note_failure(error)
            if error is exc:
                raise
            raise error from exc

    def call_with(self, opts: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """:meth:`call` of a collective as torch's ``opts`` ask: started and left to run
        (``asyncOp``) or blocking, within the call's timeout."""
        return self.call(
            fn, *args, async_op=is_async(opts), timeout_s=self.timeout_of(opts), **kwargs
        )

    def issue(
        self,
        works: Sequence[Any],
        outputs: list[torch.Tensor],
        post: Post | None,
        desc: str,
        opts: Any = None,
        p2p: bool = False,
    ) -> RingcommWork:
        """The Work of a call over ``works`` (what :meth:`call` returned) writing
        ``outputs``; ``post`` runs once they are done."""
        # Blocking ringcomm calls returned their results instead of a Work: nothing to wait.
        pending = [w for w in works if isinstance(w, (RcWork, RingcommWork))]
        work = RingcommWork(
            pending,
            outputs,
            post,
            self.timeout_of(opts),
            desc,
            self.note_failure,
            lambda w: self.completer.add(w, p2p),
            current_call(),
        )
        if not pending:  # ran blocking (torch will wait at once): done now
            work.settle()
        return work

    def note_failure(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error

    def close(self) -> None:
        """Stop the completer and close both ringcomm groups (no check-out)."""
        self.shut = True
        self.completer.close()
        self.rc_p2p.close()
        self.rc.close()
