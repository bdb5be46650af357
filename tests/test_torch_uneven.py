"""The torch backend's uneven calls and any-source receive, against Gloo where Gloo has them.

* ``dist.recv(t)`` / ``dist.irecv(t)`` without ``src`` (``recv_anysource``): the sender is
  returned (``Work._source_rank()``), as on Gloo;
* ``dist.reduce_scatter`` with inputs of different sizes and ``dist.all_to_all_single``
  with ``input_split_sizes``/``output_split_sizes``: the same results as Gloo;
* ``dist.all_gather`` into outputs of different sizes and ``dist.all_to_all`` with lists of
  different sizes (NCCL's uneven forms; Gloo refuses them: "invalid tensor size"):
  against values computed here.

Zero-sized shares on some ranks, several dtypes (bfloat16 and complex64 among them).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.needs_torch
torch = pytest.importorskip(
    "torch", reason="needs_torch: torch is not installed (pip install 'ringcomm[torch]')"
)
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with Gloo is not available", allow_module_level=True)

from test_torch_backend import _init, run_job  # noqa: E402  (tests/ is on sys.path)

DTYPES = ["float32", "float64", "int64", "bfloat16", "complex64"]


def _val(rank: int, i: int, shape: tuple[int, ...], dtype: Any) -> Any:
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n, dtype=torch.float64) + 100 * rank + 10 * i + 1
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype).reshape(shape)
    return base.to(dtype).reshape(shape)


def uneven_job(rank: int, world_size: int, store_path: str) -> dict[str, str]:
    """{check: 'ok' | failure text}; each check on ringcomm and (where it can) on Gloo."""
    _init(rank, world_size, store_path)
    W, R = world_size, rank
    rc_world = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    out: dict[str, str] = {}

    def check(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            out[name] = "ok"
        except Exception:  # noqa: BLE001 (the report names the failing check)
            out[name] = traceback.format_exc()

    def rows(r: int) -> int:  # rank r's share: rank 1 has none
        return 0 if r == 1 else r + 2

    def any_source() -> None:
        def run(group: Any) -> Any:
            got = []
            if R == 0:
                for _ in range(W - 1):
                    t = torch.zeros(3)
                    src = dist.recv(t, group=group, tag=7)
                    got.append((src, t[0].item()))
                for _ in range(W - 1):  # irecv without src
                    t = torch.zeros(3)
                    w = dist.irecv(t, group=group, tag=8)
                    w.wait()
                    got.append((w._source_rank(), t[0].item()))
            else:
                dist.send(torch.full((3,), float(R)), dst=0, group=group, tag=7)
                dist.send(torch.full((3,), 10.0 + R), dst=0, group=group, tag=8)
            dist.barrier(group=group)
            return sorted(got)

        got, ref = run(rc_world), run(gloo)
        assert got == ref, (got, ref)
        if R == 0:
            exp = sorted(
                [(r, float(r)) for r in range(1, W)] + [(r, 10.0 + r) for r in range(1, W)]
            )
            assert got == exp, got

    def reduce_scatter_uneven() -> None:
        for dt_name in DTYPES:
            dt = getattr(torch, dt_name)
            for async_op in (False, True):

                def run(group: Any, dt: Any = dt, a: bool = async_op) -> Any:
                    ins = [_val(R, j, (rows(j),), dt) for j in range(W)]
                    o = torch.full((rows(R),), -1, dtype=dt)
                    w = dist.reduce_scatter(o, ins, group=group, async_op=a)
                    if a:
                        w.wait()
                    return o

                got, ref = run(rc_world), run(gloo)
                exp = sum(
                    _val(r, R, (rows(R),), torch.float64 if not dt.is_complex else dt)
                    for r in range(W)
                ).to(dt)
                assert torch.equal(got, ref), (dt_name, got, ref)
                assert torch.equal(got, exp), (dt_name, got, exp)

    def all_to_all_single_splits() -> None:
        # rank i sends rank j (i + 2j) % 3 rows of shape (2,)
        def m(i: int, j: int) -> int:
            return (i + 2 * j) % 3

        for dt_name in DTYPES:
            dt = getattr(torch, dt_name)
            for async_op in (False, True):

                def run(group: Any, dt: Any = dt, a: bool = async_op) -> Any:
                    ins = [m(R, j) for j in range(W)]
                    outs = [m(j, R) for j in range(W)]
                    x = _val(R, 0, (sum(ins), 2), dt)
                    y = torch.full((sum(outs), 2), -1, dtype=dt)
                    w = dist.all_to_all_single(
                        y,
                        x,
                        output_split_sizes=outs,
                        input_split_sizes=ins,
                        group=group,
                        async_op=a,
                    )
                    if a:
                        w.wait()
                    return y

                got, ref = run(rc_world), run(gloo)
                assert torch.equal(got, ref), (dt_name, got, ref)
                parts = []
                for j in range(W):
                    xj = _val(j, 0, (sum(m(j, q) for q in range(W)), 2), dt)
                    start = sum(m(j, q) for q in range(R))
                    parts.append(xj[start : start + m(j, R)])
                assert torch.equal(got, torch.cat(parts)), (dt_name, got)

    def all_gather_uneven() -> None:
        for dt_name in DTYPES:
            dt = getattr(torch, dt_name)
            for async_op in (False, True):
                shapes = [(rows(r), 2) for r in range(W)]
                outs = [torch.full(s, -1, dtype=dt) for s in shapes]
                w = dist.all_gather(outs, _val(R, 0, shapes[R], dt), async_op=async_op)
                if async_op:
                    w.wait()
                for r in range(W):
                    assert torch.equal(outs[r], _val(r, 0, shapes[r], dt)), (dt_name, r, outs[r])
        # outputs of other shapes with the same element count per rank: torch's layout
        outs = [torch.empty(rows(r) * 2) for r in range(W)]
        dist.all_gather(outs, _val(R, 0, (rows(R), 2), torch.float32))
        for r in range(W):
            assert torch.equal(outs[r], _val(r, 0, (rows(r) * 2,), torch.float32)), r
        # Gloo refuses the uneven form
        with pytest.raises(RuntimeError, match="invalid tensor size"):
            dist.all_gather(
                [torch.empty(rows(r)) for r in range(W)],
                _val(R, 0, (rows(R),), torch.float32),
                group=gloo,
            )

    def all_to_all_lists() -> None:
        def m(i: int, j: int) -> int:
            return (2 * i + j) % 3

        for dt_name in ("float32", "bfloat16", "int64"):
            dt = getattr(torch, dt_name)
            ins = [_val(R, j, (m(R, j),), dt) for j in range(W)]
            outs = [torch.full((m(j, R),), -1, dtype=dt) for j in range(W)]
            dist.all_to_all(outs, ins)
            for j in range(W):
                assert torch.equal(outs[j], _val(j, R, (m(j, R),), dt)), (dt_name, j, outs[j])

    def mismatch_is_an_error() -> None:
        """all_to_all_single splits that do not pair up raise instead of hanging."""
        g = dist.new_group(backend="ringcomm")
        ins = [1] * W
        outs = [1] * W
        if R == 0:
            outs[W - 1] = 2  # rank W-1 sends rank 0 one row
        try:
            dist.all_to_all_single(
                torch.zeros(sum(outs)), torch.zeros(sum(ins)), outs, ins, group=g
            )
            failed = ""
        except Exception as exc:  # noqa: BLE001
            failed = f"{type(exc).__name__}: {exc}"
        if R in (0, W - 1):
            assert "CollectiveMismatchError" in failed or "mismatch" in failed, failed
        dist.barrier()

    for fn in (
        any_source,
        reduce_scatter_uneven,
        all_to_all_single_splits,
        all_gather_uneven,
        all_to_all_lists,
        mismatch_is_an_error,
    ):
        check(fn.__name__, fn)
    dist.destroy_process_group()
    return out


CHECKS = [
    "any_source",
    "reduce_scatter_uneven",
    "all_to_all_single_splits",
    "all_gather_uneven",
    "all_to_all_lists",
    "mismatch_is_an_error",
]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Any]]:
    out = {}
    for w in (2, 3):
        path = tmp_path_factory.mktemp(f"uneven{w}") / "store"
        out[w] = run_job(uneven_job, w, (str(path),), timeout_s=150)
    return out


@pytest.mark.timeout(320)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("check", CHECKS)
def test_against_gloo(reports: dict[int, list[Any]], world_size: int, check: str) -> None:
    for rank, rep in enumerate(reports[world_size]):
        assert rep.get(check) == "ok", f"rank {rank}: {rep.get(check, 'did not run')}"


def test_every_check_ran(reports: dict[int, list[Any]]) -> None:
    assert sorted(reports[2][0]) == sorted(CHECKS)
