"""Find processes by a tag in their environment (to prove none is left behind).

A test puts a unique ``RINGCOMM_TEST_TAG=<uuid>`` in the environment its processes inherit,
then scans ``/proc/*/environ`` for it. Zombies (empty environ) do not count.
"""

from __future__ import annotations

import os
import time

TAG_VAR = "RINGCOMM_TEST_TAG"


def processes_with_tag(tag: str, *, exclude: tuple[int, ...] = ()) -> list[tuple[int, str]]:
    """(pid, cmdline) of every live process whose environment holds ``TAG_VAR=tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            if needle not in environ:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or not ours
            continue
        if "resource_tracker" in cmdline:  # multiprocessing's helper, lives with the parent
            continue
        found.append((int(name), cmdline))
    return found


def wait_gone(
    tag: str, timeout_s: float, *, exclude: tuple[int, ...] = ()
) -> list[tuple[int, str]]:
    """Poll until no tagged process is left or ``timeout_s`` passed; return what is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = processes_with_tag(tag, exclude=exclude)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)
