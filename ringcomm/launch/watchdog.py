"""Remote rank watchdog: tie a rank's life to its ssh connection (standard library only).

A plain ssh client that dies leaves its remote command running. ``ringcomm run --hostfile``
therefore starts each remote rank as::

    python -m ringcomm.launch.watchdog [--grace-s S] [--env-stdin] -- python -u script.py ...

The watchdog

1. with ``--env-stdin``, first reads one line from its stdin: a JSON object of variables
   to add to the rank's environment (how the launcher hands over ``RINGCOMM_TOKEN``
   without putting it on any command line, local or remote);
2. starts the rank in its own session (so the rank's whole process group can be
   signalled), stdin ``/dev/null``, stdout/stderr inherited (the ssh channel);
3. reads its own stdin until EOF. EOF means the launcher closed the pipe on purpose
   (stop this rank) or is gone (SIGKILLed, connection lost: sshd closes the channel).
   EOF, SIGTERM, SIGHUP or SIGINT make it send SIGTERM to the rank's process group,
   then SIGKILL after ``--grace-s`` seconds;
4. exits with the rank's status (its code, or 128+N for a death by signal N). When the
   rank exits by itself, what it left in its process group is killed too.

Nothing here may import ringcomm's dependencies: only the standard library.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import FrameType

__all__ = [
    "DEFAULT_GRACE_S",
    "EXIT_USAGE",
    "exit_status",
    "main",
    "pdeathsig_preexec",
    "read_env_line",
    "watch",
]

DEFAULT_GRACE_S = 3.0
#: Exit status for a bad command line or a malformed ``--env-stdin`` line.
EXIT_USAGE = 2
_PROG = "ringcomm watchdog"
_MAX_ENV_LINE_BYTES = 1 << 20


def read_env_line(fd: int) -> tuple[dict[str, str], bytes]:
    """Read one line from ``fd``: a JSON object of string variables.

    Returns the variables and whatever was read past the newline. Raises ``ValueError``
    on EOF before a newline, on an over-long line, or on anything but ``{str: str}``.
    """
    buf = b""
    while b"\n" not in buf:
        chunk = os.read(fd, 65536)
        if not chunk:
            raise ValueError("stdin closed before the environment line arrived")
        buf += chunk
        if len(buf) > _MAX_ENV_LINE_BYTES:
            raise ValueError(f"environment line longer than {_MAX_ENV_LINE_BYTES} bytes")
    line, rest = buf.split(b"\n", 1)
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"environment line is not JSON: {exc}") from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError("environment line must be a JSON object of strings")
    return value, rest


def pdeathsig_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies (Linux).

    The kernel sends it when the *thread* that forked the child exits, so children must be
    started from a thread that outlives them (the launchers and the watchdog start them from
    their caller's). None where the system has no ``prctl``.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    parent = os.getpid()

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_status(returncode: int) -> int:
    """A shell-style status: the code itself, or 128+N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _note(message: str) -> None:
    try:
        print(f"{_PROG}: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # the channel is gone; nothing to tell


def watch(
    command: Sequence[str],
    *,
    grace_s: float = DEFAULT_GRACE_S,
    extra_env: Mapping[str, str] | None = None,
    stdin_fd: int = 0,
    poll_s: float = 0.05,
) -> int:
    """Run ``command`` as described in the module docstring; return the exit status."""
    # The one environment read outside ringcomm.config: this program imports only the
    # standard library (tests/test_launch_ssh_watchdog.py): it reads its own.
    env = dict(os.environ)
    env.update(extra_env or {})
    stop = threading.Event()
    reason: list[str] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        reason.append(signal.Signals(signum).name)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, on_signal)

    try:
        child = subprocess.Popen(
            list(command),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=pdeathsig_preexec(),  # noqa: PLW1509  (prctl + getppid only)
        )
    except OSError as exc:
        _note(f"cannot start {command[0]!r}: {exc}")
        return 127

    def wait_eof() -> None:
        try:
            while os.read(stdin_fd, 65536):
                pass
        except OSError:
            pass
        reason.append("stdin closed")
        stop.set()

    threading.Thread(target=wait_eof, name="ringcomm-watchdog-stdin", daemon=True).start()

    while child.poll() is None and not stop.wait(poll_s):
        pass
    if child.poll() is None:
        # Stop requested: SIGTERM the rank's group, SIGKILL what is left after the grace.
        _killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    _killpg(child.pid, signal.SIGKILL)  # also sweeps what the rank left in its group
    code = child.wait()
    return exit_status(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Run a command in its own session; stop it when stdin reaches EOF.",
    )
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S, metavar="S")
    parser.add_argument(
        "--env-stdin",
        action="store_true",
        help="read a JSON object of extra variables from the first line of stdin",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        _note("error: no command given (usage: ... watchdog [options] -- cmd args...)")
        return EXIT_USAGE
    if not args.grace_s >= 0:
        _note(f"error: --grace-s must be >= 0, got {args.grace_s}")
        return EXIT_USAGE
    extra: dict[str, str] = {}
    if args.env_stdin:
        try:
            extra, _ = read_env_line(0)
        except (ValueError, OSError) as exc:
            _note(f"error: {exc}")
            return EXIT_USAGE
    return watch(command, grace_s=args.grace_s, extra_env=extra)


if __name__ == "__main__":
    sys.exit(main())
