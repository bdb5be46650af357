"""Parameter server inside a job: 2 servers and 3 workers, one spawned job for every case.

The job runs one parameter-server session per case (``ps.start`` each time: a fresh
sub-group and fresh servers) and returns what each rank saw; the tests below check it
against oracles computed here, in the test process, with NumPy.

The toy model is linear regression on each worker's own data (so the workers' gradients
differ); gradients are computed with elementwise ops and axis-0 sums only, which give the
same bits in every process, so bsp training can be compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm import ps

SERVERS, WORKERS = 2, 3
DIM, ROWS = 40, 32
KEY_W, KEY_B = 11, 12
STEPS = 30
ASYNC_STEPS = 80  # the staleness cases run longer: the bound must hold throughout
RESUME_AT = 12  # the checkpoint case: a first job stops here, a second resumes
SLOW_S = 0.01  # worker 2's extra time per step in the staleness cases
# 320-byte weights split over both servers; the 8-byte bias lives whole on one
SLICER = ps.HashSlicer(split_min_bytes=256)


def _data(worker: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + worker)
    true_w = np.random.default_rng(7).standard_normal(DIM)
    x = rng.standard_normal((ROWS, DIM))
    return x, (x * true_w).sum(axis=1) + 0.5


def _loss_grad(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, b: np.ndarray
) -> tuple[float, np.ndarray, np.ndarray]:
    r = (x * w).sum(axis=1) + b[0] - y
    gw = (x * r[:, None]).sum(axis=0) * (2.0 / ROWS)
    gb = np.array([r.sum() * (2.0 / ROWS)])
    return float((r * r).mean()), gw, gb


def _global_loss(w: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([_loss_grad(*_data(k), w, b)[0] for k in range(WORKERS)]))


def _cfg(
    consistency: str = "bsp",
    update: str = "server",
    optimizer: str = "sgd",
    staleness: int = 0,
    **opt: Any,
) -> ps.PSConfig:
    args = {"lr": 0.05, "momentum": 0.9} if optimizer == "sgd" else {"lr": 0.05}
    args.update(opt)
    return ps.PSConfig(
        num_workers=WORKERS,
        consistency=consistency,
        staleness=staleness,
        update=update,
        optimizer=optimizer,
        optimizer_args=args,
        timeout_s=60,
    )


# -- what the workers run ---------------------------------------------------------------
def _avg_session(kv: ps.KVWorker) -> dict[str, Any]:
    """Push seeded random gradients; return what push_pull answered per step."""
    kv.init(KEY_W, np.zeros(1000, np.float32)).wait()
    kv.init(KEY_B, np.zeros(3, np.float32)).wait()
    outs = []
    for step in range(3):
        rng = np.random.default_rng([step, kv.index])
        gw, gb = (
            rng.standard_normal(1000).astype(np.float32),
            rng.standard_normal(3).astype(np.float32),
        )
        ow, ob = np.empty(1000, np.float32), np.empty(3, np.float32)
        hs = [kv.push_pull(KEY_W, gw, ow), kv.push_pull(KEY_B, gb, ob)]
        for h in hs:
            h.wait()
        kv.advance()
        outs.append((ow, ob))
    return {"outs": outs}


def _toy_session(kv: ps.KVWorker, cfg: ps.PSConfig, slow: bool, steps: int) -> dict[str, Any]:
    """Train until the clock reaches ``steps`` (from where the servers are: a job restarted
    from checkpoints resumes at their step)."""
    x, y = _data(kv.index)
    w, b = np.zeros(DIM), np.zeros(1)
    hs = [kv.init(KEY_W, w), kv.init(KEY_B, b)]
    for h in hs:
        h.wait()
    start_clock = kv.clock
    if start_clock:  # resumed: the servers' parameters, not our zeros
        hs = [kv.pull(KEY_W, w), kv.pull(KEY_B, b)]
        for h in hs:
            h.wait()
    local = ps.make_updater(cfg.optimizer, **cfg.optimizer_args)
    sw, sb = local.new_state(w), local.new_state(b)
    aw, ab = np.empty(DIM), np.empty(1)
    losses = []
    while kv.clock < steps:
        loss, gw, gb = _loss_grad(x, y, w, b)
        losses.append(loss)
        if cfg.update == "server":
            hs = [kv.push_pull(KEY_W, gw, w), kv.push_pull(KEY_B, gb, b)]
            for h in hs:
                h.wait()
        else:
            hs = [kv.push_pull(KEY_W, gw, aw), kv.push_pull(KEY_B, gb, ab)]
            for h in hs:
                h.wait()
            local.apply(w, aw, sw)
            local.apply(b, ab, sb)
        kv.advance()
        if slow and kv.index == WORKERS - 1:
            time.sleep(SLOW_S)
    return {
        "w": w,
        "b": b,
        "losses": losses,
        "gaps": list(kv.pull_gaps),
        "max_gap": kv.max_pull_gap,
        "start_clock": start_clock,
    }


def _layout_conflict_session(kv: ps.KVWorker) -> dict[str, Any]:
    """Worker 0 splits the key, the others keep it whole on server 0: the servers refuse
    whichever init comes second, naming the key."""
    slicer = ps.HashSlicer(split_min_bytes=8 if kv.index == 0 else 1 << 30)
    kv.slicer = slicer
    try:
        kv.init(CONFLICT_KEY, np.zeros(10, np.float32)).wait()
    except ps.PSRequestError as exc:
        return {"error": str(exc)}
    return {"error": None}


# a key whose home (unsplit) is server 0, where a split key's first piece also lives
CONFLICT_KEY = next(k for k in range(100) if ps.HashSlicer().home(k, SERVERS) == 0)

SESSIONS: list[tuple[str, ps.PSConfig, bool]] = [
    ("avg-worker", _cfg(update="worker"), False),
    ("avg-server", _cfg(optimizer="sgd", momentum=0.0, lr=0.5), False),
    ("toy-server-sgd", _cfg(), False),
    ("toy-worker-sgd", _cfg(update="worker"), False),
    ("toy-server-adam", _cfg(optimizer="adam"), False),
    ("toy-worker-adam", _cfg(update="worker", optimizer="adam"), False),
    # Asynchronous updates use plain SGD: momentum over stale gradients oscillates.
    ("ssp0", _cfg("ssp", staleness=0, momentum=0.0), True),
    ("ssp1", _cfg("ssp", staleness=1, momentum=0.0), True),
    ("ssp3", _cfg("ssp", staleness=3, momentum=0.0), True),
    ("asp", _cfg("asp", momentum=0.0), True),
    ("asp-worker", _cfg("asp", update="worker", momentum=0.0), True),
]


def _job(pg: Any, ckpt_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    durable = dataclasses.replace(_cfg(), checkpoint_dir=ckpt_dir, checkpoint_every_steps=5)
    sessions = [
        *SESSIONS,
        ("layout-conflict", _cfg(), False),
        ("resume-a", durable, False),  # stops at RESUME_AT; closing flushes a checkpoint
        ("resume-b", durable, False),  # new servers restore it; workers resume there
    ]
    for name, cfg, slow in sessions:
        role = ps.start(pg, cfg, SERVERS, slicer=SLICER)
        if isinstance(role, ps.PSServer):
            results[name] = {"server": role.state.stats()}
            continue
        with role as kv:
            if name.startswith("avg"):
                out = _avg_session(kv)
            elif name == "layout-conflict":
                out = _layout_conflict_session(kv)
            else:
                steps = ASYNC_STEPS if slow else RESUME_AT if name == "resume-a" else STEPS
                out = _toy_session(kv, cfg, slow, steps)
            if name == "avg-worker":
                out["server_stats"] = kv.stats()
        results[name] = out
    return results


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    ckpt = str(tmp_path_factory.mktemp("ps-ckpt"))
    out = rc.spawn(_job, SERVERS + WORKERS, args=(ckpt,), timeout_s=240)
    print(f"ps job: {time.monotonic() - t0:.1f} s")
    return out


def _workers(job: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r[name] for r in job[SERVERS:]]


def _servers(job: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r[name]["server"] for r in job[:SERVERS]]


# -- the checks -----------------------------------------------------------------------------
def _pushed(step: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for k in range(WORKERS):
        rng = np.random.default_rng([step, k])
        out.append(
            (
                rng.standard_normal(1000).astype(np.float32),
                rng.standard_normal(3).astype(np.float32),
            )
        )
    return out


@pytest.mark.timeout(300)
def test_bsp_average_is_exactly_the_mean_of_the_pushes(job: list[dict[str, Any]]) -> None:
    for step in range(3):
        gs = _pushed(step)
        mean_w = functools.reduce(np.add, [g[0] for g in gs]) / np.float32(WORKERS)
        mean_b = functools.reduce(np.add, [g[1] for g in gs]) / np.float32(WORKERS)
        for res in _workers(job, "avg-worker"):
            ow, ob = res["outs"][step]
            assert np.array_equal(ow, mean_w) and np.array_equal(ob, mean_b)


@pytest.mark.timeout(300)
def test_bsp_server_update_is_plain_sgd_on_the_mean(job: list[dict[str, Any]]) -> None:
    p = np.zeros(1000, np.float32)
    for step in range(3):
        gs = _pushed(step)
        p = p - np.float32(0.5) * (
            functools.reduce(np.add, [g[0] for g in gs]) / np.float32(WORKERS)
        )
        for res in _workers(job, "avg-server"):
            assert np.array_equal(res["outs"][step][0], p)


@pytest.mark.timeout(300)
def test_the_array_was_split_over_both_servers(job: list[dict[str, Any]]) -> None:
    shards = [
        (s["key"], s["start"], s["stop"])
        for st in _servers(job, "avg-worker")
        for s in st["shards"]
    ]
    assert sorted(s for s in shards if s[0] == KEY_W) == [(KEY_W, 0, 500), (KEY_W, 500, 1000)]
    assert [s for s in shards if s[0] == KEY_B] == [(KEY_B, 0, 3)]
    # every server reported, through a worker's stats() call too
    seen = _workers(job, "avg-worker")[0]["server_stats"]
    assert sorted(s["server"] for s in seen) == [0, 1]


def _oracle(cfg: ps.PSConfig) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """Single-process bsp: the mean of the workers' gradients, then the optimizer."""
    data = [_data(k) for k in range(WORKERS)]
    w, b = np.zeros(DIM), np.zeros(1)
    upd = ps.make_updater(cfg.optimizer, **cfg.optimizer_args)
    sw, sb = upd.new_state(w), upd.new_state(b)
    losses = []
    for _ in range(STEPS):
        parts = [_loss_grad(x, y, w, b) for x, y in data]
        losses.append(float(np.mean([p[0] for p in parts])))
        gw = functools.reduce(np.add, [p[1] for p in parts]) / WORKERS
        gb = functools.reduce(np.add, [p[2] for p in parts]) / WORKERS
        upd.apply(w, gw, sw)
        upd.apply(b, gb, sb)
    return w, b, losses


@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_bsp_server_and_worker_update_match_the_single_process_oracle(
    job: list[dict[str, Any]], opt: str
) -> None:
    server_runs = _workers(job, f"toy-server-{opt}")
    worker_runs = _workers(job, f"toy-worker-{opt}")
    w, b, losses = _oracle(_cfg(optimizer=opt))
    for res in server_runs + worker_runs:
        assert np.array_equal(res["w"], w) and np.array_equal(res["b"], b)
        assert res["gaps"] and max(res["gaps"]) == 0
    # each worker's loss on its own data, averaged over workers: the oracle's loss
    per_step = np.mean([r["losses"] for r in server_runs], axis=0)
    np.testing.assert_allclose(per_step, losses, rtol=1e-12)
    assert losses[-1] < 0.1 * losses[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bound", [0, 1, 3])
def test_ssp_never_exceeds_its_bound_with_a_slow_worker(
    job: list[dict[str, Any]], bound: int
) -> None:
    name = f"ssp{bound}"
    served = [
        g
        for st in _servers(job, name)
        for g in range(st["min_gap"], st["max_gap"] + 1)
        if st["gap_counts"][g - st["min_gap"]]
    ]
    assert (
        sum(st["pulls"] for st in _servers(job, name)) == WORKERS * ASYNC_STEPS * 3
    )  # 2 pieces + bias
    assert max(served) <= bound
    for res in _workers(job, name):
        assert max(res["gaps"]) <= bound and res["max_gap"] == max(res["gaps"])
    if bound:  # the fast workers did run ahead of the slow one, up to the bound
        assert max(served) >= 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["asp", "asp-worker"])
def test_asp_gaps_exceed_the_ssp_bound(job: list[dict[str, Any]], name: str) -> None:
    gaps = [g for res in _workers(job, name) for g in res["gaps"]]
    assert max(gaps) > 3, sorted(set(gaps))
    assert max(st["max_gap"] for st in _servers(job, name)) == max(gaps)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["ssp0", "ssp1", "ssp3", "asp", "asp-worker"])
def test_ssp_and_asp_still_train(job: list[dict[str, Any]], name: str) -> None:
    """Every worker's final model, on all workers' data, has a fifth of the first loss."""
    runs = _workers(job, name)
    first = _global_loss(np.zeros(DIM), np.zeros(1))
    for res in runs:
        final = _global_loss(res["w"], res["b"])
        assert final < 0.2 * first, (name, first, final)  # measured: 0.009-0.06


@pytest.mark.timeout(300)
def test_a_job_restarted_from_checkpoints_resumes_bit_exactly(job: list[dict[str, Any]]) -> None:
    """Servers checkpoint (every 5 steps, and when closing); new servers restore parameters,
    momentum and clocks; workers learn the step from them and finish as if never stopped."""
    w, b, _ = _oracle(_cfg())
    for first, second in zip(_workers(job, "resume-a"), _workers(job, "resume-b")):
        assert first["start_clock"] == 0 and second["start_clock"] == RESUME_AT
        assert np.array_equal(second["w"], w) and np.array_equal(second["b"], b)
    for st in _servers(job, "resume-b"):
        assert st["restored_progress"] == RESUME_AT
    assert all(st["checkpoints_written"] >= 2 for st in _servers(job, "resume-a"))


@pytest.mark.timeout(300)
def test_conflicting_layouts_are_refused_naming_server_op_and_key(
    job: list[dict[str, Any]],
) -> None:
    errors = [r["error"] for r in _workers(job, "layout-conflict") if r["error"]]
    assert errors, "no worker was refused"
    for e in errors:
        assert f"key {CONFLICT_KEY}" in e and "server 0" in e and "op init" in e


def test_client_side_misuse_is_refused_before_sending() -> None:
    class _NoGroup:  # every check below fires before the group is touched
        timeout_s = 1.0

    kv = ps.KVWorker.__new__(ps.KVWorker)
    kv.index, kv._keys, kv._closed = 0, {}, False
    with pytest.raises(KeyError, match="init"):
        kv.push(1, np.zeros(3))
    kv._keys[1] = ps.worker._KeyInfo(3, np.dtype(np.float64), 1, [ps.Piece(0, 0, 3)])
    with pytest.raises(ValueError, match="float64\\[3\\]"):
        kv.push(1, np.zeros(4))
    with pytest.raises(ValueError, match="contiguous"):
        kv.pull(1, np.zeros((3, 2))[:, 0])
    ro = np.zeros(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kv.pull(1, ro)
    with pytest.raises(TypeError, match="dtype"):
        kv.init(2, np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="numpy array"):
        kv.push(1, [0.0, 0.0, 0.0])  # type: ignore[arg-type]
