"""GPUs end to end (``pytest -m gpu``; skipped, with the reason, without a GPU): the
transformer's strategies on CuPy, and the torch backend on CUDA tensors.

What the CPU suite shows through the stand-ins (``test_engine_device``: the transformer on
the stand-in device; ``test_torch_device``: the backend's device path with fake streams)
and only a GPU can: CuPy's kernels and cuBLAS computing the model, DLPack between torch and
CuPy, torch's and CuPy's streams agreeing, CUDA futures. Run by
``scripts/gpu_check_train.sh`` (from ``scripts/gpu_check.sh``):

* every strategy of the transformer (single, dp, zero1/2/3, pipeline, tp with and without
  sequence parallel, 3d meshes) on CuPy equals NumPy's ``single`` (float64 1e-9, float32
  1e-4, as ``test_gpu``'s MLP cases), at W = 2 and 4 on one GPU (ranks share it);
* DDP (plain, comm hooks) and FSDP2 on a CUDA model through ``"ringcomm"`` equal the same
  job on Gloo with CUDA tensors, with two ranks sharing a GPU (NCCL refuses that: "Duplicate
  GPU detected"); with one rank per GPU (two GPUs or more) also NCCL's, within 1e-5;
* the collectives on CUDA tensors at W = 3 sharing a GPU, in a job that mixes CPU calls;
  a producer kernel on a side stream right before a call (the call sees its result), a
  consumer on another stream after ``wait()`` (it sees the result), futures; no copy
  (the CuPy array is the tensor's memory); bad input at the call (a CPU output for a CUDA
  input, a non-contiguous CUDA tensor, a tensor on another GPU than the rank's).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from conftest import compare_to_single

import ringcomm as rc
from ringcomm.device.xp import cupy_or_none


def _why_no_gpu() -> str | None:
    cp = cupy_or_none()
    if cp is None:
        return "CuPy is not installed (pip install 'ringcomm[gpu]')"
    try:
        if int(cp.cuda.runtime.getDeviceCount()) < 1:
            return "CuPy finds no GPU"
    except Exception as exc:  # noqa: BLE001 (no driver / no device: CuPy's own error)
        return f"CuPy finds no usable GPU: {exc}"
    return None


def _why_no_torch_cuda() -> str | None:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch has no CUDA here"
    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with Gloo is not available"
    return None


_REASON = _why_no_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]
_TORCH_REASON = _REASON or _why_no_torch_cuda()
needs_torch_cuda = pytest.mark.skipif(_TORCH_REASON is not None, reason=str(_TORCH_REASON))

#: CuPy against NumPy's single (the reasons: ``test_gpu.ENGINE_TOL``).
TOL = {"float64": 1e-9, "float32": 1e-4}


# -- the transformer on CuPy ---------------------------------------------------------------
def transformer_cases(n: int, device: str = "cuda") -> list[Any]:
    """``test_engine_device``'s stand-in matrix at world size ``n``, on ``device``."""
    from test_engine_device import TRANSFORMER_CASES

    return [dataclasses.replace(cfg, device=device) for cfg in TRANSFORMER_CASES[n]]


DTYPES = ("float64", "float32")


def _single_cfg(cfg: Any, dtype: str) -> Any:
    """``single`` of ``cfg``'s model on ``cfg``'s device."""
    mesh = {"dp": 1, "pp": 1, "tp": 1, "sequence_parallel": False, "zero": 0}
    return dataclasses.replace(cfg, strategy="single", world_size=1, dtype=dtype, **mesh)


def transformer_job(pg: rc.ProcessGroup, cases: list[Any]) -> dict[str, Any]:
    """Every case on a fresh sub-group; rank 0 also runs ``single`` on the device."""
    from ringcomm.engine.train import train_rank

    keep = (
        "losses",
        "params",
        "loss_rank",
        "array_module",
        "device_id",
        "peak_bytes",
        "param_bytes",
        "grad_bytes",
        "optim_bytes",
        "staging_acquires",
    )
    singles = []
    if pg.rank == 0:
        for dtype in DTYPES:
            res = train_rank(None, _single_cfg(cases[0], dtype))
            singles.append({k: v for k, v in res.items() if k in keep})
    rows = []
    for cfg in cases:
        sub = pg.new_group(range(pg.world_size))
        try:
            rows.append({k: v for k, v in train_rank(sub, cfg).items() if k in keep})
        finally:
            sub.close()
    return {"singles": singles, "cases": rows}


def check_transformer_results(
    per_rank: list[dict[str, Any]], cases: list[Any], module: str, gpus: int | None = None
) -> list[str]:
    """Failure lines: losses and parameters against NumPy's ``single``, arrays of
    ``module`` (on GPU ``rank % gpus`` when ``gpus`` is given), the device path used,
    memory readings that hold at least the model state."""
    from test_engine_device import _tlabel, _tsingle

    failures: list[str] = []
    n = len(per_rank)
    singles = per_rank[0]["singles"]
    runs = [(_single_cfg(cases[0], d), [s]) for d, s in zip(DTYPES, singles, strict=True)]
    runs += [(cfg, [per_rank[r]["cases"][k] for r in range(n)]) for k, cfg in enumerate(cases)]
    for cfg, results in runs:
        label = _tlabel(cfg) + f"-{cfg.device}"
        for rank, res in enumerate(results):
            want_id = None if gpus is None else rank % gpus
            if res["array_module"] != module or res["device_id"] != want_id:
                failures.append(
                    f"{label}: rank {rank} on {res['array_module']}, device {res['device_id']}"
                )
            state = res["param_bytes"] + res["grad_bytes"] + res["optim_bytes"]
            if res["peak_bytes"] < state:
                failures.append(f"{label}: rank {rank}: peak {res['peak_bytes']} < state {state}")
            # (the stand-in's device path is the staged one; a GPU's may be another)
            if module != "cupy" and cfg.strategy != "single" and not res["staging_acquires"]:
                failures.append(f"{label}: rank {rank} took no device path")
        compare_to_single(failures, label, results, _tsingle(cfg.dtype), cfg.steps, TOL[cfg.dtype])
    return failures


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_transformer_strategies_match_single_on_cupy(world_size: int) -> None:
    cases = transformer_cases(world_size)
    per_rank = rc.spawn(transformer_job, world_size, args=(cases,), timeout_s=280)
    gpus = int(cupy_or_none().cuda.runtime.getDeviceCount())  # type: ignore[union-attr]
    failures = check_transformer_results(per_rank, cases, "cupy", gpus)
    assert not failures, "\n".join(failures)


# -- the torch backend on CUDA tensors ------------------------------------------------------
def _set_device(rank: int) -> Any:
    import torch

    index = rank % torch.cuda.device_count()  # several ranks share a GPU where there are few
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _model(device: Any) -> Any:
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    return model.to(device)


def _train(rank: int, wrapped: Any, device: Any, steps: int = 5) -> list[float]:
    """SGD on per-rank data (drawn on the host from a rank seed, then copied over)."""
    import torch

    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen).to(device)
        y = torch.randn(16, 4, generator=gen).to(device)
        loss = ((wrapped(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _flat(model: Any) -> Any:
    import torch

    ps = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in ps]).cpu().numpy().copy()


def _ddp(rank: int, group: Any, hook: Any, device: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(device)
    ddp = DDP(model, device_ids=[device.index], process_group=group)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    _train(rank, ddp, device)
    return _flat(model)


def _fsdp(rank: int, group: Any, device: Any) -> Any:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = _model(device)
    mesh = DeviceMesh.from_group(group, "cuda")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(rank, model, device)
    return _flat(model)


def cuda_training_job(rank: int, world_size: int, store_path: str) -> dict[str, Any]:
    """DDP (plain and with comm hooks) and FSDP2 on a CUDA model, on ringcomm (the world
    group), on Gloo with CUDA tensors and, one rank per GPU, on NCCL."""
    import torch
    import torch.distributed as dist
    from test_torch_backend import _init
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    device = _set_device(rank)
    _init(rank, world_size, store_path)
    groups = {"ringcomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    if torch.cuda.device_count() >= world_size and dist.is_nccl_available():
        groups["nccl"] = dist.new_group(backend="nccl")
    report: dict[str, Any] = {"init": _flat(_model(device)), "backends": sorted(groups)}
    hooks = {
        "ddp": None,
        "ddp_allreduce_hook": default_hooks.allreduce_hook,
        "ddp_fp16_hook": default_hooks.fp16_compress_hook,
    }
    for name, hook in hooks.items():
        report[name] = {b: _ddp(rank, g, hook, device) for b, g in groups.items()}
    report["fsdp2"] = {}
    for b, g in groups.items():
        try:
            report["fsdp2"][b] = _fsdp(rank, g, device)
        except Exception as exc:
            if b == "ringcomm":
                raise
            report["fsdp2"][b] = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    return report


@needs_torch_cuda
@pytest.mark.timeout(300)
def test_ddp_and_fsdp2_on_cuda_equal_gloo(tmp_path: Path) -> None:
    import numpy as np
    from test_torch_backend import run_job

    reports = run_job(cuda_training_job, 2, (str(tmp_path / "store"),), timeout_s=280)
    init = reports[0]["init"]
    # W=2: every algorithm adds a+b, the same bits as Gloo; NCCL's kernels may round apart.
    for name in ("ddp", "ddp_allreduce_hook", "ddp_fp16_hook", "fsdp2"):
        for r, rep in enumerate(reports):
            mine = rep[name]["ringcomm"]
            assert np.abs(mine - init).max() > 1e-3, f"{name}: rank {r} did not train"
            gloo = rep[name]["gloo"]
            if isinstance(gloo, str):  # Gloo refused FSDP2 on CUDA: DDP on Gloo is the oracle
                print(f"{name}: Gloo on CUDA tensors refused ({gloo}); against DDP on Gloo")
                np.testing.assert_allclose(mine, rep["ddp"]["gloo"], rtol=0, atol=1e-5)
            else:
                assert np.array_equal(mine, gloo), (
                    f"{name} rank {r}: not bitwise equal to Gloo, max diff "
                    f"{np.abs(mine - gloo).max()}"
                )
            if "nccl" in rep[name] and not isinstance(rep[name]["nccl"], str):
                np.testing.assert_allclose(mine, rep[name]["nccl"], rtol=0, atol=1e-5)
    print("backends compared:", reports[0]["backends"])


def cuda_collectives_job(rank: int, world_size: int, store_path: str) -> dict[str, str]:
    """Collectives on CUDA tensors (ranks share the GPU), mixed with CPU calls; stream
    order; no copy; bad input. Returns {check: 'ok' | failure text}."""
    import traceback

    import torch
    import torch.distributed as dist
    from test_torch_backend import _init

    device = _set_device(rank)
    _init(rank, world_size, store_path)
    W, R = world_size, rank
    out: dict[str, str] = {}

    def check(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "ok"
        except Exception:  # noqa: BLE001 (the report names the failing check)
            out[name] = traceback.format_exc()

    def full(value: float, n: int = 1000, dtype: Any = torch.float32) -> Any:
        return torch.full((n,), value, dtype=dtype, device=device)

    def collectives() -> None:
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8):
            t = full(R + 1, 37, dtype)
            dist.all_reduce(t)
            assert torch.equal(t, full(W * (W + 1) // 2, 37, dtype)), dtype
        b = torch.tensor([R == 0, True], device=device)
        dist.all_reduce(b, op=dist.ReduceOp.BAND)
        assert b.tolist() == [W == 1, True]
        big = torch.empty(W * 6, device=device)
        dist.all_gather_into_tensor(big, full(R, 6))
        assert torch.equal(big.cpu(), torch.arange(W).repeat_interleave(6).float())
        o = torch.empty(5, device=device)
        dist.reduce_scatter_tensor(o, torch.arange(W * 5.0, device=device))
        assert torch.equal(o.cpu(), torch.arange(R * 5.0, R * 5.0 + 5) * W)
        t = full(R, 9, torch.float64)
        dist.broadcast(t, src=W - 1)
        assert torch.equal(t, full(W - 1, 9, torch.float64))
        x = torch.arange(W * 2.0, device=device) + 100 * R
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        assert y.cpu().tolist() == [100 * r + 2 * R + k for r in range(W) for k in range(2)]
        got = torch.empty(4, device=device)
        req = dist.irecv(got, src=(R - 1) % W, tag=5)
        dist.send(full(R, 4), dst=(R + 1) % W, tag=5)
        req.wait()
        assert torch.equal(got, full((R - 1) % W, 4))
        glist = [torch.empty(3, device=device) for _ in range(W)] if R == 0 else None
        dist.gather(full(R, 3), glist, dst=0)
        if R == 0:
            assert all(torch.equal(glist[r], full(r, 3)) for r in range(W))

    def mixed_cpu_and_cuda() -> None:
        c = torch.full((6,), float(R))
        dist.all_reduce(c)  # a CPU call between CUDA calls, same group
        g = full(R, 6)
        dist.all_reduce(g)
        assert torch.equal(c, torch.full((6,), float(sum(range(W)))))
        assert torch.equal(g.cpu(), c)

    def producer_on_a_side_stream() -> None:
        """The kernel producing the tensor is still running on the caller's stream when
        the call is made (a long sleep before it): the call must read its result."""
        s1 = torch.cuda.Stream()
        for k in range(3):
            t = torch.zeros(1 << 20, device=device)
            with torch.cuda.stream(s1):
                torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time on s1
                t.fill_(R + 1 + k)
                dist.all_reduce(t)  # ordered after the fill: no race
                total = t.sum()
            assert float(total) == (W * (W + 1) // 2 + W * k) * (1 << 20), k

    def consumer_on_another_stream() -> None:
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        t = full(R + 1, 1 << 20)
        with torch.cuda.stream(s1):
            work = dist.all_reduce(t, async_op=True)
        with torch.cuda.stream(s2):
            work.wait()  # s2 waits for the result (the host need not)
            doubled = t * 2
        s2.synchronize()
        assert torch.equal(doubled, full(W * (W + 1), 1 << 20))
        with torch.cuda.stream(s1):
            fut = dist.all_reduce(full(1.0, 64), async_op=True).get_future()
        assert torch.equal(fut.then(lambda f: f.value()[0] + 1).wait(), full(W + 1.0, 64))
        assert work.is_completed()

    def output_not_reused_early() -> None:
        """Async calls on tensors the caller drops at once: the Work keeps them (their
        memory is not handed to another tensor while ringcomm still writes it), and every
        result read through the Work is right despite the allocator's churn."""
        works = []
        for k in range(8):
            t = full(R + k, 4096)
            works.append(dist.all_reduce(t, async_op=True))
            del t
            torch.empty(4096 * 4, device=device).fill_(-1.0)  # churn the caching allocator
        for k, w in enumerate(works):
            w.wait()
            assert torch.equal(w.result()[0], full(sum(range(W)) + W * k, 4096)), k

    def zero_copy() -> None:
        from ringcomm.torch_backend.device import CudaDevice

        t = torch.arange(10.0, device=device)
        a = CudaDevice().array(t)
        assert a.data.ptr == t.data_ptr() and a.shape == (10,)

    def bad_input() -> None:
        what = f"ringcomm backend rank {R}"
        with pytest.raises(ValueError, match=rf"{what}: all_gather_into_tensor: a tensor on cpu"):
            dist.all_gather_into_tensor(torch.empty(W * 2), full(1.0, 2))
        with pytest.raises(ValueError, match=rf"{what}: allreduce: a non-contiguous cuda"):
            dist.all_reduce(torch.zeros(4, 6, device=device)[:, ::2])
        if torch.cuda.device_count() > 1:
            other = (device.index + 1) % torch.cuda.device_count()
            with pytest.raises(ValueError, match=rf"{what}: broadcast: a tensor on cuda:{other}"):
                dist.broadcast(torch.ones(3, device=f"cuda:{other}"), src=0)
        t = full(1.0, 5)  # nothing was sent: still in step
        dist.all_reduce(t)
        assert torch.equal(t, full(float(W), 5))

    for fn in (
        collectives,
        mixed_cpu_and_cuda,
        producer_on_a_side_stream,
        consumer_on_another_stream,
        output_not_reused_early,
        zero_copy,
        bad_input,
    ):
        check(fn.__name__, fn)
    dist.destroy_process_group()
    return out


@needs_torch_cuda
@pytest.mark.timeout(300)
def test_cuda_tensor_collectives_ranks_sharing_a_gpu(tmp_path: Path) -> None:
    from test_torch_backend import run_job

    reports = run_job(cuda_collectives_job, 3, (str(tmp_path / "store"),), timeout_s=280)
    failures = [
        f"rank {r} {name}: {text}"
        for r, rep in enumerate(reports)
        for name, text in rep.items()
        if text != "ok"
    ]
    assert len(reports[0]) == 7 and not failures, "\n".join(failures)


@needs_torch_cuda
def test_registered_for_cpu_and_cuda() -> None:
    import torch.distributed as dist

    import ringcomm.torch_backend  # noqa: F401  (registers "ringcomm")

    assert dist.Backend.backend_capability["ringcomm"] == ["cpu", "cuda"]
