"""Nothing left in /tmp (issue 29): a rank killed with SIGKILL cannot remove its ipc://
socket and lane folder, so the next process of the same user removes them (and nothing of
a process that is still alive); a rank that closes leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from launcher_results import clean_env

from ringcomm.transport.endpoints import private_dir

_SINGLETON = """
import json, sys
import ringcomm as rc
pg = rc.init_process_group(0, 1, env={})
t = pg.core.progress.transport
print(json.dumps({"ipc": t.ipc_endpoint, "lane": t.lane_endpoint}), flush=True)
if sys.argv[1] == "close":
    pg.close()
    print("closed", flush=True)
sys.stdin.read()
"""


@contextmanager
def _singleton(mode: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SINGLETON, mode],
        env=clean_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        if mode == "close":
            assert proc.stdout.readline().strip() == "closed"
        yield proc, info
    finally:
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _files(info: dict[str, Any]) -> list[str]:
    return [info["ipc"].removeprefix("ipc://"), info["lane"]]


@pytest.mark.timeout(60)
def test_a_killed_rank_leaves_nothing_once_the_next_one_starts() -> None:
    with _singleton("stay") as (proc, info):
        files = _files(info)
        folder = os.path.dirname(files[0])
        assert all(os.path.exists(f) for f in files), files
        assert os.path.basename(folder).startswith(f"{proc.pid}-")
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert os.path.exists(folder)  # a killed process cannot clean up
        mine = private_dir()  # this (live) process's folder, next to it
        with _singleton("stay") as (_, later):
            assert not os.path.exists(folder), "the next start did not remove it"
            assert all(os.path.exists(f) for f in _files(later))  # its own, alive
            assert os.path.isdir(mine)  # a live process's folder stays


@pytest.mark.timeout(60)
def test_a_closed_rank_leaves_nothing() -> None:
    with _singleton("close") as (_, info):
        files = _files(info)
        assert not any(os.path.exists(f) for f in files), files
        assert not os.path.exists(os.path.dirname(files[0]))
