"""The registry's choices from a cost model (RINGCOMM_TUNE_FILE): the pure chooser
(ringcomm.collectives.chooser, choose_algorithm), the setting and the file, the piece size
reaching the algorithms (in-memory world), and pretend hosts where a loaded model changes
which algorithm runs (tests/scripts/model_choice.py) with results still right."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from memory_world import memory_world, run_ranks

from ringcomm.collectives import (
    ALGORITHMS,
    ALL_REDUCE_DIRECT_MAX_BYTES,
    ALL_REDUCE_DIRECT_MAX_WORLD,
    ALL_REDUCE_RD_MAX_BYTES,
    ALL_REDUCE_STAR_MAX_BYTES,
    ALL_REDUCE_STAR_MAX_WORLD,
    BROADCAST_TREE_MAX_BYTES,
    choose_algorithm,
)
from ringcomm.collectives.chooser import (
    CHUNK_CANDIDATES,
    SEGMENT_CANDIDATES,
    ModelChooser,
    size_bucket,
)
from ringcomm.config import DEFAULT_TUNE_FILE, resolve_init_config
from ringcomm.group import ProcessGroup
from ringcomm.rendezvous import StoreServer
from ringcomm.tuning.costmodel import (
    HIER_SEGMENT_BYTES,
    CostModel,
    CpuModel,
    LinkModel,
    load_tune_file,
)

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "model_choice.py"
MiB = 1 << 20
#: A 0.1 Gbit/s, 100 us network: crossing hosts is dear.
SLOW_NET = CostModel(net=LinkModel.from_rate(0.1, 100.0), source="slow net")
#: A free network: only the hosts' own links cost.
FAST_NET = CostModel(net=LinkModel(1e-6, 0.0), source="fast net")


def chooser(
    model: CostModel,
    hosts: int,
    per_host: int,
    *,
    chunk_bytes: int = 4 * MiB,
    choose_chunk: bool = True,
) -> ModelChooser:
    return ModelChooser(
        model,
        hosts,
        per_host,
        hosts * per_host,
        ALGORITHMS,
        chunk_bytes=chunk_bytes,
        choose_chunk=choose_chunk,
    )


def auto(collective: str, nbytes: int, world: int, model: ModelChooser | None, hier: bool) -> str:
    return choose_algorithm(collective, None, None, nbytes, world, model=model, hier=hier)


# -- the pure choice ---------------------------------------------------------------------


def test_a_slow_network_takes_hier_for_large_calls_and_a_flat_latency_algorithm_for_small() -> None:
    small = chooser(SLOW_NET, 2, 2)
    assert auto("all_reduce", 8, 4, small, True) == "star"  # measured switch points first
    assert auto("all_reduce", 16 << 10, 4, small, True) == "direct"
    for size in (64 << 10, MiB, 64 * MiB):
        assert auto("all_reduce", size, 4, small, True) == "hier"
    big = chooser(SLOW_NET, 4, 8)  # 32 ranks: no star, no direct
    assert auto("all_reduce", 8, 32, big, True) == "rd"
    assert auto("all_reduce", 64 * MiB, 32, big, True) == "hier"


def test_a_fast_network_keeps_mid_sizes_flat_and_one_host_takes_rd_then_the_ring() -> None:
    fast, slow = chooser(FAST_NET, 4, 8), chooser(SLOW_NET, 4, 8)
    assert auto("all_reduce", 64 << 10, 32, fast, True) == "rd"
    assert auto("all_reduce", 64 << 10, 32, slow, True) == "hier"
    assert auto("all_reduce", 64 * MiB, 32, fast, True) == "hier"  # fewer intra-host bytes
    flat = chooser(FAST_NET, 1, 8)
    assert auto("all_reduce", 64 << 10, 8, flat, False) == "rd"
    assert auto("all_reduce", 64 * MiB, 8, flat, False) == "ring"


def test_hier_only_where_the_caller_runs_it_and_only_implemented_algorithms() -> None:
    c = chooser(SLOW_NET, 2, 4)
    registry = {name for table in ALGORITHMS.values() for name in table} | {"hier"}
    for size in (64 << 10, MiB, 64 * MiB, 1 << 30):
        assert auto("all_reduce", size, 8, c, False) in ("ring", "rd")
        for collective in ("all_reduce", "broadcast", "reduce_scatter", "all_gather"):
            choice = c.choose(collective, size)
            assert choice is not None and choice.algo in registry
            assert choice.algo in ALGORITHMS[collective]  # no tree all_reduce, no ps
    assert auto("reduce_scatter", 64 * MiB, 8, c, False) == "ring"  # the only one it has
    # a caller that runs hierarchical reduce_scatter/all_gather (the group) may be told so
    assert auto("reduce_scatter", 64 * MiB, 8, c, True) == "hier"
    assert auto("all_gather", 8 * MiB, 8, c, True) == "hier"
    assert c.choose("reduce", MiB) is None and c.choose("all_to_all", MiB) is None
    assert auto("reduce", MiB, 8, c, False) == "tree"


#: A CPU term like the netns bed's (two cores shared by every host's ranks; a byte on the
#: host dearer than one across: the hierarchical schedule's workspace steps).
BED_CPU = CpuModel(0.3e-9, 0.6e-9, 0.3e-9, 2e-3, 2.0, 0)


def test_a_cpu_term_takes_the_flat_ring_where_the_cores_bound_and_hier_where_the_link_does() -> (
    None
):
    fast = chooser(CostModel(net=LinkModel.from_rate(10.0, 50.0), cpu=BED_CPU), 2, 2)
    slow = chooser(CostModel(net=LinkModel.from_rate(1.0, 50.0), cpu=BED_CPU), 2, 2)
    big = 64 * MiB
    got = fast.choose("all_reduce", big, hier=True)
    assert got is not None and got.algo == "ring" and got.segment_bytes is None
    got = slow.choose("all_reduce", big, hier=True)
    assert got is not None and got.algo == "hier"
    # where the link bounds, segments smaller than 8 MiB shorten the pipeline's fill
    assert got.segment_bytes is not None and got.segment_bytes < HIER_SEGMENT_BYTES
    assert got.segment_bytes == slow.hier_segment("all_reduce", big)
    assert got.segment_bytes in SEGMENT_CANDIDATES
    # where the cores bound, each segment's own cost counts: none smaller than 8 MiB
    seg = fast.hier_segment("all_reduce", big)
    assert seg is None or seg > HIER_SEGMENT_BYTES
    # all_gather counts one rank's input (the model's size is the output, x world)
    assert slow.hier_segment("all_gather", big // 4) == slow.hier_segment("all_gather", big // 4)
    assert slow.hier_segment("broadcast", big) is None  # not priced hierarchically
    # a model without a CPU term cannot see a segment's cost: hier keeps its 8 MiB
    assert chooser(SLOW_NET, 2, 2).hier_segment("all_reduce", big) is None
    assert chooser(SLOW_NET, 2, 2).choose("all_reduce", big, hier=True) == ModelChooser(
        SLOW_NET, 2, 2, 4, ALGORITHMS, chunk_bytes=4 * MiB
    ).choose("all_reduce", big, hier=True)


def _todays_rule(collective: str, nbytes: int, world: int) -> str:
    """The measured switch points, as they were before the cost model."""
    if collective == "all_reduce":
        if 3 <= world <= ALL_REDUCE_STAR_MAX_WORLD and nbytes <= ALL_REDUCE_STAR_MAX_BYTES:
            return "star"
        if nbytes <= ALL_REDUCE_DIRECT_MAX_BYTES and world <= ALL_REDUCE_DIRECT_MAX_WORLD:
            return "direct"
        return "rd" if nbytes <= ALL_REDUCE_RD_MAX_BYTES else "ring"
    if collective == "broadcast":
        return "tree" if nbytes <= BROADCAST_TREE_MAX_BYTES else "chain"
    return next(iter(ALGORITHMS[collective]))


def test_no_model_is_exactly_the_measured_switch_points() -> None:
    sizes = sorted(
        {
            0,
            1,
            8,
            1023,
            1024,
            1025,
            32 << 10,
            (32 << 10) + 1,
            512 << 10,
            (512 << 10) + 1,
            MiB,
            MiB + 1,
            64 * MiB,
        }
    )
    for collective in ALGORITHMS:
        for world in (2, 3, 4, 5, 8, 9, 32):
            for size in sizes:
                want = _todays_rule(collective, size, world)
                assert auto(collective, size, world, None, False) == want
                assert auto(collective, size, world, None, True) == want


def test_algo_and_ringcomm_algo_and_the_workspace_win_over_the_model() -> None:
    c = chooser(SLOW_NET, 2, 2)
    big = 64 * MiB
    assert choose_algorithm("all_reduce", "rd", None, big, 4, model=c, hier=True) == "rd"
    assert choose_algorithm("all_reduce", None, "direct", big, 4, model=c, hier=True) == "direct"
    assert choose_algorithm("broadcast", None, "tree", big, 4, model=c) == "tree"
    assert choose_algorithm("all_reduce", None, None, big, 4, local=True, model=c) == "shm"
    # RINGCOMM_ALGO naming another collective's algorithm: this one chooses as usual (model)
    assert (
        choose_algorithm("broadcast", None, "rd", big, 4, model=c)
        == c.choose("broadcast", big).algo
    )  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="no algorithm"):
        choose_algorithm("all_reduce", None, "bogus", big, 4, model=c)


def test_the_piece_size_where_pieces_pay_and_the_groups_elsewhere() -> None:
    slow_reduce = CostModel(gamma_s_per_byte=1 / 0.5e9)  # the reduction worth overlapping
    c = chooser(slow_reduce, 1, 4)
    ring = c.choose("all_reduce", 16 * MiB)
    assert ring is not None and ring.algo == "ring"
    assert ring.chunk_bytes in CHUNK_CANDIDATES and ring.chunk_bytes < 4 * MiB
    tiny = c.choose("all_reduce", 8)
    assert tiny is not None and tiny.chunk_bytes is None  # one piece whatever the size
    for world in (chooser(slow_reduce, 1, 4), chooser(SLOW_NET, 2, 4), chooser(FAST_NET, 4, 8)):
        for collective in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
            for n in (1, 1000, 64 << 10, world.one_piece_bytes):  # (the calls skip asking)
                assert world.choose(collective, n).chunk_bytes is None  # type: ignore[union-attr]
    fixed = chooser(slow_reduce, 1, 4, choose_chunk=False)
    assert fixed.choose("all_reduce", 16 * MiB).chunk_bytes is None  # type: ignore[union-attr]
    hier = chooser(SLOW_NET, 2, 2).choose("all_reduce", 64 * MiB, True)
    assert hier is not None and hier.algo == "hier" and hier.chunk_bytes is None


def test_answers_are_per_size_bucket_and_cached() -> None:
    c = chooser(SLOW_NET, 2, 2)
    a = c.choose("all_reduce", 3 * MiB, True)
    assert c.choose("all_reduce", 3 * MiB, True) is a  # cached
    assert c.choose("all_reduce", size_bucket(3 * MiB), True) is a  # one pricing per bucket
    assert a == c.price("all_reduce", size_bucket(3 * MiB), True)
    # all_gather's registry count is one rank's input; the model's size is the output
    assert c.choose("all_gather", MiB) == c.price("all_gather", size_bucket(4 * MiB))
    for n in (2, 3, 1000, 1025, 3 * MiB + 7):
        b = size_bucket(n)
        assert n <= b < n * 1.19 + 1 and size_bucket(b) == b


# -- the setting and the file --------------------------------------------------------------


def test_ringcomm_tune_file_setting() -> None:
    cfg = resolve_init_config(env={})
    assert (cfg.tune_file, cfg.tune_file_required) == (DEFAULT_TUNE_FILE, False)
    cfg = resolve_init_config(env={"RINGCOMM_TUNE_FILE": " /x/model.json "})
    assert (cfg.tune_file, cfg.tune_file_required) == ("/x/model.json", True)
    for off in ("none", "OFF", "0"):
        cfg = resolve_init_config(env={"RINGCOMM_TUNE_FILE": off})
        assert (cfg.tune_file, cfg.tune_file_required) == (None, False)


def test_load_tune_file(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    SLOW_NET.save(good)
    assert load_tune_file(str(good), required=True) == SLOW_NET
    assert load_tune_file(str(good), required=False) == SLOW_NET
    assert load_tune_file(None, required=False) is None
    missing = str(tmp_path / "missing.json")
    assert load_tune_file(missing, required=False) is None  # the default place, empty
    with pytest.raises(ValueError, match=r"RINGCOMM_TUNE_FILE: .*missing\.json"):
        load_tune_file(missing, required=True)
    bad = tmp_path / "bad.json"
    for text in ("{not json", '{"version": 1}', '{"version": 7}', "[1]"):
        bad.write_text(text)
        with pytest.raises(ValueError, match=re.escape(str(bad))):
            load_tune_file(str(bad), required=True)
        with pytest.warns(RuntimeWarning, match=re.escape(str(bad))):
            assert load_tune_file(str(bad), required=False) is None


# -- the piece size reaches the algorithms (in-memory world, one host) ---------------------


def _plan_chunks(pg: ProcessGroup) -> set[int]:
    """The piece sizes of the group's calls so far (ShapeCache keys end with them)."""
    return {key[-2] for key in pg.core.plans}


def test_the_models_piece_size_runs_and_an_explicit_one_wins() -> None:
    model = CostModel(gamma_s_per_byte=1 / 0.5e9)
    count = MiB  # float32: 4 MiB, a ring whose pieces pay (see above)
    want = chooser(model, 1, 4).choose("all_reduce", 4 * count)
    assert want is not None and want.algo == "ring" and want.chunk_bytes is not None
    with memory_world(4) as groups:
        for pg in groups:
            pg.core.state.costmodel = model
            pg.core.state.config = dataclasses.replace(pg.core.state.config, chunk_bytes=None)

        def body(pg: ProcessGroup) -> tuple[bool, set[int], bool, set[int]]:
            x = np.full(count, pg.rank + 1, np.float32)
            pg.all_reduce(x)
            first = bool((x == 10).all()), _plan_chunks(pg)
            pg.core.plans.clear()
            pg.chunk_bytes = 1 * MiB  # set by the user: the model keeps off it
            y = np.full(count, pg.rank + 1, np.float32)
            pg.all_reduce(y)
            return (*first, bool((y == 10).all()), _plan_chunks(pg))

        for ok, chunks, ok2, chunks2 in run_ranks(groups, body, timeout_s=60):
            assert ok and chunks == {want.chunk_bytes}
            assert ok2 and chunks2 == {1 * MiB}


# -- pretend hosts: the model changes what runs ----------------------------------------------


def _run(
    hosts: list[int], *args: str, cwd: Path, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "RINGCOMM_TUNE_FILE"}
    full.update(PYTHONPATH=str(REPO), **(env or {}))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringcomm",
            "run",
            "-n",
            str(len(hosts)),
            str(SCRIPT),
            ",".join(map(str, hosts)),
            *args,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
        cwd=cwd,
        env=full,
    )
    if check:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _calls(stdout: str, n: int) -> dict[tuple[str, int], str]:
    """(op, bytes) -> the algorithm every rank ran (they must agree), all results right."""
    seen: dict[tuple[str, int], set[str]] = {}
    for rank, op, nbytes, algo, ok in re.findall(
        r"^\[\d+\] CALL (\d+) (\w+) (\d+) (\S+) (\d)$", stdout, re.MULTILINE
    ):
        assert ok == "1", f"rank {rank}: {op} of {nbytes} B wrong"
        seen.setdefault((op, int(nbytes)), set()).add(algo)
    assert len(seen) == 6 and all(len(a) == 1 for a in seen.values()), seen
    return {k: v.pop() for k, v in seen.items()}


@pytest.mark.timeout(300)
def test_a_loaded_model_changes_the_algorithm_on_pretend_hosts(tmp_path: Path) -> None:
    hosts = [0, 0, 1, 1]
    plain = _calls(_run(hosts, cwd=tmp_path).stdout, 4)
    assert plain[("all_reduce", 8)] == plain[("all_reduce", MiB)] == "hier"  # any size today
    assert plain[("broadcast", MiB)] == "hier"  # across hosts (the model does not price it)

    # at the default place (rank 0's working directory); the other ranks name a file that
    # does not exist: it is not read, rank 0's model is everyone's
    SLOW_NET.save(tmp_path / DEFAULT_TUNE_FILE)
    out = _run(hosts, str(tmp_path / "nowhere.json"), cwd=tmp_path).stdout
    assert set(re.findall(r"^\[\d\] MODEL \d (.*)$", out, re.MULTILINE)) == {"slow net"}
    slow = _calls(out, 4)
    want = chooser(SLOW_NET, 2, 2)
    for (op, nbytes), algo in slow.items():
        expect = "hier" if op == "broadcast" else auto(op, nbytes, 4, want, True)
        assert algo == expect, (op, nbytes, algo, expect)
    assert slow[("all_reduce", 8)] == "star" and slow[("all_reduce", MiB)] == "hier"

    # RINGCOMM_ALGO wins over the model: hier at every size again, a chain broadcast
    forced = _calls(_run(hosts, cwd=tmp_path, env={"RINGCOMM_ALGO": "hier"}).stdout, 4)
    assert {forced[("all_reduce", n)] for n in (8, 64 << 10, MiB)} == {"hier"}
    forced = _calls(_run(hosts, cwd=tmp_path, env={"RINGCOMM_ALGO": "chain"}).stdout, 4)
    assert {forced[("broadcast", n)] for n in (8, 64 << 10, MiB)} == {"chain"}


@pytest.mark.timeout(120)
def test_a_bad_model_file_fails_every_rank_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    # Through the launcher: it stops the others once rank 0 fails (no timeout).
    out = _run([0, 0, 1, 1], cwd=tmp_path, env={"RINGCOMM_TUNE_FILE": str(bad)}, check=False)
    assert out.returncode != 0
    assert f"RINGCOMM_TUNE_FILE: {bad}: not JSON" in out.stderr
    # Plain processes, the store outliving rank 0: every other rank says why too.
    server = StoreServer("127.0.0.1", 0, token="model-test").start()
    try:
        procs = []
        for r in range(4):
            env = {k: v for k, v in os.environ.items() if k != "RINGCOMM_TUNE_FILE"}
            env.update(
                PYTHONPATH=str(REPO),
                RINGCOMM_RANK=str(r),
                RINGCOMM_WORLD_SIZE="4",
                RINGCOMM_MASTER_ADDR="127.0.0.1",
                RINGCOMM_MASTER_PORT=str(server.port),
                RINGCOMM_TOKEN="model-test",
                RINGCOMM_STORE_EXTERNAL="1",
                RINGCOMM_TUNE_FILE=str(bad),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPT), "0,0,1,1"],
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.close()
    assert all(p.returncode != 0 for p in procs), errs
    assert f"RINGCOMM_TUNE_FILE: {bad}: not JSON" in errs[0]
    for r in (1, 2, 3):
        assert f"rank {r}: rank 0's cost model: RINGCOMM_TUNE_FILE: {bad}" in errs[r], errs[r]


SEGMENT_SCRIPT = REPO / "tests" / "scripts" / "hier_segment.py"


def _segments_run(tmp_path: Path, env: dict[str, str]) -> dict[str, tuple[str, int]]:
    """op -> (segment, spans) every rank of 2 pretend hosts x 2 ran an 8 MiB call with."""
    full = {k: v for k, v in os.environ.items() if k != "RINGCOMM_TUNE_FILE"}
    full.update(PYTHONPATH=str(REPO), **env)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringcomm",
            "run",
            "-n",
            "4",
            str(SEGMENT_SCRIPT),
            "0,0,1,1",
            str(8 * MiB),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
        env=full,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    seen: dict[str, set[tuple[str, int]]] = {}
    for rank, op, seg, spans, ok in re.findall(
        r"^\[\d+\] SEG (\d) (\w+) (\S+) (\d+) (\d)$", out.stdout, re.MULTILINE
    ):
        assert ok == "1", f"rank {rank}: {op} wrong"
        seen.setdefault(op, set()).add((seg, int(spans)))
    assert len(seen) == 3 and all(len(v) == 1 for v in seen.values()), out.stdout
    return {op: v.pop() for op, v in seen.items()}


@pytest.mark.timeout(200)
def test_the_models_segment_size_runs_on_pretend_hosts(tmp_path: Path) -> None:
    plain = _segments_run(tmp_path, {"RINGCOMM_TUNE_FILE": "none"})
    assert plain == dict.fromkeys(("all_reduce", "reduce_scatter", "all_gather"), ("none", 1))
    model = CostModel(net=LinkModel.from_rate(1.0, 50.0), cpu=BED_CPU, source="bed at 1 Gbit/s")
    path = tmp_path / "bed.json"
    model.save(path)
    want = chooser(model, 2, 2)
    got = _segments_run(tmp_path, {"RINGCOMM_TUNE_FILE": str(path)})
    for op, nbytes in (
        ("all_reduce", 8 * MiB),
        ("reduce_scatter", 8 * MiB),
        ("all_gather", 2 * MiB),
    ):
        seg = want.hier_segment(op, nbytes)
        assert seg is not None and seg < 8 * MiB, (op, seg)
        assert got[op] == (str(seg), -(-8 * MiB // seg)), (op, got[op], seg)
