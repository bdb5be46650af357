"""Elastic parameter-server training (``ringcomm train --strategy ps --elastic``,
ringcomm.engine.elastic over ringcomm.engine.ps): a worker killed (SIGKILL, ``fail_at``)
at the start of a step or mid-step, after some of its pushes of the step reached the
servers (they hold partial bsp sums, and have applied the step for the keys pushed before);
every survivor undoes the step, they shrink, the workers re-split the same global batch and
the step is taken again; with ``max_restarts`` the worker comes back and the batch is split
over all again. Losses and final parameters equal ``single``'s (float64, 1e-10), in both
update modes. A lost server ends the job with an error."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from elastic_oracle import check_against_single

import ringcomm as rc
from ringcomm.cli.train import run_training
from ringcomm.engine.strategy import TrainConfig
from ringcomm.ps import PSConfig
from ringcomm.ps.state import ServerState

BASE: dict[str, Any] = {
    "steps": 5,
    "dtype": "float64",
    "in_features": 12,
    "hidden": 16,
    "depth": 2,
    "classes": 4,
    "batch_size": 24,
    "export": True,
    "timeout_s": 60.0,
    "optimizer": "adam",
    "lr": 0.01,
}
KEYS = 5  # layers with parameters at depth 2: Linear, LayerNorm, Linear, LayerNorm, Linear
#: The CLI runs: one server and four workers; the worker of slot 2 dies at step 3.
ELASTIC_PS = (
    "--strategy ps --elastic -n 5 --ps-servers 1 --fail-at 2:3"
    " --steps 5 --hidden 32 --layers 2 --batch-size 32"
)


def _cfg(servers: int, update: str, fail_at: tuple[tuple[int, ...], ...], **kw: Any) -> TrainConfig:
    return TrainConfig(
        strategy="ps",
        world_size=servers + 4,
        ps_servers=servers,
        ps_update=update,
        elastic=True,
        fail_at=fail_at,
        **BASE,
        **kw,
    )


# (servers, update, slot, step, push_pull after which it dies; None: at the step's start)
CASES = [
    (1, "server", 2, 2, None),
    (2, "worker", 4, 1, None),
    (1, "server", 3, 3, 1),
    (2, "worker", 5, 2, 2),
    (1, "worker", 4, 2, KEYS - 1),  # every key pushed: the servers completed the step
    (1, "server", 3, 1, KEYS - 1),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("servers", "update", "slot", "step", "push"), CASES)
def test_a_lost_worker_s_step_is_undone_and_taken_again_by_the_survivors(
    servers: int, update: str, slot: int, step: int, push: int | None
) -> None:
    fail = (slot, step) if push is None else (slot, step, push)
    out = check_against_single(_cfg(servers, update, (fail,)))
    others = [s for s in range(servers + 4) if s != slot]
    assert [(c["event"], c["slots"]) for c in out["membership"]] == [("shrink", others)]
    change = out["membership"][0]
    # After its last push, the dead worker's step may be complete on some survivors.
    assert change["step"] == step or (push == KEYS - 1 and change["step"] == step + 1), change
    assert out["lost_slots"] == [slot]
    assert out["ps"] == {"servers": servers, "workers": 3, "consistency": "bsp", "update": update}


@pytest.mark.timeout(120)
def test_two_workers_lost_in_one_step_are_two_membership_changes() -> None:
    # Slot 2 dies at the start of step 2; slot 4 was to die after its push_pull 1 of that
    # step, which cannot complete without slot 2: it dies in the step's second attempt.
    out = check_against_single(_cfg(2, "server", ((2, 2), (4, 2, 1))))
    assert [(c["step"], c["event"], c["slots"]) for c in out["membership"]] == [
        (2, "shrink", [0, 1, 3, 4, 5]),
        (2, "shrink", [0, 1, 3, 5]),
    ]
    assert out["lost_slots"] == [2, 4] and out["ps"]["workers"] == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("update", "slot", "step", "push"),
    [("server", 1, 2, None), ("worker", 4, 3, 2), ("server", 2, 1, 0)],
)
def test_a_restarted_worker_rejoins_and_the_batch_is_split_over_all_again(
    update: str, slot: int, step: int, push: int | None
) -> None:
    fail = (slot, step) if push is None else (slot, step, push)
    out = check_against_single(_cfg(1, update, (fail,), max_restarts=1))
    others = [s for s in range(5) if s != slot]
    assert [(c["step"], c["event"], c["slots"]) for c in out["membership"]] == [
        (step, "shrink", others),
        (step, "grow", list(range(5))),
    ]
    assert out["lost_slots"] == [] and out["final_slots"] == list(range(5))
    rows = {r["rank"]: r for r in out["per_rank"]}
    assert rows[slot]["rejoined"] and not any(rows[s]["rejoined"] for s in others)
    assert all(c["time_lost_s"] > 0 for c in out["membership"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_lost_server_ends_the_job_with_an_error(restarts: int) -> None:
    cfg = _cfg(2, "server", ((1, 2),), max_restarts=restarts)
    with pytest.raises(rc.RankFailedError) as info:
        run_training(cfg)
    text = str(info.value)
    assert "server slot 1 lost at step 2" in text and "the job ends" in text, text


def test_rebase_undoes_an_applied_step_and_drops_partial_sums() -> None:
    cfg = PSConfig(
        num_workers=3, optimizer="adam", optimizer_args={"lr": 0.1}, reduce="sum", keep_undo=True
    )
    st = ServerState(cfg)
    a = st.init_shard(0, 0, 4, 4, np.dtype(np.float64), np.arange(4.0))
    b = st.init_shard(1, 0, 2, 2, np.dtype(np.float64), np.ones(2))
    for w in range(3):  # step 0 everywhere
        st.push(w, a, 0, np.full(4, 0.5))
        st.push(w, b, 0, np.full(2, 0.5))
    param0, m0 = a.param.copy(), a.opt_state["m"].copy()
    for w in range(3):  # step 1: key 0 completes, key 1 gets two of three
        st.push(w, a, 1, np.full(4, 1.0 + w))
    st.push(0, b, 1, np.full(2, 1.0))
    st.push(2, b, 1, np.full(2, 1.0))
    b1 = b.param.copy()
    assert (a.version, b.version) == (2, 1) and not np.array_equal(a.param, param0)
    new = st.rebase(
        PSConfig(
            num_workers=2,
            optimizer="adam",
            optimizer_args={"lr": 0.1},
            reduce="sum",
            keep_undo=True,
        ),
        1,
    )
    a2, b2 = new.shard(0, 0), new.shard(1, 0)
    assert a2 is not None and b2 is not None
    np.testing.assert_array_equal(a2.param, param0)
    np.testing.assert_array_equal(a2.opt_state["m"], m0)
    np.testing.assert_array_equal(b2.param, b1)
    assert (a2.version, b2.version) == (1, 1) and not b2.pending
    assert a2.clocks.tolist() == [1, 1] and int(a2.opt_state["t"]) == 1
    with pytest.raises(ValueError, match="cannot go back"):
        new.rebase(new.config, 3)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--consistency", "ssp"], "needs --consistency bsp"),
        (["--consistency", "asp"], "needs --consistency bsp"),
        (["--checkpoint-dir", "ckpt"], "--checkpoint-dir"),
        (["--fail-at", "1:1,2:1"], "at least one ps worker must survive"),
    ],
)
def test_unsupported_elastic_ps_options_exit_2(extra: list[str], says: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            *shlex.split("-m ringcomm train --strategy ps -n 3 --steps 3 --elastic"),
            *extra,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "error:" in out.stderr and says in out.stderr, out.stderr


@pytest.mark.timeout(120)
def test_the_cli_prints_and_records_the_membership_change(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    out = subprocess.run(
        [sys.executable, *shlex.split(f"-m ringcomm train {ELASTIC_PS} -q --json"), str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr
    assert "strategy ps (elastic)" in out.stdout, out.stdout
    assert "step 3: shrink -> ranks (slots) [0, 1, 3, 4]" in out.stdout, out.stdout
    result = json.loads(path.read_text())
    assert [(c["step"], c["event"], c["slots"]) for c in result["membership"]] == [
        (3, "shrink", [0, 1, 3, 4])
    ]
    assert result["lost_slots"] == [2] and None not in result["losses"]


@pytest.mark.timeout(120)
def test_a_grow_tells_nobody_a_peer_left_while_it_waited(tmp_path: Path) -> None:
    # At a grow the servers' request loops let go of the old group before any rank
    # closes it (pg.grow(on_admit=...)): no "left the group while this rank still
    # expected messages" on the way, and only the killed worker is reported.
    out = subprocess.run(
        [sys.executable, *shlex.split(f"-m ringcomm train {ELASTIC_PS} --max-restarts 1 -q")],
        check=False,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr
    assert "step 3: grow -> ranks (slots) [0, 1, 2, 3, 4]" in out.stdout, out.stdout
    assert "left the group" not in out.stderr, out.stderr
    for line in out.stderr.splitlines():
        if "failed" in line:
            assert "peer rank 2 failed" in line, out.stderr
