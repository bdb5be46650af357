"""The torch backend's device-tensor path on the CPU (``ringcomm.torch_backend.device``).

CUDA tensors cannot exist without a GPU, so the backend's device path is driven here by
the stand-in device: CPU tensors posing as device tensors (``use_standin``), which the
backend hands to ringcomm as stand-in device arrays on their memory (so ringcomm takes the
staged device path CuPy arrays take), with logging fake streams and events. What runs is
the backend's own device code: the checks at the call, the array conversion, the ordering
of each ringcomm call after the caller's stream, the steps after it on that stream, the
event the waiter's stream waits for, the future. What only a GPU can show (DLPack with
CuPy, torch's and CuPy's streams agreeing, a CUDA future): ``tests/test_gpu_e2e.py``.

* DDP (plain, comm hooks) and FSDP2 through the device path equal Gloo (bitwise at W=2).
* Every collective of ``test_torch_backend``'s matrix in a job that mixes host and device
  calls (contiguous tensors are "device" tensors, non-contiguous ones host tensors).
* Bad input at the call, naming rank and op, nothing sent: host and device tensors in one
  call, a non-contiguous device tensor, a tensor on another device than the rank's.
* The stream logic (one process): the ringcomm call ordered on the caller's stream, the
  steps after it on that stream, the end event recorded after them, ``wait()`` on another
  stream waits for that event, ``is_completed`` is False while the stream has not run it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.needs_torch
torch = pytest.importorskip(
    "torch", reason="needs_torch: torch is not installed (pip install 'ringcomm[torch]')"
)
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with Gloo is not available", allow_module_level=True)

from test_torch_backend import (  # noqa: E402 (after the skips above)
    COLLECTIVE_CHECKS,
    _check_training,
    _init,
    _inp,
    collectives_job,
    run_job,
    training_job,
)


def _device_path_calls() -> int:
    """Calls on the stand-in's device path: staging buffers taken, and calls through the
    device windows (``ipc``: device arrays on a group of one host)."""
    from ringcomm.device.ipc import ipc_device_for
    from ringcomm.device.staging import backend_for
    from ringcomm.device.standin import standin_array

    x = standin_array([0])
    return int(backend_for(x).pool.acquires) + ipc_device_for(x).calls


# -- the jobs (spawned ranks) --------------------------------------------------------------
def standin_training_job(rank: int, world_size: int, store_path: str) -> dict[str, Any]:
    from ringcomm.torch_backend.device import use_standin

    dev = use_standin()  # every CPU tensor of the ringcomm backend is a device tensor
    report = training_job(rank, world_size, store_path)
    report["device_path_calls"] = _device_path_calls()
    report["ordered_calls"] = sum(1 for what, *_ in dev.log if what == "ordered")
    return report


def standin_collectives_job(rank: int, world_size: int, store_path: str) -> dict[str, Any]:
    """test_torch_backend's collectives with contiguous tensors on the device path and
    non-contiguous ones on the host path (a job mixing both), then the device-only checks."""
    from ringcomm.torch_backend.device import use_standin

    dev = use_standin(claim=lambda t: t.is_contiguous())
    report: dict[str, Any] = dict(collectives_job(rank, world_size, store_path))
    report["device_path_calls"] = _device_path_calls()
    _init(rank, world_size, store_path + "2")
    W, R = world_size, rank
    errors: dict[str, str] = {}

    def bad(name: str, fn: Any) -> None:
        try:
            fn()
        except ValueError as exc:
            errors[name] = str(exc)
        else:
            errors[name] = "did not raise"

    # a host (non-contiguous: not claimed) output for a device input
    host_out = torch.empty(2 * W, 2).t()
    bad("mixed", lambda: dist.all_gather_into_tensor(host_out, torch.ones(2, 2)))
    bad("mixed_rs", lambda: dist.reduce_scatter_tensor(torch.empty(4, 2).t()[0], torch.ones(W)))
    dev.claim = None  # now every CPU tensor is a device tensor: a non-contiguous one too
    bad("non_contiguous", lambda: dist.all_reduce(torch.zeros(4, 6)[:, ::2]))
    dev.index_of = lambda t: 1  # a tensor "on device 1"; the rank is bound to device 0
    bad("other_device", lambda: dist.broadcast(torch.ones(3), src=0))
    dev.index_of = None
    # nothing was sent: the ranks are still in step
    t = _inp(R, 5, torch.float32)
    dist.all_reduce(t)
    report["after_errors"] = t.tolist()
    # ordering across streams: issued on s1, waited for on s2
    from ringcomm.torch_backend.device import FakeStream

    s1, s2 = FakeStream("s1"), FakeStream("s2")
    with dev.on_stream(s1):
        work = dist.all_reduce(torch.ones(8), async_op=True)
    with dev.on_stream(s2):
        work.wait()
    report["s1_log"] = [(w, s, repr(d)) for w, s, d in dev.log if s in ("s1", "s2")]
    report["s2_waits"] = [repr(e) for e in s2.waits]
    dist.destroy_process_group()
    report["errors"] = errors
    return report


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_and_fsdp2_on_the_device_path_equal_gloo(
    tmp_path: Path, no_child_processes: None
) -> None:
    reports = run_job(standin_training_job, 2, (str(tmp_path / "store"),), timeout_s=200)
    _check_training(reports, 2)
    for r, rep in enumerate(reports):
        assert rep["device_path_calls"] > 0, f"rank {r}: ringcomm never took the device path"
        assert rep["ordered_calls"] > 0, f"rank {r}: no call was ordered on a stream"


@pytest.fixture(scope="module")
def standin_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = tmp_path_factory.mktemp("standin") / "store"
    return run_job(standin_collectives_job, 2, (str(path),), timeout_s=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", COLLECTIVE_CHECKS)
def test_collectives_mixing_host_and_device_tensors(
    standin_reports: list[dict[str, Any]], check: str
) -> None:
    for rank, rep in enumerate(standin_reports):
        assert rep.get(check) == "ok", f"rank {rank}: {rep.get(check, 'did not run')}"
        assert rep["device_path_calls"] > 0


@pytest.mark.timeout(240)
def test_bad_device_input_fails_at_the_call(standin_reports: list[dict[str, Any]]) -> None:
    want = {
        "mixed": ("all_gather_into_tensor", "a tensor on cpu", "in a call on standin:0"),
        "mixed_rs": ("reduce_scatter_tensor", "a tensor on cpu"),
        "non_contiguous": ("allreduce", "non-contiguous", ".contiguous()"),
        "other_device": ("broadcast", "standin:1", "this rank's device is standin:0"),
    }
    for rank, rep in enumerate(standin_reports):
        for name, words in want.items():
            msg = rep["errors"][name]
            assert f"ringcomm backend rank {rank}" in msg, (name, msg)
            for w in words:
                assert w in msg, (name, w, msg)
        exp = (_inp(0, 5, torch.float32) + _inp(1, 5, torch.float32)).tolist()
        assert rep["after_errors"] == exp


@pytest.mark.timeout(240)
def test_work_is_ordered_on_the_callers_streams(standin_reports: list[dict[str, Any]]) -> None:
    for rep in standin_reports:
        log = rep["s1_log"]
        kinds = [(w, s) for w, s, _ in log]
        # the ringcomm call ordered on s1 (the issuing stream), the steps after it on s1,
        # the end event recorded on s1, and s2 (the waiter's) waits for that event
        assert kinds[0] == ("on_stream", "s1") and ("ordered", "s1") in kinds, log
        end = [d for w, s, d in log if (w, s) == ("record", "s1")]
        assert len(end) == 1, log
        assert rep["s2_waits"] == end, (rep["s2_waits"], end)
        # the steps after the ringcomm op ran on s1 (even though the waiter is on s2), the
        # event after them, and only then did s2 wait
        i_rec = kinds.index(("record", "s1"))
        assert kinds[i_rec - 1] == ("on_stream", "s1"), log
        assert i_rec < kinds.index(("wait", "s2")), log


# -- one process: the stream logic in detail -------------------------------------------------
@pytest.fixture
def one_rank_standin() -> Any:
    import ringcomm.torch_backend  # noqa: F401  (registers "ringcomm")
    from ringcomm.torch_backend.device import stop_standin, use_standin

    dev = use_standin()
    dist.init_process_group("ringcomm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dev
    finally:
        dist.destroy_process_group()
        stop_standin()


def test_is_completed_waits_for_the_callers_stream(one_rank_standin: Any) -> None:
    from ringcomm.torch_backend.device import FakeStream

    dev = one_rank_standin
    s1, s2 = FakeStream("s1"), FakeStream("s2")
    out = torch.empty(4)
    with dev.on_stream(s1):
        s1.hold()  # the GPU has not run s1's work yet
        work = dist.all_gather_into_tensor(out, torch.arange(4.0), async_op=True)
    fut = work.get_future()
    assert not work.is_completed(), "done before the caller's stream ran the steps after it"
    s1.release()
    assert work.is_completed()
    assert torch.equal(fut.wait()[0], torch.arange(4.0))
    with dev.on_stream(s2):
        assert work.wait() is True
    assert [repr(e) for e in s2.waits] == [repr(e) for w, s, e in dev.log if w == "record"]


def test_host_calls_touch_no_stream(one_rank_standin: Any) -> None:
    """A host tensor call (the stand-in claims none now) orders nothing, records nothing."""
    dev = one_rank_standin
    dev.claim = lambda t: False
    dev.log.clear()
    t = torch.ones(3)
    dist.all_reduce(t)
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    assert dev.log == [] and torch.equal(t, torch.ones(3))


def test_device_tensor_errors_name_rank_and_op(one_rank_standin: Any) -> None:
    dev = one_rank_standin
    with pytest.raises(ValueError, match="rank 0: allreduce: a non-contiguous"):
        dist.all_reduce(torch.zeros(3, 4).t())
    dev.claim = lambda t: t.dtype == torch.float64
    with pytest.raises(ValueError, match=r"rank 0: all_gather_into_tensor: a tensor on cpu"):
        dist.all_gather_into_tensor(torch.empty(2), torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="CPU tensors and CUDA tensors"):
        dist.all_reduce(torch.ones(2, device="meta"))
