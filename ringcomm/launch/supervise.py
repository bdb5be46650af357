"""What the local and ssh launchers share: rank processes and their supervision.

``ringcomm run`` (:mod:`.local`, :mod:`.ssh`) starts one OS process per rank (the rank
itself, or the ssh client that runs it) and then:

* copies each process's stdout/stderr to ours, whole lines, prefixed ``[rank] ``
  (:class:`LineCopier`, :func:`copy_output`);
* records SIGINT/SIGTERM sent to the launcher instead of dying of them
  (:class:`LauncherSignals`);
* waits (:func:`supervise`). The first rank to exit non-zero, or a signal to the launcher,
  stops the others (:func:`stop_ranks`: ``RankProcess.stop``, a grace period, then
  ``RankProcess.kill``) and sets the launcher's status (docs/contracts.md, Exit codes): the failing rank's code,
  128+N for a rank killed by signal N, 130/143 for the launcher's own SIGINT/SIGTERM.
  With a trace directory (``RINGCOMM_TRACE_DIR``) it first asks the others for their
  flight records (:func:`ask_for_traces`: SIGUSR1), so a straggler's is there too;
* never leaves a process behind (:func:`reap`), even when the launcher is SIGKILLed
  (:func:`pdeathsig_preexec`).

How a process ended is told in one wording (:func:`describe_exit`), which ``rc.spawn``
(:mod:`.spawn`) uses too. The parent-death and status helpers are the remote
:mod:`.watchdog`'s (which imports only the standard library), re-exported here.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, TypeVar

from ringcomm.launch.watchdog import exit_status, pdeathsig_preexec

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "DEFAULT_GRACE_S",
    "PROG",
    "TRACE_WAIT_S",
    "LauncherSignals",
    "LineCopier",
    "RankProcess",
    "ask_for_traces",
    "copy_output",
    "describe_exit",
    "exit_status",
    "job_token",
    "join_copiers",
    "note",
    "pdeathsig_preexec",
    "reap",
    "signal_name",
    "slot_restarter",
    "start_in_session",
    "start_ranks",
    "stop_ranks",
    "store_announcer",
    "supervise",
    "wait_for_exits",
]

#: Seconds a rank gets between the request to stop and SIGKILL.
DEFAULT_GRACE_S = 3.0
#: Longest the launcher waits for the flight records it asked for before stopping ranks.
TRACE_WAIT_S = 2.0
#: How the launcher names itself in its notes and errors.
PROG = "ringcomm run"
# Whole lines to our stdout/stderr: ranks' output copiers and the launcher's own notes.
_STDOUT_LOCK = threading.Lock()
_STDERR_LOCK = threading.Lock()


# --------------------------------------------------------------------------------------
# Words
# --------------------------------------------------------------------------------------


def signal_name(signum: int) -> str:
    """``SIGTERM``; ``signal 99`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int | None, *, raw_code: bool = False) -> str:
    """How a process ended, as a predicate: ``exited with code 3`` / ``was killed by
    SIGTERM`` (``returncode`` as Popen and multiprocessing give it: -N for signal N).

    With ``raw_code`` the number is shown as given (``rc.spawn``'s wording): ``exited with
    exit code 3`` / ``was killed by SIGTERM (exit code -15)``. None: ``did not exit``.
    """
    if returncode is None:
        return "did not exit"
    if returncode < 0:
        killed = f"was killed by {signal_name(-returncode)}"
        return f"{killed} (exit code {returncode})" if raw_code else killed
    return f"exited with {'exit code' if raw_code else 'code'} {returncode}"


def note(message: str) -> None:
    """Print ``ringcomm run: message`` to stderr, whole, between the ranks' lines."""
    with _STDERR_LOCK:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------


def start_in_session(
    argv: Sequence[str],
    preexec: Callable[[], None] | None,
    *,
    env: Mapping[str, str] | None = None,
    stdin: int = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own (so its whole process group can be
    signalled), stdout and stderr piped, ``preexec`` (from :func:`pdeathsig_preexec`,
    made once per job) run in the child."""
    popen = subprocess.Popen(
        list(argv),
        env=env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=preexec,  # noqa: PLW1509  (only prctl + getppid: fork-safe)
    )
    assert popen.stdout is not None and popen.stderr is not None
    return popen


class LineCopier:
    """Copy a rank's output stream to ours, line by line, each line prefixed ``[label] ``
    (the label is the rank, or ``rank host`` in verbose mode).

    Whole lines are written under one lock per destination, so lines of different ranks
    never interleave mid-line; a last line without a newline gets one.
    """

    def __init__(self, source: IO[bytes], dest: IO[Any], lock: threading.Lock, label: int | str):
        self._source, self._dest, self._lock = source, dest, lock
        self._prefix = f"[{label}] ".encode()
        self.thread = threading.Thread(target=self._copy, name=f"ringcomm-out-{label}", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        binary = getattr(self._dest, "buffer", None)
        try:
            for line in iter(self._source.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self._lock:
                    try:
                        if binary is not None:
                            binary.write(self._prefix + line)
                            binary.flush()
                        else:
                            self._dest.write((self._prefix + line).decode(errors="replace"))
                            self._dest.flush()
                    except (OSError, ValueError):
                        pass  # our own output is gone (closed pipe): keep draining the rank
        finally:
            self._source.close()


def copy_output(popen: subprocess.Popen[bytes], label: int | str) -> tuple[LineCopier, ...]:
    """Copiers of ``popen``'s stdout and stderr to ours (see :class:`LineCopier`)."""
    assert popen.stdout is not None and popen.stderr is not None
    return (
        LineCopier(popen.stdout, sys.stdout, _STDOUT_LOCK, label),
        LineCopier(popen.stderr, sys.stderr, _STDERR_LOCK, label),
    )


@dataclass
class RankProcess:
    """One rank's process (here: the rank itself, in its own session) and its copiers.

    :func:`supervise` needs :meth:`stop`, :meth:`kill`, :meth:`exit_fd` and
    :meth:`describe_exit`; a launcher whose process is not the rank itself (the ssh
    client) overrides them.
    """

    rank: int
    popen: subprocess.Popen[bytes]
    copiers: tuple[LineCopier, ...]
    _pidfd: int | None = field(default=None, init=False, repr=False)

    def signal_group(self, sig: int) -> None:
        """Signal the rank's whole process group (its session, started by us)."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, sig: int) -> None:
        """Ask the rank to stop (here: ``sig`` to its process group)."""
        self.signal_group(sig)

    def kill(self) -> None:
        """Stop the rank now (and sweep what it left in its process group)."""
        self.signal_group(signal.SIGKILL)

    def exit_fd(self) -> int | None:
        """A descriptor that becomes readable when the rank's process exits (a pidfd,
        closed by :meth:`close_exit_fd`); None where the system has none."""
        if self._pidfd is None and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(self.popen.pid)
            except OSError:
                self._pidfd = -1
        return None if self._pidfd is None or self._pidfd < 0 else self._pidfd

    def close_exit_fd(self) -> None:
        if self._pidfd is not None and self._pidfd >= 0:
            os.close(self._pidfd)
        self._pidfd = -1

    def describe_exit(self, code: int) -> str:
        """``rank R exited with code C`` / ``rank R was killed by SIGNAME``."""
        return f"rank {self.rank} {describe_exit(code)}"


# --------------------------------------------------------------------------------------
# Supervision
# --------------------------------------------------------------------------------------


class LauncherSignals:
    """Record SIGINT/SIGTERM to the launcher while ranks run (main thread only; elsewhere
    nothing is recorded and the signals keep their handlers)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def job_token() -> str | None:
    """A fresh token for a job the launcher starts (its ranks get it in their environment),
    or None under ``RINGCOMM_SECURITY=none`` (no token anywhere)."""
    from ringcomm.config import security_mode

    return None if security_mode() == "none" else secrets.token_hex(32)


def store_announcer(host: str, port: int, token: str | None) -> Callable[[str, str], None]:
    """``announce(key, value)``: set a key in the job's store, from the launcher (a client
    connection made at the first call; best effort: a lost store is no launcher error)."""
    held: list[Any] = []

    def announce(key: str, value: str) -> None:
        from ringcomm.errors import RingcommError
        from ringcomm.rendezvous import Store

        try:
            if not held:
                held.append(
                    Store(
                        host,
                        port,
                        token=token,
                        timeout_s=5.0,
                        label="launcher",
                        auth=token is not None,
                    )
                )
            held[0].set(key, value.encode())
        except RingcommError as exc:
            note(f"could not tell the ranks ({key}): {exc}")

    return announce


_Slot = TypeVar("_Slot")


def start_ranks(start: Callable[[_Slot], RankProcess], slots: Iterable[_Slot]) -> list[RankProcess]:
    """``start(slot)`` for every slot, in order; if one fails, those already started are
    killed (:meth:`RankProcess.kill`) and waited for before the error is raised."""
    ranks: list[RankProcess] = []
    try:
        for slot in slots:
            ranks.append(start(slot))
    except BaseException:
        for r in ranks:
            r.kill()
            r.popen.wait()
        raise
    return ranks


def slot_restarter(
    max_restarts: int,
    announce: Callable[[str, str], None],
    start_again: Callable[[int, int], RankProcess],
    ranks: list[RankProcess],
    gives_up: Callable[[int], bool] = lambda code: False,
) -> Callable[[RankProcess, int], RankProcess | None]:
    """``--max-restarts``: what :func:`supervise` calls for a rank that failed: its slot
    started again, ``start_again(rank, n)`` (``RINGCOMM_RESTART`` = n, how many times), at
    most ``max_restarts`` times per slot and not after an exit code ``gives_up`` names. The
    ranks learn of it in the store first (``restarting/<slot>``: ``grow(wait=True)`` waits
    for it); the new process joins ``ranks``, so it is reaped with the others."""
    counts: dict[int, int] = {}

    def restart(failed: RankProcess, code: int) -> RankProcess | None:
        n = counts.get(failed.rank, 0) + 1
        if n > max_restarts or gives_up(code):
            return None
        counts[failed.rank] = n
        announce(f"restarting/{failed.rank}", str(n))
        note(f"{failed.describe_exit(code)}; starting it again (restart {n} of {max_restarts})")
        new = start_again(failed.rank, n)
        ranks.append(new)  # reaped with the others, whatever happens
        return new

    return restart


def supervise(
    ranks: Sequence[RankProcess],
    signals: LauncherSignals,
    grace_s: float,
    poll_s: float = 0.05,
    restart: Callable[[RankProcess, int], RankProcess | None] | None = None,
    trace_dir: str | None = None,
) -> int:
    """Wait for all ranks; on the first failure or signal stop the rest. Return the status:
    0, the first failing rank's (:func:`exit_status`), or 128+N for the launcher's signal N.
    ``restart(rank, code)``: for a rank that failed, its replacement (started), or None
    to stop the job as without it. ``trace_dir``: the ranks' ``RINGCOMM_TRACE_DIR``, where
    :func:`ask_for_traces` waits for their records before they are stopped."""
    running = {r.rank: r for r in ranks}
    while running:
        if signals.received:
            sig = signals.received[0]
            note(f"got {signal.Signals(sig).name}; stopping all ranks")
            ask_for_traces(ranks, trace_dir)
            stop_ranks(ranks, sig, grace_s, signals)
            return 128 + sig
        for rank, r in list(running.items()):
            code = r.popen.poll()
            if code is None:
                continue
            del running[rank]
            again = restart(r, code) if code != 0 and restart is not None else None
            if again is not None:
                running[rank] = again
                continue
            if code != 0:
                how = r.describe_exit(code)
                if running:
                    note(f"{how}; stopping the other ranks")
                else:
                    note(how)
                ask_for_traces(ranks, trace_dir)
                stop_ranks(ranks, signal.SIGTERM, grace_s, signals)
                return exit_status(code)
        if running:
            wait_for_exits(list(running.values()), poll_s)
    return 0


def wait_for_exits(ranks: Sequence[RankProcess], timeout_s: float) -> None:
    """Sleep until one of ``ranks`` exits, at most ``timeout_s``: the first failure is
    seen as it happens (Linux pidfds), so ranks that fail moments apart keep their order."""
    fds = [fd for fd in (r.exit_fd() for r in ranks) if fd is not None]
    if len(fds) < len(ranks):
        time.sleep(timeout_s)
        return
    select.select(fds, [], [], timeout_s)


def ask_for_traces(
    ranks: Sequence[RankProcess], trace_dir: str | None, wait_s: float = TRACE_WAIT_S
) -> list[int]:
    """With a trace directory: SIGUSR1 to every rank still running (its group's handler
    writes its flight record there, ringcomm.core.flight), then wait until each has written
    ``rank<N>.json`` since, at most ``wait_s``. The ranks that wrote one."""
    if not trace_dir or not hasattr(signal, "SIGUSR1"):
        return []
    asked = [r for r in ranks if r.popen.poll() is None]
    since = time.time()
    for r in asked:
        try:
            os.kill(r.popen.pid, signal.SIGUSR1)  # the rank itself, not its whole session
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    wrote: list[int] = []
    while True:
        wrote = [r.rank for r in asked if _written_since(trace_dir, r.rank, since)]
        pending = [r for r in asked if r.rank not in wrote and r.popen.poll() is None]
        if not pending or time.monotonic() >= deadline:
            return wrote
        time.sleep(0.02)  # polling the files (no other signal that a rank wrote one)


def _written_since(trace_dir: str, rank: int, since: float) -> bool:
    try:
        return os.stat(os.path.join(trace_dir, f"rank{rank}.json")).st_mtime >= since - 0.01
    except OSError:
        return False


def stop_ranks(
    ranks: Sequence[RankProcess], sig: int, grace_s: float, signals: LauncherSignals
) -> None:
    """``stop(sig)`` every running rank; after ``grace_s`` (or a second signal to the
    launcher) ``kill()`` them all. Returns when every rank has exited."""
    seen = len(signals.received)
    for r in ranks:
        if r.popen.poll() is None:
            r.stop(sig)
    deadline = time.monotonic() + grace_s
    while any(r.popen.poll() is None for r in ranks):
        if time.monotonic() >= deadline or len(signals.received) > seen:  # impatient user
            break
        time.sleep(0.02)
    for r in ranks:  # also sweeps what exited ranks left in their sessions
        r.kill()
    for r in ranks:
        r.popen.wait()


def join_copiers(ranks: Sequence[RankProcess], timeout_s: float) -> None:
    """Let the output copiers drain; a grandchild holding a pipe open must not hang us."""
    deadline = time.monotonic() + timeout_s
    for r in ranks:
        r.close_exit_fd()
        for c in r.copiers:
            c.thread.join(max(0.0, deadline - time.monotonic()))


def reap(ranks: Sequence[RankProcess], copier_timeout_s: float = 5.0) -> None:
    """Kill and wait for every rank still running, then :func:`join_copiers`: what a
    launcher does last, whatever happened before."""
    for r in ranks:
        if r.popen.poll() is None:
            r.kill()
            r.popen.wait()
    join_copiers(ranks, copier_timeout_s)
