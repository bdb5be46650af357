"""One way out: however a rank's process ends, it ends promptly and its peers learn why.

A process that formed a group registers it (:func:`register`); the first registration
installs the hooks: ``sys.excepthook`` (chained; leaves with :data:`DEPART_ERROR` and the
exception), ``atexit`` (:data:`DEPART_EXIT`), and SIGTERM/SIGHUP when their handler is the
default and the registration runs on the main thread (a farewell over fresh connections,
then the signal's default action). SIGINT keeps Python's handling.

Invariants: nothing else in ringcomm closes at exit (no ``__del__`` does I/O); every leave
runs on a helper thread joined for at most :data:`EXIT_BUDGET_S`, so a blocked libzmq
never keeps the process alive; ``os._exit`` and SIGKILL run no hook (peers see the dropped
connection). Each path in full: docs/architecture.md, section "core/lifecycle.py".
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Protocol

__all__ = [
    "DEPART_ERROR",
    "DEPART_EXIT",
    "EXIT_BUDGET_S",
    "Leaver",
    "describe_exit",
    "leave_within",
    "register",
    "unregister",
]

#: How a process leaves (the values the progress engine's goodbyes carry).
DEPART_EXIT = "exit"
DEPART_ERROR = "error"
#: Longest a process spends leaving its groups at exit before it goes anyway.
EXIT_BUDGET_S = 1.5
#: Longest exception text put in a farewell.
_WHY_MAX = 500
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Leaver(Protocol):
    """What a registered group does when its process goes down."""

    def leave(self, kind: str, why: str, budget_s: float) -> None:
        """Close: ``kind`` :data:`DEPART_EXIT` or :data:`DEPART_ERROR` (``why`` says what
        happened), spending at most about ``budget_s``."""

    def farewell(self, why: str) -> None:
        """Tell peers at once, from a signal handler: no lock, no data socket."""


_lock = threading.Lock()
_live: dict[int, Leaver] = {}
_installed = False
_previous_excepthook: Callable[..., object] | None = None


def register(leaver: Leaver) -> None:
    """Have ``leaver`` closed however the process ends (until :func:`unregister`)."""
    with _lock:
        _live[id(leaver)] = leaver
        _install()


def unregister(leaver: Leaver) -> None:
    with _lock:
        _live.pop(id(leaver), None)


def describe_exit(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, as a farewell carries it (truncated)."""
    text = str(exc)
    why = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return why if len(why) <= _WHY_MAX else why[: _WHY_MAX - 3] + "..."


def leave_within(fn: Callable[[], None], budget_s: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread; wait at most ``budget_s``. False (and a line on
    stderr) when it did not finish: the caller goes on without it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 (reported below, never raised at exit)
            errors.append(exc)

    thread = threading.Thread(target=run, name="ringcomm-exit", daemon=True)
    thread.start()
    thread.join(budget_s)
    if thread.is_alive():
        _say(f"{what} took more than {budget_s:g} s; leaving without waiting for it")
        return False
    if errors:
        _say(f"{what} failed: {describe_exit(errors[0])}")
    return True


def _say(line: str) -> None:
    try:
        sys.stderr.write(f"ringcomm: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass  # no stderr left at exit


def _install() -> None:
    """Install the hooks once (``_lock`` held)."""
    global _installed, _previous_excepthook  # noqa: PLW0603 (the one process-wide exit hook)
    if _installed:
        return
    _installed = True
    atexit.register(_at_exit)
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            try:
                if signal.getsignal(sig) is signal.SIG_DFL:
                    signal.signal(sig, _on_signal)
            except (ValueError, OSError):  # not settable here
                pass


def _take_all() -> list[Leaver]:
    with _lock:
        leavers = list(_live.values())
        _live.clear()
    return leavers


def _leave_all(kind: str, why: str) -> None:
    leavers = _take_all()
    if not leavers:
        return

    def run() -> None:
        for leaver in leavers:
            leaver.leave(kind, why, EXIT_BUDGET_S)

    leave_within(run, EXIT_BUDGET_S, "closing the process group at exit")


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    previous = _previous_excepthook or sys.__excepthook__
    try:
        previous(exc_type, exc, tb)
    finally:
        # An interactive interpreter goes on after an uncaught exception.
        if not (sys.flags.interactive or hasattr(sys, "ps1")):
            _leave_all(DEPART_ERROR, describe_exit(exc))


def _at_exit() -> None:
    _leave_all(DEPART_EXIT, "")


def _on_signal(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    for leaver in _take_all():
        try:
            leaver.farewell(f"killed by {name}")
        except Exception:  # noqa: BLE001, S110 (dying anyway: the default action follows)
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
