"""The torch backend against Gloo where layouts are easy to get wrong: every list-of-lists
call (``all_gather_coalesced``'s ``[rank][input]`` outputs above all: with as many inputs
as ranks a transposed read raises nothing), the coalesced all-reduces with mixed dtypes,
the coalescing manager (one ringcomm operation per dtype), and the timeout wording torch's
callers match on.

Each job runs the same calls, on the same inputs, on a ringcomm world group and on a Gloo
group of the same ranks, and compares the outputs (and both with values computed here).
"""

from __future__ import annotations

import contextlib
import datetime
import re
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.needs_torch
torch = pytest.importorskip(
    "torch", reason="needs_torch: torch is not installed (pip install 'ringcomm[torch]')"
)
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with Gloo is not available", allow_module_level=True)

from test_torch_backend import _init, run_job  # noqa: E402  (tests/ is on sys.path: rootdir conftest)

#: torch's own test of a timed-out collective (distributed_test.py, _test_barrier_timeout).
TORCH_TIMEOUT_RE = " (Timed out|closed|timeout) "


def _val(rank: int, i: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """Input ``i`` of ``rank``: every (rank, input, element) a different small value."""
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n, dtype=torch.float64) + 100 * rank + 10 * i + 1
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype).reshape(shape)
    return base.to(dtype).reshape(shape)


@contextlib.contextmanager
def _count_calls(rc: Any, name: str) -> Iterator[list[int]]:
    """Count the ringcomm group's ``name`` calls inside the block (an instance attribute
    shadows the method: the backend looks it up at every call)."""
    counter = [0]
    method = getattr(rc, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return method(*args, **kwargs)

    setattr(rc, name, counted)
    try:
        yield counter
    finally:
        delattr(rc, name)


def conformance_job(rank: int, world_size: int, store_path: str) -> dict[str, str]:
    """{check: 'ok' | failure text}, each check run on ringcomm and Gloo side by side."""
    _init(rank, world_size, store_path)
    W, R = world_size, rank
    rc_world = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    rc = rc_world.ringcomm_group
    out: dict[str, str] = {}

    def check(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            out[name] = "ok"
        except Exception:  # noqa: BLE001 (the report names the failing check)
            out[name] = traceback.format_exc()

    def on_both(fn: Callable[[Any], Any]) -> tuple[Any, Any]:
        return fn(rc_world), fn(gloo)

    def all_gather_coalesced() -> None:
        # as many inputs as ranks, same shapes: the case a transposed read gets silently
        # wrong; then mixed shapes with an empty one, and complex
        cases = [
            [((2,), torch.float32)] * W,
            [((2, 3), torch.float64), ((0,), torch.float64), ((5,), torch.float64)],
            [((3,), torch.complex64), ((1, 2), torch.complex64)],
            [((4,), torch.bfloat16)] * (W + 1),
        ]
        for case in cases:

            def run(group: Any, case: list[Any] = case) -> Any:
                ins = [_val(R, i, s, d) for i, (s, d) in enumerate(case)]
                outs = [[torch.full(s, -1, dtype=d) for s, d in case] for _ in range(W)]
                dist.all_gather_coalesced(outs, ins, group=group)
                return outs

            got, ref = on_both(run)
            for r in range(W):
                for i, (s, d) in enumerate(case):
                    exp = _val(r, i, s, d)
                    assert torch.equal(ref[r][i], exp), f"gloo [{r}][{i}]: {ref[r][i]}"
                    assert torch.equal(got[r][i], exp), (
                        f"{case}: ringcomm [{r}][{i}] = {got[r][i]}, gloo {ref[r][i]}"
                    )
        # async, and one ringcomm all_gather for all the inputs (one dtype)
        ins = [_val(R, i, (3,), torch.float32) for i in range(W)]
        outs = [[torch.empty(3) for _ in range(W)] for _ in range(W)]
        with _count_calls(rc, "all_gather") as calls:
            dist.all_gather_coalesced(outs, ins, async_op=True).wait()
        assert calls[0] == 1, f"{calls[0]} ringcomm all_gathers for one coalesced call"
        for r in range(W):
            for i in range(W):
                assert torch.equal(outs[r][i], _val(r, i, (3,), torch.float32)), (r, i)
        with pytest.raises(ValueError, match="one per rank"):
            dist.all_gather_coalesced([[torch.empty(3)]] * (W + 1), [torch.ones(3)])

    def list_of_lists_calls() -> None:
        """all_gather, gather, scatter, reduce_scatter, all_to_all: W tensors per list
        with distinct values (a transposed or shifted read cannot pass)."""
        shape = (W,)  # as many elements as ranks: every layout mix-up keeps the shapes

        def allgather(group: Any) -> Any:
            outs = [torch.empty(shape) for _ in range(W)]
            dist.all_gather(outs, _val(R, 0, shape, torch.float32), group=group)
            return outs

        got, ref = on_both(allgather)
        for r in range(W):
            assert torch.equal(got[r], ref[r]) and torch.equal(
                got[r], _val(r, 0, shape, torch.float32)
            )

        dst = W - 1

        def gather(group: Any) -> Any:
            outs = [torch.empty(shape) for _ in range(W)] if dst == R else None
            dist.gather(_val(R, 0, shape, torch.float32), outs, dst=dst, group=group)
            return outs

        got, ref = on_both(gather)
        if dst == R:
            for r in range(W):
                assert torch.equal(got[r], ref[r]), (r, got[r], ref[r])
                assert torch.equal(got[r], _val(r, 0, shape, torch.float32))

        src = W - 1

        def scatter(group: Any) -> Any:
            ins = [_val(src, j, shape, torch.float32) for j in range(W)] if src == R else None
            o = torch.empty(shape)
            dist.scatter(o, ins, src=src, group=group)
            return o

        got, ref = on_both(scatter)
        assert torch.equal(got, ref) and torch.equal(got, _val(src, R, shape, torch.float32))

        def reduce_scatter(group: Any) -> Any:
            o = torch.empty(shape)
            dist.reduce_scatter(
                o, [_val(R, j, shape, torch.float32) for j in range(W)], group=group
            )
            return o

        exp = sum(_val(r, R, shape, torch.float32) for r in range(W))
        got, ref = on_both(reduce_scatter)
        assert torch.equal(got, ref) and torch.equal(got, exp), (got, ref, exp)

        def all_to_all(group: Any) -> Any:
            outs = [torch.empty(shape) for _ in range(W)]
            dist.all_to_all(outs, [_val(R, j, shape, torch.float32) for j in range(W)], group=group)
            return outs

        got = all_to_all(rc_world)
        for r in range(W):
            assert torch.equal(got[r], _val(r, R, shape, torch.float32)), (r, got[r])
        ref = all_to_all(gloo)
        for r in range(W):
            assert torch.equal(got[r], ref[r]), (r, got[r], ref[r])

    def all_reduce_coalesced() -> None:
        # torch's public call takes one dtype (a complex one goes as its real view)
        def run(group: Any) -> Any:
            ts = [
                _val(R, 0, (3,), torch.float32),
                _val(R, 1, (2, 2), torch.float32),
                _val(R, 2, (2,), torch.complex64),
            ]
            dist.all_reduce_coalesced(ts, group=group)
            return ts

        got, ref = on_both(run)
        for g, r in zip(got, ref):
            assert torch.equal(g, r), (g, r)

    mixed = [
        ((5,), torch.float32),
        ((2, 3), torch.float64),
        ((4,), torch.int64),
        ((3,), torch.bfloat16),
        ((0,), torch.float32),
        ((7,), torch.float32),
        ((2,), torch.complex64),
    ]

    def expected_sum(i: int, s: tuple[int, ...], d: Any) -> Any:
        return sum(_val(r, i, s, d) for r in range(W)).to(d)

    def coalescing_manager_all_reduce() -> None:
        for async_ops in (False, True):
            ts = [_val(R, i, s, d) for i, (s, d) in enumerate(mixed)]
            with _count_calls(rc, "all_reduce") as calls:
                with dist._coalescing_manager(async_ops=async_ops) as cm:
                    for t in ts:
                        dist.all_reduce(t)
                if async_ops:
                    cm.wait()
            # one per dtype ringcomm reduces in: float32 (the float32 tensors, complex64's
            # real view, bfloat16's float32 copy), float64, int64
            n_dtypes = 3
            assert calls[0] == n_dtypes, f"{calls[0]} ringcomm all_reduces, want {n_dtypes}"
            for i, (t, (s, d)) in enumerate(zip(ts, mixed)):
                assert torch.equal(t, expected_sum(i, s, d)), (async_ops, i, d, t)
        # the same dtype on both backends (Gloo's coalesced all-reduce takes one dtype)

        def run(group: Any) -> Any:
            ts = [_val(R, i, (i + 1,), torch.float64) for i in range(4)]
            with dist._coalescing_manager(group=group):
                for t in ts:
                    dist.all_reduce(t, group=group)
            return ts

        got, ref = on_both(run)
        for g, r in zip(got, ref):
            assert torch.equal(g, r), (g, r)

    def coalescing_manager_gathers() -> None:
        ins = [_val(R, i, s, d) for i, (s, d) in enumerate(mixed)]
        outs = [torch.empty((W * t.numel(),), dtype=t.dtype) for t in ins]
        with _count_calls(rc, "all_gather") as calls, dist._coalescing_manager():
            for o, t in zip(outs, ins):
                dist.all_gather_into_tensor(o, t)
        # one per dtype: float32 (complex64 too: torch passes its real view), float64,
        # int64, bfloat16
        n_dtypes = 4
        assert calls[0] == n_dtypes, f"{calls[0]} ringcomm all_gathers, want {n_dtypes}"
        for i, (o, (s, d)) in enumerate(zip(outs, mixed)):
            exp = torch.cat([_val(r, i, s, d).reshape(-1) for r in range(W)])
            assert torch.equal(o, exp), (i, d, o, exp)
        # reduce_scatter_tensor through the manager, against Gloo

        def run(group: Any) -> Any:
            ins = [_val(R, i, (W * (i + 1),), torch.float32) for i in range(3)]
            outs = [torch.empty(i + 1) for i in range(3)]
            with dist._coalescing_manager(group=group):
                for o, t in zip(outs, ins):
                    dist.reduce_scatter_tensor(o, t, group=group)
            return outs

        got = run(rc_world)
        for i in range(3):
            full = sum(_val(r, i, (W * (i + 1),), torch.float32) for r in range(W))
            assert torch.equal(got[i], full.reshape(W, -1)[R]), (i, got[i])

    def sparse_all_reduce() -> None:
        """COO tensors (a different number of entries per rank, shared and empty ones,
        dense trailing dims, integer values): the same coalesced sum as Gloo's."""

        def sparse(rank: int, dense: tuple[int, ...], dtype: Any) -> Any:
            nnz = rank + 1 if rank != 1 else 0  # rank 1 contributes nothing
            idx = torch.tensor(
                [[(2 * j + rank) % 7 for j in range(nnz)], [j % 3 for j in range(nnz)]],
                dtype=torch.int64,
            )
            vals = torch.arange(nnz * (dense[0] if dense else 1), dtype=torch.float64)
            vals = (vals + 10 * rank + 1).reshape(nnz, *dense).to(dtype)
            # uncoalesced on purpose: a repeated index
            idx = torch.cat([idx, idx[:, :1]], dim=1) if nnz else idx
            vals = torch.cat([vals, vals[:1]]) if nnz else vals
            return torch.sparse_coo_tensor(idx, vals, (7, 3, *dense))

        for dense, dtype in (((), torch.float32), ((2,), torch.float64), ((), torch.int64)):
            for async_op in (False, True):

                def run(
                    group: Any, dense: Any = dense, dtype: Any = dtype, a: bool = async_op
                ) -> Any:
                    t = sparse(R, dense, dtype)
                    w = dist.all_reduce(t, group=group, async_op=a)
                    if a:
                        w.wait()
                    return t

                got, ref = on_both(run)
                exp = sum(sparse(r, dense, dtype).to_dense() for r in range(W))
                assert got.is_sparse, got
                assert torch.equal(got.to_dense(), ref.to_dense()), (dense, dtype, got, ref)
                assert torch.equal(got.to_dense(), exp.to(dtype)), (dense, dtype, got)
                g, r_ = got.coalesce(), ref.coalesce()
                assert torch.equal(g.indices(), r_.indices()), (g.indices(), r_.indices())
        with pytest.raises(ValueError, match="SUM only"):
            dist.all_reduce(sparse(R, (), torch.float32), op=dist.ReduceOp.MAX)

    def ddp_sparse_embedding() -> None:
        """DDP over a model with a sparse embedding (its gradients are sparse COO tensors,
        all-reduced as such): 3 SGD steps on ringcomm and on Gloo from the same weights and
        inputs end with the same parameters."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train(group: Any) -> list[Any]:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Embedding(23, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(12, 1)
            )
            ddp = DDP(model, process_group=group)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(100 + R)
            for _ in range(3):
                ids = torch.randint(0, 23, (5, 3), generator=gen)
                opt.zero_grad()
                ddp(ids).pow(2).mean().backward()
                opt.step()
            return [p.detach().clone() for p in model.parameters()]

        got, ref = on_both(train)
        for a, b in zip(got, ref, strict=True):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a, b)
        assert not torch.equal(got[0], train_init_embedding()), "the embedding did not train"

    def train_init_embedding() -> Any:
        torch.manual_seed(0)
        return torch.nn.Embedding(23, 4, sparse=True).weight.detach().clone()

    def monitored_barrier() -> None:
        """``pg.monitored_barrier`` (dist.monitored_barrier refuses non-Gloo names): all
        ranks pass; then the last rank stays away and rank 0 names it, as Gloo does."""
        rc_world.monitored_barrier(datetime.timedelta(seconds=30))
        g = dist.new_group(backend="ringcomm")
        late = W - 1
        if R == 0:
            with pytest.raises(RuntimeError, match=f"Rank {late} failed to pass monitoredBarrier"):
                g.monitored_barrier(datetime.timedelta(seconds=1))
        elif late != R:  # checked in; rank 0 never answers
            with pytest.raises(RuntimeError, match=f"Rank {R} successfully reached"):
                g.monitored_barrier(datetime.timedelta(seconds=1))
        dist.barrier()

    def timeout_wording() -> None:
        """Only rank 0 enters the barrier: it times out with torch's words, still a
        CommTimeoutError naming the rank and the op (ringcomm's message goes on)."""
        import ringcomm as rcmod

        # a timed-out group stays failed: one group per variant
        one_s = datetime.timedelta(seconds=1)
        groups = {a: dist.new_group(backend="ringcomm", timeout=one_s) for a in (False, True)}
        if R == 0:
            for async_op, g in groups.items():

                def barrier(async_op: bool = async_op, g: Any = g) -> None:
                    w = dist.barrier(group=g, async_op=async_op)
                    if async_op:
                        w.wait()

                with pytest.raises(rcmod.CommTimeoutError, match=TORCH_TIMEOUT_RE) as info:
                    barrier()
                text = str(info.value)
                assert "rank 0" in text and "barrier" in text, text
                # ringcomm's own wording kept (the asynchronous wait reports what was left)
                assert re.search(r"timed out after (1|0\.9\d*) s", text), text
        dist.barrier()  # the others wait here until rank 0 is done

    for fn in (
        all_gather_coalesced,
        list_of_lists_calls,
        all_reduce_coalesced,
        coalescing_manager_all_reduce,
        coalescing_manager_gathers,
        sparse_all_reduce,
        ddp_sparse_embedding,
        monitored_barrier,
        timeout_wording,
    ):
        check(fn.__name__, fn)
    dist.destroy_process_group()
    return out


CHECKS = [
    "all_gather_coalesced",
    "list_of_lists_calls",
    "all_reduce_coalesced",
    "coalescing_manager_all_reduce",
    "coalescing_manager_gathers",
    "sparse_all_reduce",
    "ddp_sparse_embedding",
    "monitored_barrier",
    "timeout_wording",
]


@pytest.fixture(scope="module")
def conformance_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Any]]:
    out = {}
    for w in (2, 3):
        path = tmp_path_factory.mktemp(f"conf{w}") / "store"
        out[w] = run_job(conformance_job, w, (str(path),), timeout_s=150)
    return out


@pytest.mark.timeout(320)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("check", CHECKS)
def test_against_gloo(
    conformance_reports: dict[int, list[Any]], world_size: int, check: str
) -> None:
    for rank, rep in enumerate(conformance_reports[world_size]):
        assert rep.get(check) == "ok", f"rank {rank}: {rep.get(check, 'did not run')}"


def test_every_check_ran(conformance_reports: dict[int, list[Any]]) -> None:
    assert sorted(conformance_reports[2][0]) == sorted(CHECKS)
