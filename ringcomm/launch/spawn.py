"""``rc.spawn``: run ``fn(pg, *args)`` in ``world_size`` local processes.

Two layers, kept apart so each can be read (and tested) on its own:

* :func:`_run_ranks` supervises ``world_size`` processes of the multiprocessing *spawn*
  context, each running ``entry(rank, world_size)``. Each child reports over its own pipe:
  ``("ok", value)`` or ``("err", traceback_text)``. The parent waits on those pipes and on
  the process sentinels; on the first failure (an exception, a non-zero exit, a death by
  signal, or an exit without a result) it stops every other rank (SIGTERM, a grace period,
  SIGKILL), joins them all and raises one :class:`~ringcomm.errors.RankFailedError`.
  A second pipe per child is never written: the child blocks on it in a daemon thread and
  exits as soon as it reads EOF, i.e. as soon as the parent is gone, even by SIGKILL.
* :func:`spawn` hosts the rendezvous store in the parent (127.0.0.1, a port from the OS, a
  fresh random token) and runs :class:`_GroupEntry` in each child: ``init_process_group``
  with ``host_store=False``, then ``fn(pg, *args)``, then ``pg.close()``.

The token travels to the children inside the pickled process arguments (a pipe), never on a
command line or in the environment.
"""

from __future__ import annotations

import faulthandler
import math
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ringcomm.config import environment
from ringcomm.errors import RankFailedError
from ringcomm.launch.supervise import (
    DEFAULT_GRACE_S,
    describe_exit,
    job_token,
    store_announcer,
)

__all__ = ["spawn"]

#: Seconds to wait for stack dumps of hung ranks when ``timeout_s`` expires.
_STACK_DUMP_WAIT_S = 1.0
_LOCALHOST = "127.0.0.1"


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float | None = None,
    *,
    elastic: bool = False,
    max_restarts: int = 0,
) -> list[Any]:
    """Run ``fn(pg, *args)`` on ``world_size`` local ranks; return the results in rank order.

    Each rank is a fresh process of the multiprocessing *spawn* context, so ``fn`` and
    ``args`` must be picklable, and ``fn`` importable: defined at module level (not a lambda,
    not a nested function). A ``TypeError`` says so before anything starts. Return values
    come back pickled.

    The parent hosts the rendezvous store on 127.0.0.1 (a port chosen by the OS) with a
    fresh random token; each rank joins it with ``init_process_group(rank, world_size,
    host_store=False, timeout_s=timeout_s, ...)``, calls ``fn(pg, *args)``, then closes the
    group. Each rank's environment names the job as ``ringcomm run`` does
    (``RINGCOMM_RANK``, ``RINGCOMM_MASTER_PORT``...), so ``fn`` may form more groups with
    ``rc.init_process_group()``, after ``pg.close()`` or beside ``pg``.

    Failure: on the first rank that raises, exits non-zero, is killed by a signal or exits
    without a result, every other rank is stopped and one
    :class:`~ringcomm.errors.RankFailedError` is raised. It lists each rank that failed on
    its own (the first, and any that failed at about the same time) with its remote
    traceback or exit status; ranks stopped by ``spawn`` are not listed.

    ``timeout_s`` bounds the whole job (and is also the group's default per-call deadline).
    On expiry (plus about a second to collect stacks, and the stop's grace period at most)
    every rank still running is stopped and ``RankFailedError`` is raised (not
    ``CommTimeoutError``): its message reads ``timed out after X s; ranks still running:
    [...]``, names those ranks (they are its ``failures``) and includes their Python stacks
    at the moment of expiry, as dumped by :mod:`faulthandler` (on ``SIGUSR1``).

    If the calling process dies, even by SIGKILL, every rank exits within moments.

    ``elastic=True``: a rank that dies without a result (killed, crashed) does not stop
    the others, which may go on without it (``pg.shrink()``); its slot is started again,
    up to ``max_restarts`` times (the new process's ``init_process_group`` then waits
    until the running ranks admit it with ``pg.grow()``). A slot that stays dead returns
    None. A rank whose ``fn`` raises still fails the job as above.
    """
    _check_world_size(world_size)
    _check_timeout(timeout_s)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"spawn: max_restarts must be an int >= 0, got {max_restarts!r}")
    if max_restarts and not elastic:
        raise ValueError("spawn: max_restarts needs elastic=True (survivors must go on)")
    args = tuple(args)
    _check_picklable(fn, args)

    from ringcomm.rendezvous import StoreServer  # lazy: `import ringcomm.launch` stays light

    token = job_token()
    store = StoreServer(
        _LOCALHOST,
        0,
        token=token,
        auth=token is not None,
        world_size=world_size,
        world_from=f"rc.spawn started {world_size} ranks",
    ).start()
    try:
        entry = _GroupEntry(
            fn=fn,
            args=args,
            master_addr=_LOCALHOST,
            master_port=int(store.port),
            timeout_s=timeout_s,
            token=token,
        )
        announce = store_announcer(_LOCALHOST, int(store.port), token) if elastic else None
        return _run_ranks(
            entry,
            world_size,
            timeout_s=timeout_s,
            elastic=elastic,
            max_restarts=max_restarts,
            announce=announce,
        )
    finally:
        store.close()


@dataclass(frozen=True)
class _GroupEntry:
    """What one spawned rank runs: join the group, call ``fn(pg, *args)``, close the group."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    master_addr: str
    master_port: int
    timeout_s: float | None
    token: str | None = field(repr=False)

    def __call__(self, rank: int, world_size: int) -> Any:
        from ringcomm.group import init_process_group  # lazy: only the children need it

        # Every rank of a spawned job runs on this host: its rank is its local rank and
        # the job's size the host's (what RINGCOMM_BIND goes by), as torchrun says them.
        # The job's other variables too, as `ringcomm run` sets them: `fn` may form more
        # groups (rc.init_process_group() after pg.close(), or beside pg) at the same store.
        env = environment()
        env.update(
            RINGCOMM_RANK=str(rank),
            RINGCOMM_WORLD_SIZE=str(world_size),
            RINGCOMM_LOCAL_RANK=str(rank),
            RINGCOMM_LOCAL_WORLD_SIZE=str(world_size),
            RINGCOMM_MASTER_ADDR=self.master_addr,
            RINGCOMM_MASTER_PORT=str(self.master_port),
            RINGCOMM_STORE_EXTERNAL="1",
        )
        if self.token is not None:  # (none under RINGCOMM_SECURITY=none)
            env["RINGCOMM_TOKEN"] = self.token
        pg = init_process_group(
            rank,
            world_size,
            master_addr=self.master_addr,
            master_port=self.master_port,
            timeout_s=self.timeout_s,
            token=self.token,
            host_store=False,
        )
        with pg:  # an exception: peers are told why (ProcessGroup.abort), else close()
            return self.fn(pg, *self.args)


# --------------------------------------------------------------------------------------
# Argument checks (in the caller, before any process starts)
# --------------------------------------------------------------------------------------


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"spawn: world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"spawn: world_size must be >= 1, got {world_size}")


def _check_timeout(timeout_s: float | None) -> None:
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"spawn: timeout_s must be > 0 or None, got {timeout_s!r}")


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {type(fn).__name__}")
    hint = (
        "fn must be importable by the spawned processes: define it at module level "
        "(not a lambda, a nested function or a method of a local class)"
    )
    try:
        pickle.dumps(fn)
    except Exception as exc:  # PicklingError, AttributeError ("local object"), TypeError
        raise TypeError(f"spawn: {hint}; cannot pickle {fn!r}: {exc}") from exc
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        # Pickled by reference to __main__, which a spawned child cannot re-import when the
        # parent is an interactive session or `python -c`.
        raise TypeError(f"spawn: {hint}; {fn!r} lives in an interactive __main__")
    try:
        pickle.dumps(args)
    except Exception as exc:
        raise TypeError(f"spawn: args must be picklable: {exc}") from exc


# --------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------


def _exit_when_parent_dies(watch: Connection) -> None:
    """Block on the parent's end of ``watch``; EOF means the parent is gone."""
    try:
        watch.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _child_main(
    rank: int,
    world_size: int,
    entry: Callable[[int, int], Any],
    result: Connection,
    watch: Connection,
    stack_path: str,
    restart: int = 0,
) -> None:
    if restart:  # a slot started again (elastic): init_process_group joins the running job
        environment()["RINGCOMM_RESTART"] = str(restart)
    threading.Thread(
        target=_exit_when_parent_dies, args=(watch,), name="ringcomm-parent-watch", daemon=True
    ).start()
    # On SIGUSR1 (sent by the parent when timeout_s expires) dump every thread's stack.
    stack_file = open(stack_path, "w")  # noqa: SIM115  (must stay open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    exitcode = 0
    interrupted = False
    try:
        value = entry(rank, world_size)
        message: tuple[str, Any] = ("ok", value)
    except BaseException as exc:  # noqa: BLE001  (report everything, SystemExit included)
        message = ("err", f"rank {rank} raised:\n{_format_user_traceback(exc)}")
        exitcode = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        exitcode = exitcode or 1
        interrupted = isinstance(exc, KeyboardInterrupt)
    try:  # pickle first, so that a value that does not pickle is reported as such
        payload = ForkingPickler.dumps(message)
    except Exception as exc:  # noqa: BLE001  (pickling raises anything)
        text = f"rank {rank}: could not send its return value back: {exc!r}"
        payload, exitcode = ForkingPickler.dumps(("err", text)), 1
    try:
        result.send_bytes(payload)
        result.close()
    except OSError:
        os._exit(1)  # the parent is gone
    if interrupted:  # as Python ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if exitcode:
        raise SystemExit(exitcode)


def _format_user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without the frames of this module (they are the same for
    every error); in full if the error was raised here."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    if tb is None:
        tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb))


# --------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------


@dataclass
class _Rank:
    rank: int
    process: BaseProcess
    result: Connection  # the parent's read end of the report pipe
    watch: Connection  # the parent's end of the watch pipe: closed only after the join
    stack_path: str
    result_open: bool = True  # False once the report pipe hit EOF
    reported: bool = False  # its ("ok"|"err", ...) report was read
    signalled: bool = False  # stopped by us: its exit code says nothing
    outcome: str | None = None  # None while running, then "ok" | "failed" | "stopped" | "lost"
    failed_at: float = math.inf  # when its failure was seen (the first one is reported)
    value: Any = None
    error: str | None = None

    @property
    def running(self) -> bool:
        return self.outcome is None


def _run_ranks(
    entry: Callable[[int, int], Any],
    world_size: int,
    *,
    timeout_s: float | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    elastic: bool = False,
    max_restarts: int = 0,
    announce: Callable[[str, str], None] | None = None,
) -> list[Any]:
    """Run ``entry(rank, world_size)`` in ``world_size`` spawned processes; supervise them.

    Returns the values in rank order or raises ``RankFailedError`` (see :func:`spawn`).
    ``entry`` must be picklable. Every process is joined before this returns or raises.
    """
    _check_world_size(world_size)
    _check_timeout(timeout_s)
    ctx = get_context("spawn")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ranks: list[_Rank] = []
    retired: list[_Rank] = []  # processes of slots started again (elastic)
    restarts: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="ringcomm-spawn-") as stack_dir:

        def start(rank: int, restart: int = 0) -> _Rank:
            result_r, result_w = ctx.Pipe(duplex=False)
            watch_r, watch_w = ctx.Pipe(duplex=False)
            stack_path = os.path.join(stack_dir, f"rank{rank}.{restart}.stack")
            process = ctx.Process(
                target=_child_main,
                args=(rank, world_size, entry, result_w, watch_r, stack_path, restart),
                name=f"ringcomm-rank-{rank}",
            )
            r = _Rank(rank, process, result_r, watch_w, stack_path)
            try:
                process.start()
            finally:
                result_w.close()  # the child holds its own copies now
                watch_r.close()
            return r

        def lost(r: _Rank) -> _Rank | None:
            """Elastic: a slot whose process died without a report; its replacement."""
            n = restarts.get(r.rank, 0) + 1
            retired.append(r)
            if n > max_restarts:
                r.outcome = "lost"
                return None
            restarts[r.rank] = n
            if announce is not None:  # grow(wait=True) waits for it to ask
                announce(f"restarting/{r.rank}", str(n))
            return start(r.rank, n)

        try:
            for rank in range(world_size):
                ranks.append(start(rank))
            _supervise(ranks, deadline, lost if elastic else None)
            if any(r.running for r in ranks) and not any(r.outcome == "failed" for r in ranks):
                _record_timeout(ranks, timeout_s)
        finally:
            _stop_all(ranks, grace_s)
            for r in ranks + retired:
                r.result.close()
                r.watch.close()
    failed = [r for r in ranks if r.outcome == "failed"]
    if failed:
        raise RankFailedError(
            {r.rank: r.error or "" for r in failed},
            {
                r.rank: r.process.exitcode
                for r in failed
                if r.process.exitcode is not None and not r.signalled
            },
            first=min(failed, key=lambda r: r.failed_at).rank,
        )
    return [r.value for r in ranks]


def _supervise(
    ranks: list[_Rank], deadline: float | None, lost: Callable[[_Rank], _Rank | None] | None = None
) -> None:
    """Wait until every rank has an outcome, a rank fails, or the deadline passes.
    ``lost(rank)`` (elastic): for a rank that died without a report, its replacement
    (put in its place in ``ranks``) or None (the rank's outcome is then ``"lost"``)."""
    while any(r.running for r in ranks):
        by_handle: dict[Any, _Rank] = {}
        for r in ranks:
            if r.running:
                by_handle[r.process.sentinel] = r
                if r.result_open:
                    by_handle[r.result] = r
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait(list(by_handle), timeout=remaining)
        if not ready and deadline is not None and time.monotonic() >= deadline:
            return
        for handle in ready:
            r = by_handle[handle]
            _settle(r, exited=handle == r.process.sentinel)
            if lost is not None and r.outcome == "failed" and not r.reported:
                again = lost(r)
                if again is not None:
                    ranks[ranks.index(r)] = again
        if any(r.outcome == "failed" for r in ranks):
            return


def _read_result(r: _Rank) -> bool:
    """Take the rank's report if one is waiting; True if there was one."""
    if not r.result_open:
        return False
    try:
        if not r.result.poll(0):
            return False
        kind, payload = r.result.recv()
    except (EOFError, OSError):
        r.result_open = False
        return False
    except Exception as exc:  # noqa: BLE001  (unpickling raises anything)
        kind, payload = "err", f"rank {r.rank}: its report could not be unpickled: {exc!r}"
    r.reported = True
    if kind == "ok":
        r.outcome, r.value = "ok", payload
    else:
        r.outcome, r.error = "failed", str(payload)
        r.failed_at = time.monotonic()
    return True


def _settle(r: _Rank, *, exited: bool) -> None:
    """Give a running rank its outcome: its report or, once it exited, its exit status."""
    if not r.running or _read_result(r):
        return
    if not exited:
        return  # nothing to read yet, or the pipe hit EOF: the sentinel will follow
    r.process.join()
    if _read_result(r):  # reported just before exiting
        return
    code = r.process.exitcode
    r.outcome = "failed"
    r.failed_at = time.monotonic()
    how = describe_exit(code, raw_code=True)
    r.error = f"rank {r.rank} {how} without returning a result"


def _record_timeout(ranks: list[_Rank], timeout_s: float | None) -> None:
    """Mark the ranks still running as failed by the timeout, with their Python stacks."""
    running = [r for r in ranks if r.running]
    for r in running:
        if r.process.pid is not None:
            try:
                os.kill(r.process.pid, signal.SIGUSR1)  # faulthandler dumps to stack_path
            except ProcessLookupError:
                pass
    time.sleep(_STACK_DUMP_WAIT_S)
    names = [r.rank for r in running]
    for r in running:
        if _read_result(r):  # it finished at the last moment: keep what it said
            continue
        try:
            with open(r.stack_path) as f:
                stacks = f.read().strip()
        except OSError:
            stacks = ""
        text = f"timed out after {timeout_s:g} s; ranks still running: {names}"
        if stacks:
            text += f"\nrank {r.rank} Python stacks at the timeout:\n{stacks}"
        r.outcome, r.error = "failed", text
        r.failed_at = time.monotonic()


def _stop_all(ranks: list[_Rank], grace_s: float) -> None:
    """Stop every rank still running, let the others exit, and join them all.

    Every live rank that has not reported is signalled at once (SIGTERM); those that did
    are given ``grace_s`` to exit on their own; whatever is left then gets SIGKILL. A
    rank that reports a failure or exits before it is signalled counts as failed (it failed
    on its own, at about the same time); the ranks we stop are only ``"stopped"``.
    """
    started = [r for r in ranks if r.process.pid is not None]
    for r in started:
        if r.running:
            _settle(r, exited=not r.process.is_alive())
    for r in started:
        if not r.reported and r.process.is_alive():
            r.signalled = True
            r.process.terminate()
    deadline = time.monotonic() + grace_s
    for r in started:
        r.process.join(max(0.0, deadline - time.monotonic()))
    for r in started:
        if r.process.is_alive():
            r.signalled = True
            r.process.kill()
            r.process.join()
    for r in ranks:
        if r.running:
            r.outcome = "stopped"
