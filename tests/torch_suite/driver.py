"""PyTorch's backend-conformance suite (``DistributedTest._DistTestBase`` from
``torch/testing/_internal/distributed/distributed_test.py``) on the ringcomm backend.

Upstream drives the suite with ``test/distributed/test_distributed_spawn.py`` and the
environment ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR``, ``INIT_METHOD``; this is the same
driver with one twist. The suite's test bodies branch on the *name* in ``BACKEND`` (CPU
tensors for "gloo", CUDA devices for "nccl", whole tests gated on ``BACKEND != "gloo"``),
so ``BACKEND`` stays "gloo" (the bodies take Gloo's CPU branches) while the process
groups are created on the backend named by ``RINGCOMM_SUITE_BACKEND`` (default
"ringcomm"; "gloo" gives the reference run). Every rank imports ``ringcomm.torch_backend``
(at import of this module, before the test's ``init_process_group``), and:

* ``dist.init_process_group(backend="gloo")`` -> the suite backend; ``new_group()`` then
  inherits it. A ``new_group(backend="gloo")`` the suite asks for by name (the
  ``monitored_barrier`` tests, which torch refuses on any backend not named gloo) stays
  Gloo.
* "ringcomm" is admitted as a plugin with the "ddp" and "subgroup" features
  (``DistTestCases.backend_feature``), as upstream admits a third-party backend.

Run (the full suite, 285 tests: 2.5-6 minutes per world size on 2 busy cores)::

    RINGCOMM_SUITE_BACKEND=ringcomm WORLD_SIZE=2 python -m pytest \
        tests/torch_suite/driver.py -p no:cacheprovider -q -o addopts= --timeout 300 \
        --junitxml=rc_w2.xml
    python tests/torch_suite/compare.py gloo_w2.xml rc_w2.xml

``tests/test_torch_suite.py`` runs a subset in CI and checks the exclusion list
(:mod:`exclusions`); ``tests/torch_suite/compare.py`` turns two junit files into the
table of ``benchmarks/results/torch_suite.md``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

# Before distributed_test is imported: it reads these at import.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="ringcomm-suite-")
# file:// admits the suite's timeout tests (each test then gets its own file, setUp).
os.environ.setdefault("INIT_METHOD", f"file://{os.environ['TEMP_DIR']}/init")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.distributed as dist

import ringcomm.torch_backend  # noqa: F401  (registers "ringcomm" in every rank)

SUITE_BACKEND = os.environ.get("RINGCOMM_SUITE_BACKEND", "ringcomm")
#: "fork" (default: ranks start in a fraction of a second from this already-imported
#: process; nothing here has formed a process group or started a thread of ringcomm's) or
#: "spawn" (upstream's choice: every rank imports torch and the suite afresh, ~10 s a test
#: on 2 busy cores).
START_METHOD = os.environ.get("RINGCOMM_SUITE_START", "fork")

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

for _feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[_feature].add("ringcomm")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

_init_process_group = dist.init_process_group


def _init_on_suite_backend(*args: Any, **kwargs: Any) -> Any:
    """``dist.init_process_group`` with the suite's "gloo" read as the suite backend."""
    backend = kwargs.get("backend")
    if backend is None and len(args) > 0:
        backend = args[0]
        args = args[1:]
    if backend is None or str(backend).lower() == "gloo":
        backend = SUITE_BACKEND
    kwargs["backend"] = backend
    return _init_process_group(*args, **kwargs)


class TestRingcommSuite(TestDistBackend, DistributedTest._DistTestBase):
    """Every test of ``_DistTestBase``, each in ``WORLD_SIZE`` fresh spawned ranks."""

    def setUp(self) -> None:
        super().setUp()
        if START_METHOD == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
        # In the spawned rank, before the suite's own init_process_group.
        dist.init_process_group = _init_on_suite_backend
        super()._run(rank, test_name, file_name, pipe, **kwargs)


if __name__ == "__main__":
    sys.exit(run_tests())
