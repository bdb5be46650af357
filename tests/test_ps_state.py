"""Parameter-server state without sockets: consistency rules, gaps, updaters, checkpoints."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from ringcomm.ps.config import PSConfig
from ringcomm.ps.state import (
    STATUS_DROPPED,
    STATUS_OK,
    ServerState,
    load_checkpoint,
    save_checkpoint,
)
from ringcomm.ps.updaters import SGD, Adam, make_updater

F32 = np.dtype(np.float32)


def _state(**kw: object) -> ServerState:
    cfg = PSConfig(**{"num_workers": 3, "optimizer_args": {"lr": 0.5}, **kw})  # type: ignore[arg-type]
    return ServerState(cfg, 0)


def _grads(rng: np.random.Generator, n: int = 3, size: int = 17) -> list[np.ndarray]:
    return [rng.standard_normal(size).astype(np.float32) for _ in range(n)]


def test_bsp_average_is_the_mean_in_worker_order_whatever_the_arrival_order() -> None:
    rng = np.random.default_rng(0)
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        st = _state(update="worker")
        sh = st.init_shard(4, 0, 17, 17, F32, np.zeros(17, np.float32))
        gs = _grads(rng)
        expected = functools.reduce(np.add, gs) / np.float32(3)
        for i, w in enumerate(order):
            assert not st.pull_ready(sh, 1)
            assert st.push(w, sh, 0, gs[w].copy()) == STATUS_OK
            assert sh.version == (1 if i == 2 else 0)
        assert st.pull_ready(sh, 1)
        out, status, gap = st.pull(sh, 1, copy=False)
        assert status == STATUS_OK and gap == 0
        assert out.dtype == np.float32 and np.array_equal(out, expected)


def test_bsp_server_update_applies_the_average_once_per_step() -> None:
    rng = np.random.default_rng(1)
    st = _state()
    p0 = rng.standard_normal(17).astype(np.float32)
    sh = st.init_shard(4, 0, 17, 17, F32, p0)
    for step in range(3):
        gs = _grads(rng)
        for w in range(3):
            st.push(w, sh, step, gs[w].copy())
        avg = functools.reduce(np.add, gs) / np.float32(3)
        p0 = p0 - np.float32(0.5) * avg
        assert np.array_equal(sh.param, p0)
    assert sh.version == sh.applied == 3


@pytest.mark.parametrize("consistency", ["bsp", "asp"])
def test_reduce_sum_adds_the_pushes(consistency: str) -> None:
    st = _state(consistency=consistency, reduce="sum", optimizer_args={"lr": 1.0})
    sh = st.init_shard(4, 0, 2, 2, F32, np.zeros(2, np.float32))
    for w in range(3):
        st.push(w, sh, 0, np.array([w, 1.0], np.float32))
    assert sh.param.tolist() == [-3.0, -3.0]  # bsp: one step of the sum; asp: three pushes


def test_duplicate_and_stale_pushes_are_dropped() -> None:
    st = _state()
    sh = st.init_shard(1, 0, 4, 4, F32, np.zeros(4, np.float32))
    g = np.ones(4, np.float32)
    assert st.push(0, sh, 0, g.copy()) == STATUS_OK
    assert st.push(0, sh, 0, g.copy()) == STATUS_DROPPED  # re-sent after a reconnect
    assert len(sh.pending[0]) == 1 and st.dropped_pushes == 1


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_ssp_delays_pulls_beyond_the_bound_and_records_gaps(bound: int) -> None:
    st = _state(consistency="ssp", staleness=bound)
    sh = st.init_shard(1, 0, 4, 4, F32, np.zeros(4, np.float32))
    g = np.ones(4, np.float32)
    # worker 0 races ahead; workers 1 and 2 stay at clock 0
    for step in range(bound + 2):
        st.push(0, sh, step, g.copy())
        reader = step + 1  # push_pull of `step` reads for step + 1
        assert st.pull_ready(sh, reader) == (reader <= bound)
    # the slow workers catch up by one step: the window moves by one
    st.push(1, sh, 0, g.copy())
    assert not st.pull_ready(sh, bound + 1)
    st.push(2, sh, 0, g.copy())
    assert st.pull_ready(sh, bound + 1)
    out, _, gap = st.pull(sh, bound + 1, copy=True)
    assert gap == bound and st.gap_counts == {bound: 1}
    assert out is not sh.param  # ssp: a copy, the shard changes under later pushes


def test_asp_never_delays_and_applies_each_push_scaled() -> None:
    st = _state(consistency="asp", optimizer_args={"lr": 1.0})
    sh = st.init_shard(1, 0, 2, 2, F32, np.zeros(2, np.float32))
    for step in range(10):
        st.push(0, sh, step, np.full(2, 3.0, np.float32))
    assert st.pull_ready(sh, 11)
    _, _, gap = st.pull(sh, 11, copy=True)
    assert gap == 11
    assert np.array_equal(sh.param, np.full(2, -10.0, np.float32))  # 10 x (3 / 3 workers)
    assert sh.applied == 10


def test_asp_worker_update_hands_every_push_to_every_worker_once() -> None:
    st = _state(consistency="asp", update="worker")
    sh = st.init_shard(1, 0, 2, 2, F32, np.zeros(2, np.float32))
    assert st.pull(sh, 0, copy=True, worker=1)[0].tolist() == [0.0, 0.0]  # nothing pushed yet
    st.push(0, sh, 0, np.array([3, 6], np.float32))
    st.push(2, sh, 0, np.array([3, 3], np.float32))
    out, status, _ = st.pull(sh, 1, copy=True, worker=1)
    assert status == STATUS_OK and out.tolist() == [2.0, 3.0]  # (g0 + g2) / 3
    st.push(0, sh, 1, np.array([6, 0], np.float32))
    assert st.pull(sh, 2, copy=True, worker=1)[0].tolist() == [2.0, 0.0]  # only what is new
    assert st.pull(sh, 2, copy=True, worker=0)[0].tolist() == [4.0, 3.0]  # all three


def test_sgd_updater_matches_the_formulas() -> None:
    rng = np.random.default_rng(2)
    p = rng.standard_normal(9).astype(np.float32)
    u = SGD(lr=0.1, momentum=0.9)
    state = u.new_state(p)
    ref, buf = p.copy(), None
    for _ in range(4):
        g = rng.standard_normal(9).astype(np.float32)
        u.apply(p, g, state)
        buf = g.copy() if buf is None else buf * np.float32(0.9) + g
        ref = ref - np.float32(0.1) * buf
        assert np.array_equal(p, ref)
    assert int(state["t"]) == 4


def test_adam_updater_matches_the_formulas() -> None:
    rng = np.random.default_rng(3)
    p = rng.standard_normal(9)
    u = make_updater("adam", lr=0.01)
    assert isinstance(u, Adam)
    state = u.new_state(p)
    ref, m, v = p.copy(), np.zeros(9), np.zeros(9)
    for t in range(1, 5):
        g = rng.standard_normal(9)
        u.apply(p, g, state)
        m = m * 0.9 + (1 - 0.9) * g
        v = v * 0.999 + (1 - 0.999) * (g * g)
        ref = ref - (0.01 / (1 - 0.9**t)) * m / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        np.testing.assert_allclose(p, ref, rtol=1e-13, atol=0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_updater("lamb")


def test_checkpoint_round_trip_and_atomic_write(tmp_path: object) -> None:
    d = str(tmp_path)
    cfg = PSConfig(
        num_workers=2,
        optimizer="adam",
        optimizer_args={"lr": 0.1},
        checkpoint_dir=d,
        checkpoint_every_steps=2,
    )
    st = ServerState(cfg, 1)
    rng = np.random.default_rng(4)
    sh = st.init_shard(9, 5, 12, 20, np.dtype(np.float64), rng.standard_normal(7))
    for step in range(2):
        assert not st.checkpoint_due()
        for w in range(2):
            st.push(w, sh, step, rng.standard_normal(7))
    assert st.checkpoint_due()
    path = save_checkpoint(st, d)
    assert os.path.basename(path) == "ps-server-1.npz"
    assert [f for f in os.listdir(d) if f.endswith(".tmp")] == []  # nothing half-written left
    assert not st.checkpoint_due()

    back = ServerState(cfg, 1)
    assert load_checkpoint(back, d)
    b = back.shard(9, 5)
    assert b is not None and (b.stop, b.total, b.version, b.applied) == (12, 20, 2, 2)
    assert np.array_equal(b.param, sh.param) and np.array_equal(b.clocks, sh.clocks)
    for name in ("m", "v", "t"):
        assert np.array_equal(b.opt_state[name], sh.opt_state[name])
    assert back.restored_progress == 2 and back.needs_resync
    assert not load_checkpoint(ServerState(cfg, 0), d)  # no checkpoint of server 0

    wrong = ServerState(PSConfig(num_workers=3, checkpoint_dir=d), 1)
    with pytest.raises(ValueError, match="checkpoint was written for"):
        load_checkpoint(wrong, d)


def test_resync_moves_bsp_forward_to_where_the_workers_are() -> None:
    st = _state()
    sh = st.init_shard(1, 0, 2, 2, F32, np.zeros(2, np.float32))
    st.restored_progress, st.needs_resync = 0, True
    # after a crash mid-step 5: workers 0 and 1 wait on step 5, worker 2 moved on to step 6
    for w, c in ((0, 5), (1, 5), (2, 6)):
        st.hello(w, c)
    assert st.resync_ready()
    st.resync()
    assert sh.version == 6 and sh.clocks.tolist() == [5, 5, 6]
    assert st.push(0, sh, 5, np.ones(2, np.float32)) == STATUS_DROPPED  # lost with the crash
    assert st.pull_ready(sh, 6)  # ... but its pull is served, the job goes on
    for w in range(3):
        assert st.push(w, sh, 6, np.ones(2, np.float32)) == STATUS_OK
    assert sh.version == 7 and sh.applied == 1


def test_a_key_made_mid_job_starts_at_the_initialising_clock() -> None:
    st = _state()
    sh = st.init_shard(1, 0, 2, 2, F32, np.zeros(2, np.float32), clock=8)
    assert sh.version == 8 and sh.clocks.tolist() == [8, 8, 8]
    assert st.pull_ready(sh, 8) and not st.pull_ready(sh, 9)
    for w in range(3):
        st.push(w, sh, 8, np.ones(2, np.float32))
    assert sh.version == 9 and st.pull_ready(sh, 9)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="consistency"):
        PSConfig(num_workers=1, consistency="eventual")
    with pytest.raises(ValueError, match="reduce"):
        PSConfig(num_workers=1, reduce="max")
    with pytest.raises(ValueError, match="update"):
        PSConfig(num_workers=1, update="both")
    with pytest.raises(ValueError, match="checkpoint_dir"):
        PSConfig(num_workers=1, checkpoint_every_steps=5)
    assert PSConfig(num_workers=1, consistency="ssp", staleness=2).bound == 2
    assert PSConfig(num_workers=1, consistency="asp").bound is None
