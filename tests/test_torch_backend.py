"""ringcomm as a torch.distributed backend: training equal to Gloo, collectives, failures.

Each job is a few spawned processes (torch's start-up is the cost, so every job batches many
checks); the parent turns the returned reports into assertions. The oracle is Gloo in the
same processes (a ``dist.new_group(backend="gloo")`` next to the ringcomm world group),
trained from the same seeds on the same per-rank data.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.needs_torch  # selects the module in CI's optional-peer run
torch = pytest.importorskip(
    "torch", reason="needs_torch: torch is not installed (pip install 'ringcomm[torch]')"
)
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with Gloo is not available", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
STEPS = 5


# -- the harness ---------------------------------------------------------------------------
def _entry(
    fn: Callable[..., Any], rank: int, world_size: int, args: tuple[Any, ...], results: Any
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        results.put((rank, "err", traceback.format_exc()))


def run_job(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout_s: float
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return
    the results in rank order. Any rank's exception fails the job with its traceback; the
    deadline fails it too; no process outlives the call."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"job timed out after {timeout_s} s; ranks done: {sorted(got)}"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got
                ]
                if dead:
                    raise AssertionError(
                        f"ranks {dead} died: exit codes {[procs[r].exitcode for r in dead]}"
                    ) from None
                continue
            if status == "ok":
                got[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
        if errors:
            raise AssertionError("\n".join(errors))
        for p in procs:
            p.join(max(deadline - time.monotonic(), 5.0))
        return [got[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5.0)
        results.close()


def _init(rank: int, world_size: int, store_path: str, timeout_s: float = 60.0) -> None:
    import datetime

    import ringcomm.torch_backend  # noqa: F401  (registers "ringcomm")

    dist.init_process_group(
        "ringcomm",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _model() -> Any:
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def _train(rank: int, model: Any, wrapped: Any, steps: int = STEPS) -> list[float]:
    """SGD on per-rank data (rank-seeded), so only communication makes ranks agree."""
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen)
        y = torch.randn(16, 4, generator=gen)
        loss = ((wrapped(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _flat_params(model: Any) -> Any:
    ps = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in ps]).numpy().copy()


# -- the training job (W = 2 and 3) --------------------------------------------------------
def _ddp_run(rank: int, group: Any, hook: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    ddp = DDP(model, process_group=group)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    _train(rank, model, ddp)
    return _flat_params(model)


def _fsdp_run(rank: int, group: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(rank, model, model)
    return _flat_params(model)


def training_job(rank: int, world_size: int, store_path: str) -> dict[str, Any]:
    """DDP (plain and with comm hooks) and FSDP2, each on Gloo and on ringcomm."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    _init(rank, world_size, store_path)
    rc_group = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    report: dict[str, Any] = {"backend": dist.get_backend(), "init": _flat_params(_model())}
    hooks = {
        "ddp": None,
        "ddp_allreduce_hook": default_hooks.allreduce_hook,
        "ddp_fp16_hook": default_hooks.fp16_compress_hook,
    }
    for name, hook in hooks.items():
        report[name] = {
            "gloo": _ddp_run(rank, gloo, hook),
            "ringcomm": _ddp_run(rank, rc_group, hook),
        }
    report["fsdp2"] = {"gloo": _fsdp_run(rank, gloo), "ringcomm": _fsdp_run(rank, rc_group)}
    dist.destroy_process_group()
    return report


def _check_training(reports: list[dict[str, Any]], world_size: int) -> None:
    import numpy as np

    assert all(r["backend"] == "ringcomm" for r in reports)
    init = reports[0]["init"]
    # W=2: every algorithm adds a+b, the same bits. W=3: the order of the three-term sums
    # differs from Gloo's, a few ulps per step (fp16 hook: fp16 ulps).
    tol = {"ddp": 1e-6, "ddp_allreduce_hook": 1e-6, "ddp_fp16_hook": 2e-4, "fsdp2": 1e-6}
    for name in ("ddp", "ddp_allreduce_hook", "ddp_fp16_hook", "fsdp2"):
        for r, rep in enumerate(reports):
            g, c = rep[name]["gloo"], rep[name]["ringcomm"]
            assert np.abs(c - init).max() > 1e-3, f"{name}: training did not move rank {r}"
            if world_size == 2:
                assert np.array_equal(g, c), (
                    f"{name} rank {r}: not bitwise equal to Gloo, max diff {np.abs(g - c).max()}"
                )
            else:
                np.testing.assert_allclose(c, g, rtol=0, atol=tol[name], err_msg=name)
        if name != "fsdp2":  # DDP replicas stay bitwise identical across ranks
            for r, rep in enumerate(reports[1:], 1):
                assert np.array_equal(rep[name]["ringcomm"], reports[0][name]["ringcomm"]), (
                    f"{name}: rank {r}'s replica differs from rank 0's"
                )


# -- the collectives job -------------------------------------------------------------------
def _inp(rank: int, n: int, dtype: Any) -> Any:
    """Rank-dependent small integers (exact in every dtype, products stay small)."""
    base = torch.arange(n) % 3 + rank + 1
    if dtype == torch.bool:
        return (torch.arange(n) + rank) % 2 == 0
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


def _expected_reduce(op: str, world_size: int, n: int, dtype: Any) -> Any:
    xs = torch.stack([_inp(r, n, dtype) for r in range(world_size)])
    if op == "sum":
        return xs.any(0) if dtype == torch.bool else xs.sum(0, dtype=dtype)
    if op == "avg":
        return (
            xs.to(torch.complex128 if dtype.is_complex else torch.float64).sum(0) / world_size
        ).to(dtype)
    if op == "prod":
        return xs.all(0) if dtype == torch.bool else xs.prod(0, dtype=dtype)
    if op == "min":
        return xs.min(0).values
    return xs.max(0).values


def collectives_job(rank: int, world_size: int, store_path: str) -> dict[str, str]:
    """Every call torch dispatches to the backend, checked against values computed here.
    Returns {check: 'ok' | failure text}."""
    _init(rank, world_size, store_path)
    W, R = world_size, rank
    RO = dist.ReduceOp
    out: dict[str, str] = {}

    def check(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            out[name] = "ok"
        except Exception:  # noqa: BLE001 (the report names the failing check)
            out[name] = traceback.format_exc()

    ops = {"sum": RO.SUM, "avg": RO.AVG, "prod": RO.PRODUCT, "min": RO.MIN, "max": RO.MAX}
    dtypes = [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.int8,
        torch.bool,
        torch.complex64,
    ]

    def all_reduce_matrix() -> None:
        for dtype in dtypes:
            for name, op in ops.items():
                if dtype == torch.bool and name == "avg":
                    continue
                if dtype.is_complex and name not in ("sum", "avg"):
                    continue
                if name == "avg" and not (dtype.is_floating_point or dtype.is_complex):
                    continue
                t = _inp(R, 37, dtype)
                dist.all_reduce(t, op=op)
                exp = _expected_reduce(name, W, 37, dtype)
                assert torch.equal(t, exp), f"{dtype} {name}: {t} != {exp}"

    def premul_and_bitwise() -> None:
        t = _inp(R, 10, torch.float32)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        assert torch.equal(t, _expected_reduce("sum", W, 10, torch.float32) * 0.5)
        b = _inp(R, 10, torch.bool)
        dist.all_reduce(b, op=RO.BAND)
        assert torch.equal(b, _expected_reduce("min", W, 10, torch.bool))
        b = _inp(R, 10, torch.bool)
        dist.all_reduce(b, op=RO.BOR)
        assert torch.equal(b, _expected_reduce("max", W, 10, torch.bool))
        with pytest.raises(ValueError, match="BXOR"):
            dist.all_reduce(_inp(R, 10, torch.int32), op=RO.BXOR)

    def non_contiguous_and_sizes() -> None:
        base = torch.zeros(6, 8)
        view = base[:, ::2]
        view.copy_(_inp(R, 24, torch.float32).reshape(6, 4))
        dist.all_reduce(view)
        assert torch.equal(view, _expected_reduce("sum", W, 24, torch.float32).reshape(6, 4))
        assert torch.equal(base[:, 1::2], torch.zeros(6, 4)), "wrote outside the view"
        for n in (0, 1, 1000, 300_000):  # empty, one element, several pieces
            t = _inp(R, n, torch.float32)
            dist.all_reduce(t)
            assert torch.equal(t, _expected_reduce("sum", W, n, torch.float32)), n

    def async_and_futures() -> None:
        ts = [_inp(R, 100 + i, torch.float32) for i in range(5)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        futs = [w.get_future().then(lambda f: f.value()[0] * 2) for w in works]
        for i, (t, f) in enumerate(zip(ts, futs)):
            exp = _expected_reduce("sum", W, 100 + i, torch.float32)
            assert torch.equal(f.wait(), exp * 2)
            assert torch.equal(t, exp)
        w = dist.all_reduce(torch.ones(3), async_op=True)
        assert w.wait() is True and w.is_completed()

    def broadcast() -> None:
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.complex128):
            t = _inp(R, 17, dtype)
            dist.broadcast(t, src=W - 1)
            assert torch.equal(t, _inp(W - 1, 17, dtype)), dtype
        base = torch.zeros(4, 6)
        view = base.t()  # non-contiguous
        if R == 0:
            view.copy_(torch.arange(24.0).reshape(6, 4))
        dist.broadcast(view, src=0)
        assert torch.equal(view, torch.arange(24.0).reshape(6, 4))

    def gathers() -> None:
        x = _inp(R, 6, torch.float32).reshape(2, 3)
        outs = [torch.empty(2, 3) for _ in range(W)]
        dist.all_gather(outs, x)
        for r in range(W):
            assert torch.equal(outs[r], _inp(r, 6, torch.float32).reshape(2, 3))
        big = torch.empty(W * 6, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(big, _inp(R, 6, torch.bfloat16))
        assert torch.equal(big, torch.cat([_inp(r, 6, torch.bfloat16) for r in range(W)]))
        dst = 1 % W
        glist = [torch.empty(5, dtype=torch.int16) for _ in range(W)] if dst == R else None
        dist.gather(_inp(R, 5, torch.int16), glist, dst=dst)
        if dst == R:
            for r in range(W):
                assert torch.equal(glist[r], _inp(r, 5, torch.int16))

    def reduce_scatters() -> None:
        n = 4
        for name, op in (("sum", RO.SUM), ("avg", RO.AVG), ("max", RO.MAX)):
            inp = _inp(R, W * n, torch.float32)
            o = torch.empty(n)
            dist.reduce_scatter_tensor(o, inp, op=op)
            exp = _expected_reduce(name, W, W * n, torch.float32)[R * n : (R + 1) * n]
            assert torch.equal(o, exp), name
            assert torch.equal(inp, _inp(R, W * n, torch.float32)), "input modified"
        inp = _inp(R, W * n, torch.float32)
        o = torch.empty(n)
        dist.reduce_scatter_tensor(o, inp, op=dist._make_nccl_premul_sum(0.25))
        exp = _expected_reduce("sum", W, W * n, torch.float32)[R * n : (R + 1) * n] * 0.25
        assert torch.equal(o, exp) and torch.equal(inp, _inp(R, W * n, torch.float32))
        parts = list(_inp(R, W * n, torch.int64).chunk(W))
        o = torch.empty(n, dtype=torch.int64)
        dist.reduce_scatter(o, parts)
        assert torch.equal(o, _expected_reduce("sum", W, W * n, torch.int64)[R * n : (R + 1) * n])

    def reduce_and_scatter() -> None:
        dst = W - 1
        t = _inp(R, 9, torch.float64)
        dist.reduce(t, dst=dst, op=RO.MAX)
        mine = _inp(R, 9, torch.float64)
        exp = _expected_reduce("max", W, 9, torch.float64) if dst == R else mine
        assert torch.equal(t, exp)
        o = torch.empty(3, dtype=torch.int32)
        src_list = (
            [torch.full((3,), 10 * r, dtype=torch.int32) for r in range(W)] if R == 0 else None
        )
        dist.scatter(o, src_list, src=0)
        assert torch.equal(o, torch.full((3,), 10 * R, dtype=torch.int32))

    def all_to_all() -> None:
        x = torch.arange(W * 2, dtype=torch.float32) + 100 * R
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        exp = torch.cat(
            [torch.arange(R * 2, R * 2 + 2, dtype=torch.float32) + 100 * r for r in range(W)]
        )
        assert torch.equal(y, exp)
        # uneven: rank r sends j + 1 rows of width 2 to rank j
        in_splits = [j + 1 for j in range(W)]
        out_splits = [R + 1] * W
        x = torch.full((sum(in_splits), 2), float(R))
        y = torch.empty(sum(out_splits), 2)
        dist.all_to_all_single(y, x, out_splits, in_splits)
        exp = torch.cat([torch.full((R + 1, 2), float(r)) for r in range(W)])
        assert torch.equal(y, exp)
        ins = [torch.full((j + 1,), R * 10 + j) for j in range(W)]
        outs = [torch.empty(R + 1, dtype=torch.int64) for _ in range(W)]
        dist.all_to_all(outs, ins)
        for r in range(W):
            assert torch.equal(outs[r], torch.full((R + 1,), r * 10 + R))

    def point_to_point() -> None:
        right, left = (R + 1) % W, (R - 1) % W
        got = torch.empty(5, dtype=torch.bfloat16)
        req = dist.irecv(got, src=left, tag=3)
        dist.send(_inp(R, 5, torch.bfloat16), dst=right, tag=3)
        req.wait()
        assert torch.equal(got, _inp(left, 5, torch.bfloat16))
        ops_ = [
            dist.P2POp(dist.isend, torch.full((4,), float(R)), right),
            dist.P2POp(dist.irecv, got4 := torch.empty(4), left),
        ]
        for w in dist.batch_isend_irecv(ops_):
            w.wait()
        assert torch.equal(got4, torch.full((4,), float(left)))
        # Receives finishing in another order than posted: their futures complete with
        # nobody calling wait() (the completer, woken by ringcomm's done callbacks).
        bufs = [torch.empty(3) for _ in range(2)]
        futs = [dist.irecv(bufs[k], src=left, tag=10 + k).get_future() for k in range(2)]
        for k in (1, 0):
            dist.send(torch.full((3,), float(R * 10 + k)), dst=right, tag=10 + k)
        for k in (1, 0):
            assert torch.equal(futs[k].wait()[0], torch.full((3,), float(left * 10 + k)))

    def barrier_and_names() -> None:
        dist.barrier()
        pg = dist.group.WORLD
        assert pg.group_name and pg.name() == "ringcomm", (pg.group_name, pg.name())
        import torch.distributed._functional_collectives as funcol

        r = funcol.all_reduce(_inp(R, 8, torch.float32), "sum", pg)
        assert torch.equal(r, _expected_reduce("sum", W, 8, torch.float32))

    def new_groups() -> None:
        specs = [[0, 1], [1, W - 1], [R]] if W > 2 else [[0, 1], [1], [0]]
        for ranks in specs:
            g = dist.new_group(ranks, backend="ringcomm")
            if R not in ranks:
                assert g == dist.GroupMember.NON_GROUP_MEMBER
                continue
            t = torch.full((6,), float(R + 1))
            dist.all_reduce(t, group=g)
            assert torch.equal(t, torch.full((6,), float(sum(r + 1 for r in set(ranks)))))
            b = torch.full((3,), float(R))
            dist.broadcast(b, src=ranks[-1], group=g)
            assert torch.equal(b, torch.full((3,), float(ranks[-1])))
            assert dist.get_world_size(g) == len(set(ranks))
            dist.destroy_process_group(g)

    def bad_arguments() -> None:
        with pytest.raises(ValueError, match="world size"):
            dist.all_gather_into_tensor(torch.empty(W * 2 + 1), torch.ones(2))

    for fn in (
        all_reduce_matrix,
        premul_and_bitwise,
        non_contiguous_and_sizes,
        async_and_futures,
        broadcast,
        gathers,
        reduce_scatters,
        reduce_and_scatter,
        all_to_all,
        point_to_point,
        barrier_and_names,
        new_groups,
        bad_arguments,
    ):
        check(fn.__name__, fn)
    dist.destroy_process_group()
    return out


# -- the failure job -----------------------------------------------------------------------
def failure_job(rank: int, world_size: int, store_path: str) -> dict[str, Any]:
    """A collective mismatch raises on both ranks; then rank 1 dies mid-training and rank 0's
    ``loss.backward()`` (or the step) raises within the group's timeout instead of hanging."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    timeout_s = 4.0
    _init(rank, world_size, store_path, timeout_s=timeout_s)
    report: dict[str, Any] = {}
    g = dist.new_group(backend="ringcomm")
    try:
        dist.all_reduce(torch.ones(4 + rank), group=g)
        report["mismatch"] = "no error"
    except Exception as exc:  # noqa: BLE001
        report["mismatch"] = f"{type(exc).__name__}: {exc}"
    # The same through the asynchronous path: wait() raises, and so does the future.
    g2 = dist.new_group(backend="ringcomm")
    work = dist.all_reduce(torch.ones(6 + rank), group=g2, async_op=True)
    fut = work.get_future()
    for name, wait in (("async_wait", work.wait), ("async_future", fut.wait)):
        try:
            wait()
            report[name] = "no error"
        except Exception as exc:  # noqa: BLE001
            report[name] = f"{type(exc).__name__}: {exc}"
    # work.wait(timeout) bounds the wait: rank 1 never joins this all_reduce.
    import datetime

    g3 = dist.new_group(backend="ringcomm")
    if rank == 0:
        work = dist.all_reduce(torch.ones(3), group=g3, async_op=True)
        t1 = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=0.5))
            report["wait_timeout"] = "no error"
        except Exception as exc:  # noqa: BLE001
            report["wait_timeout"] = f"{type(exc).__name__}: {exc}"
        report["wait_timeout_s"] = time.monotonic() - t1
    model = _model()
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    t0 = time.monotonic()
    try:
        for step in range(4):
            if rank == 1 and step == 2:
                os._exit(0)  # a crash: no goodbye, sockets vanish
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
            loss = ((ddp(x) - y) ** 2).mean()
            opt.zero_grad()
            t0 = time.monotonic()
            loss.backward()
            opt.step()
        report["dead_peer"] = "no error"
    except Exception as exc:  # noqa: BLE001
        report["dead_peer"] = f"{type(exc).__name__}: {exc}"
        report["step"] = step
    report["raised_after_s"] = time.monotonic() - t0
    report["timeout_s"] = timeout_s
    t1 = time.monotonic()
    dist.destroy_process_group()
    report["destroy_s"] = time.monotonic() - t1
    return report


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_and_fsdp2_equal_gloo(
    world_size: int, tmp_path: Path, no_child_processes: None
) -> None:
    reports = run_job(training_job, world_size, (str(tmp_path / "store"),), timeout_s=200)
    _check_training(reports, world_size)


@pytest.fixture(scope="module")
def collectives_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Any]]:
    out = {}
    for w in (2, 3):
        path = tmp_path_factory.mktemp(f"coll{w}") / "store"
        out[w] = run_job(collectives_job, w, (str(path),), timeout_s=150)
    return out


COLLECTIVE_CHECKS = [
    "all_reduce_matrix",
    "premul_and_bitwise",
    "non_contiguous_and_sizes",
    "async_and_futures",
    "broadcast",
    "gathers",
    "reduce_scatters",
    "reduce_and_scatter",
    "all_to_all",
    "point_to_point",
    "barrier_and_names",
    "new_groups",
    "bad_arguments",
]


@pytest.mark.timeout(320)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("check", COLLECTIVE_CHECKS)
def test_collective(collectives_reports: dict[int, list[Any]], world_size: int, check: str) -> None:
    for rank, rep in enumerate(collectives_reports[world_size]):
        assert rep.get(check) == "ok", f"rank {rank}: {rep.get(check, 'did not run')}"


def test_every_collective_check_ran(collectives_reports: dict[int, list[Any]]) -> None:
    assert sorted(collectives_reports[2][0]) == sorted(COLLECTIVE_CHECKS)


@pytest.mark.timeout(120)
def test_failures_raise_instead_of_hanging(tmp_path: Path, no_child_processes: None) -> None:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_entry, args=(failure_job, r, 2, (str(tmp_path / "s"),), results), daemon=True
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        rank, status, rep = results.get(timeout=100)  # only rank 0 reports: rank 1 crashes
        assert (rank, status) == (0, "ok"), rep
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    assert rep["mismatch"].startswith("CollectiveMismatchError"), rep
    assert "CollectiveMismatchError" in rep["async_wait"], rep
    assert "CollectiveMismatchError" in rep["async_future"], rep
    assert rep["wait_timeout"].startswith("CommTimeoutError"), rep
    assert 0.4 < rep["wait_timeout_s"] < 10, rep
    assert rep["dead_peer"] != "no error", rep
    # ringcomm's dead-peer detection names the dead rank (through DDP's RuntimeError)
    assert "PeerFailedError" in rep["dead_peer"], rep
    assert rep["step"] == 2, rep
    # detection is bounded (heartbeat timeout 4 s; slack for a loaded machine), never a hang
    assert rep["raised_after_s"] < 15, rep
    assert rep["destroy_s"] < 40, rep
    assert procs[1].exitcode == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_env_names(no_child_processes: None) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
    )
    for k in (
        "RINGCOMM_RANK",
        "RINGCOMM_WORLD_SIZE",
        "RINGCOMM_MASTER_ADDR",
        "RINGCOMM_MASTER_PORT",
    ):
        env.pop(k, None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(REPO / "tests" / "scripts" / "torch_ddp_torchrun.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for r in range(2):
        assert f"RINGCOMM_TORCHRUN_OK rank {r}/2" in proc.stdout, proc.stdout + proc.stderr


def test_single_rank_group_in_process() -> None:
    """World size 1 (no store, no peers) and registration, in this process."""
    import ringcomm.torch_backend as tb

    assert dist.Backend._plugins["RINGCOMM"].creator_fn is tb.create_process_group
    tb.register()  # idempotent
    dist.init_process_group("ringcomm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        assert isinstance(pg, tb.RingcommProcessGroup) and pg.name() == "ringcomm"
        t = torch.arange(5.0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        assert torch.equal(t, torch.arange(5.0))
        w = dist.all_reduce(t, async_op=True)
        assert torch.equal(w.get_future().wait()[0], torch.arange(5.0))
        with pytest.raises(ValueError, match="CPU tensors"):
            dist.all_reduce(torch.ones(2, device="meta"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cause", ["exception", "sys_exit", "sigterm"])
def test_torchrun_job_ends_when_a_rank_goes_down(
    cause: str, tmp_path: Path, no_child_processes: None
) -> None:
    """The crash-safety matrix's reduced set under torchrun: the last of 3 ranks goes down
    without destroy_process_group while the others wait in an all_reduce with it; torchrun
    ends the job (its own status, 1) within seconds, and peers that noticed say why."""
    env = dict(
        os.environ,
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        OMP_NUM_THREADS="1",
    )
    for k in list(env):
        if k.startswith("RINGCOMM_"):
            env.pop(k)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "--monitor-interval",
            "0.1",
            str(REPO / "tests" / "scripts" / "torch_exit_torchrun.py"),
            cause,
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    t_end = time.time()
    out = proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode != 0, out
    t_fail = float((tmp_path / "fail.2").read_text())
    assert t_end - t_fail < 10.0, (t_end - t_fail, out)
    want = {
        "exception": "rank 2 exited: RuntimeError: user bug on rank 2",
        "sys_exit": "rank 2 left the group",
        "sigterm": "rank 2 exited: killed by SIGTERM",
    }[cause]
    for peer in (0, 1):
        path = tmp_path / f"peer.{peer}"
        if path.exists():  # else torchrun stopped it before it noticed
            import json

            got = json.loads(path.read_text())
            assert want in got["message"], got
            assert got["t"] - t_fail < 1.0, got
