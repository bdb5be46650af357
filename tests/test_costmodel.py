"""The cost model (ringcomm.tuning.costmodel) against hand-computed times, and its two subcommands,
``ringcomm model`` and ``ringcomm tune``."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from ringcomm import cli
from ringcomm.tuning.costmodel import (
    ALGORITHMS,
    HIER_SEGMENT_BYTES,
    CostModel,
    CpuModel,
    HostSample,
    LinkModel,
    Sample,
    best,
    crossovers,
    design_row,
    fit_hosts,
    fit_local,
    plan,
    predict,
    predict_sample,
    uplink_bytes,
)

MiB = 1 << 20
US = 1e-6

# Round numbers for hand computation: local 10 us + 1 ns/B, net 50 us + 8 ns/B (1 Gbit/s),
# reduce 0.5 ns/B, no per-call overhead, pieces larger than any transfer here.
LOCAL = LinkModel(10 * US, 1e-9)
NET = LinkModel(50 * US, 8e-9)
GAMMA = 0.5e-9
M = CostModel(local=LOCAL, net=NET, gamma_s_per_byte=GAMMA, overhead_s=0.0, chunk_bytes=1 << 30)


def t(op: str, algo: str, hosts: int, per_host: int, size: int, model: CostModel = M) -> float:
    return predict(model, op, algo, hosts, per_host, size).time_s


# --- formulas against hand-computed values ------------------------------------------------
def test_ring_all_reduce_one_host_n4_1mib() -> None:
    piece = MiB / 4
    step = 10 * US + piece * 1e-9
    # 3 reduce-scatter steps (send, receive, reduce the piece) + 3 all-gather steps
    want = 3 * (step + piece * GAMMA) + 3 * step
    assert t("all_reduce", "ring", 1, 4, MiB) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(2026.08 * US, rel=1e-9)


def test_ring_all_reduce_across_hosts_waits_for_the_uplink_each_step() -> None:
    piece = MiB / 4  # 2 hosts x 2 ranks: the crossing edges set every step's pace
    step = 50 * US + piece * 8e-9
    want = 3 * (step + piece * GAMMA) + 3 * step
    assert t("all_reduce", "ring", 2, 2, MiB) == pytest.approx(want, rel=1e-12)


def test_hierarchical_all_reduce_2x2() -> None:
    s = MiB
    intra_rs = 10 * US + s / 2 * 1e-9 + s / 2 * GAMMA  # one step of S/2 on the host
    inter_rs = 50 * US + 2 * (s / 4) * 8e-9 + s / 4 * GAMMA  # 2 local rings share the uplink
    inter_ag = 50 * US + 2 * (s / 4) * 8e-9
    intra_ag = 10 * US + s / 2 * 1e-9
    want = intra_rs + inter_rs + inter_ag + intra_ag
    assert t("all_reduce", "hierarchical", 2, 2, s) == pytest.approx(want, rel=1e-12)


def test_recursive_doubling_power_of_two_and_not() -> None:
    s = 4096
    exchange = 10 * US + s * 1e-9 + s * GAMMA
    assert t("all_reduce", "rd", 1, 4, s) == pytest.approx(2 * exchange, rel=1e-12)
    # n = 3: fold rank 0 into 1, one exchange between 1 and 2, send the result back to 0
    want = exchange + exchange + (10 * US + s * 1e-9)
    assert t("all_reduce", "rd", 1, 3, s) == pytest.approx(want, rel=1e-12)


def test_tree_is_reduce_then_broadcast() -> None:
    s = 4096
    up, down = 10 * US + s * 1e-9 + s * GAMMA, 10 * US + s * 1e-9
    assert t("all_reduce", "tree", 1, 4, s) == pytest.approx(2 * up + 2 * down, rel=1e-12)
    assert t("broadcast", "tree", 1, 4, s) == pytest.approx(2 * down, rel=1e-12)
    # 2 hosts x 2: the far round (distance 2) crosses hosts, one sender per host
    net_up, net_down = 50 * US + s * 8e-9 + s * GAMMA, 50 * US + s * 8e-9
    assert t("all_reduce", "tree", 2, 2, s) == pytest.approx(up + net_up + net_down + down)


def test_parameter_server_push_pull() -> None:
    s = MiB  # 2 hosts x 2 workers, 2 servers on hosts of their own
    # push: a server receives 4 messages of S/2 (2S on its downlink; a worker host's uplink
    # carries 2S too) and reduces 2S; pull mirrors it without the reduction
    push = 4 * 50 * US + 2 * s * 8e-9 + 2 * s * GAMMA
    pull = 4 * 50 * US + 2 * s * 8e-9
    assert t("all_reduce", "ps", 2, 2, s) == pytest.approx(push + pull, rel=1e-12)
    # one server: it receives 4 messages of S and reduces 4S
    one = predict(M, "all_reduce", "ps", 2, 2, s, servers=1).time_s
    want = 2 * (4 * 50 * US + 4 * s * 8e-9) + 4 * s * GAMMA
    assert one == pytest.approx(want, rel=1e-12)


def test_pieces_overlap_the_reduction() -> None:
    model = M.replace(chunk_bytes=MiB)
    s = 8 * MiB  # n = 2: each step moves 4 MiB as 4 pieces; reduce piece j while j+1 moves
    comm = 4 * 10 * US + 4 * MiB * 1e-9
    red = 4 * MiB * GAMMA
    rs = max(comm, red) + min(comm, red) / 4
    assert t("all_reduce", "ring", 1, 2, s, model) == pytest.approx(rs + comm, rel=1e-12)
    assert t("all_reduce", "ring", 1, 2, s, model) < t("all_reduce", "ring", 1, 2, s)


def test_chain_broadcast_is_a_pipeline() -> None:
    model = M.replace(chunk_bytes=MiB)
    stage = 10 * US + MiB * 1e-9  # 3 ranks: 2 stages; 2 pieces: fill 2 stages + 1 more
    assert t("broadcast", "chain", 1, 3, 2 * MiB, model) == pytest.approx(3 * stage, rel=1e-12)


def test_overhead_is_paid_once_and_one_rank_costs_only_it() -> None:
    model = M.replace(overhead_s=7 * US)
    base = t("all_reduce", "ring", 1, 4, MiB)
    assert t("all_reduce", "ring", 1, 4, MiB, model) == pytest.approx(base + 7 * US)
    for algo in ALGORITHMS["all_reduce"]:
        if algo != "ps":
            assert t("all_reduce", algo, 1, 1, MiB, model) == pytest.approx(7 * US)


# --- shape of the predictions -------------------------------------------------------------
WORLDS = [(1, 2), (1, 5), (2, 1), (2, 4), (3, 3), (8, 8), (64, 4)]


@pytest.mark.parametrize(("hosts", "per_host"), WORLDS)
def test_time_grows_with_size_and_with_a_slower_network(hosts: int, per_host: int) -> None:
    slow = M.replace(net=LinkModel(100 * US, 80e-9))
    sizes = [1, 8, 100, 4096, 65536, MiB, 3 * MiB, 64 * MiB, 1 << 30]
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            if hosts * per_host < 2 and op == "sendrecv":
                continue
            times = [t(op, algo, hosts, per_host, s) for s in sizes]
            assert all(b >= a for a, b in itertools.pairwise(times)), (op, algo, times)
            assert all(
                t(op, algo, hosts, per_host, s, slow) >= t(op, algo, hosts, per_host, s)
                for s in (8, MiB)
            ), (op, algo)


def test_hierarchical_uplink_carries_2_h_minus_1_over_h_of_s() -> None:
    s, H, L = 64 * MiB, 4, 8
    n = H * L
    assert uplink_bytes("all_reduce", "hierarchical", H, L, s) == pytest.approx(2 * (H - 1) / H * s)
    assert uplink_bytes("all_reduce", "ring", H, L, s) == pytest.approx(2 * (n - 1) / n * s)
    assert uplink_bytes("reduce_scatter", "hierarchical", H, L, s) == pytest.approx((H - 1) / H * s)
    assert uplink_bytes("all_gather", "hierarchical", H, L, s) == pytest.approx((H - 1) / H * s)
    # recursive doubling: the exchanges at distance >= L put all L ranks' S on the uplink
    assert uplink_bytes("all_reduce", "rd", H, L, s) == pytest.approx(2 * L * s)
    for algo in ALGORITHMS["all_reduce"]:
        if algo != "ps":
            assert uplink_bytes("all_reduce", algo, 1, 8, s) == 0.0
    pred = predict(M, "all_reduce", "hierarchical", H, L, s)
    assert pred.uplink_bytes == pytest.approx(2 * (H - 1) / H * s)


def test_best_small_is_latency_optimal_large_is_bandwidth_optimal() -> None:
    model = CostModel()  # the defaults
    for hosts, per_host in [(4, 8), (16, 4), (2, 2), (64, 8)]:
        small, preds = best(model, hosts, per_host, 8)
        assert small in ("rd", "tree"), (hosts, per_host, small)
        assert [p.algo for p in preds] == list(ALGORITHMS["all_reduce"])
        assert min(p.time_s for p in preds) == next(p.time_s for p in preds if p.algo == small)
        large, _ = best(model, hosts, per_host, 64 * MiB)
        assert large in ("ring", "hierarchical"), (hosts, per_host, large)
    assert best(model, 4, 8, 64 * MiB)[0] == "hierarchical"  # fewer latency steps, fewer bytes


def test_busbw_uses_the_nccl_factor() -> None:
    p = predict(M, "all_reduce", "ring", 1, 4, MiB)
    assert p.busbw_GBps == pytest.approx(MiB / p.time_s / 1e9 * 2 * 3 / 4)
    q = predict(M, "broadcast", "chain", 1, 4, MiB)
    assert q.busbw_GBps == pytest.approx(q.algbw_GBps)


def test_crossovers_are_where_the_winner_changes() -> None:
    model = CostModel()
    found = crossovers(model, 4, 8)
    assert found, "small and large all_reduce across hosts have different winners"
    for c in found:
        assert best(model, 4, 8, c.size - 1)[0] == c.before
        assert best(model, 4, 8, c.size)[0] == c.after
    assert found[0].before in ("rd", "tree")
    assert found[-1].after in ("ring", "hierarchical")
    assert [c.size for c in found] == sorted(c.size for c in found)


def test_plans_are_cached_pure_data() -> None:
    assert plan("all_reduce", "ring", 4, 8) is plan("all_reduce", "ring", 4, 8)
    with pytest.raises(ValueError):
        plan("all_reduce", "chain", 2, 2)
    with pytest.raises(ValueError):
        predict(M, "all_to_all", "ring", 2, 2, 8)
    with pytest.raises(ValueError):
        predict(M, "all_reduce", "ring", 0, 2, 8)


# --- parameters: JSON and the fit -----------------------------------------------------------
def test_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    M.replace(source="test").save(path)
    assert CostModel.load(path) == M.replace(source="test")
    assert CostModel.from_dict(CostModel().to_dict()) == CostModel()
    (tmp_path / "bad.json").write_text('{"version": 1, "local": {"alpha_s": 1}}')
    with pytest.raises(ValueError, match=r"bad\.json"):
        CostModel.load(tmp_path / "bad.json")
    (tmp_path / "neg.json").write_text(
        json.dumps({**CostModel().to_dict(), "gamma_s_per_byte": -1})
    )
    with pytest.raises(ValueError):
        CostModel.load(tmp_path / "neg.json")


def test_files_without_a_cpu_term_stay_version_1_and_load_as_before(tmp_path: Path) -> None:
    old = {"version": 1, "local": {"alpha_s": 2e-05, "beta_s_per_byte": 4e-10},
           "net": {"alpha_s": 5e-05, "beta_s_per_byte": 8e-09}, "gamma_s_per_byte": 1.6667e-10,
           "overhead_s": 1e-05, "chunk_bytes": 4194304, "source": "ringcomm tune -n 2"}  # fmt: skip
    (tmp_path / "old.json").write_text(json.dumps(old))
    model = CostModel.load(tmp_path / "old.json")
    assert model.cpu is None and model.to_dict() == old  # what an older ringcomm wrote
    with_cpu = model.replace(cpu=CpuModel(1e-9, 2e-9, 3e-9, 4e-4, 2.0, 0))
    data = with_cpu.to_dict()
    assert data["version"] == 2 and data["cpu"]["shared_hosts"] == 0
    with_cpu.save(tmp_path / "new.json")
    assert CostModel.load(tmp_path / "new.json") == with_cpu
    for bad in ({**data, "version": 1}, {**data, "version": 3},
                {**data, "cpu": {**data["cpu"], "cores": 0}},
                {**data, "cpu": {"net_s_per_byte": 1e-9}}):  # fmt: skip
        with pytest.raises(ValueError):
            CostModel.from_dict(bad)


# --- the CPU term ------------------------------------------------------------------------------
#: Links and reductions that cost (almost) nothing: only the CPU pool does.
FREE = CostModel(local=LinkModel(0.0, 0.0), net=LinkModel(0.0, 0.0), gamma_s_per_byte=0.0,
                 overhead_s=0.0, chunk_bytes=1 << 30)  # fmt: skip


def test_the_cpu_pool_is_shared_by_the_ranks_of_a_host_and_co_located_hosts() -> None:
    # ring all_reduce on 2 hosts x 2: 6 steps of S/4. Per step each host's ranks send and
    # receive S/4 across hosts (S/2 of ends), S/4 on the host (both ends there: S/2), and
    # in the 3 reduce-scatter steps reduce S/4 each (S/2). With 1, 2, 4 ns per byte and
    # 2 cores: (1 * 0.5 + 2 * 0.5 + 4 * 0.5) S / 2 per reducing step, (1 * 0.5 + 2 * 0.5) S / 2
    # per gathering one: 3 * 1.75 S + 3 * 0.75 S = 7.5 S ns for a host with its own cores.
    size = MiB
    own = FREE.replace(cpu=CpuModel(1e-9, 2e-9, 4e-9, 0.0, 2.0, 1))
    assert t("all_reduce", "ring", 2, 2, size, own) == pytest.approx(7.5 * size * 1e-9)
    both = own.replace(cpu=CpuModel(1e-9, 2e-9, 4e-9, 0.0, 2.0, 0))  # one machine: twice
    assert t("all_reduce", "ring", 2, 2, size, both) == pytest.approx(15 * size * 1e-9)
    # the hierarchical schedule in one segment: the CPU work of all its steps
    hier = predict(both, "all_reduce", "hierarchical", 2, 2, size, segment_bytes=size)
    steps = plan("all_reduce", "hierarchical", 2, 2).steps
    work = sum(s.repeat * (1 * s.cpu_net + 2 * s.cpu_local + 4 * s.cpu_reduce) for s in steps)
    assert hier.time_s == pytest.approx(2 * work * size * 1e-9 / 2)
    # a link slower than the CPU sets the pace instead
    slow = both.replace(net=LinkModel(0.0, 1e-7))
    assert t("all_reduce", "ring", 2, 2, size, slow) == pytest.approx(6 * size / 4 * 1e-7)
    # without a CPU term: as before (only the links)
    assert t("all_reduce", "ring", 2, 2, size, FREE) == 0.0


def test_segments_pay_where_a_link_bounds_and_cost_where_the_cpu_does() -> None:
    size = 64 * MiB
    cpu = CpuModel(0.2e-9, 0.2e-9, 0.2e-9, 2e-3, 2.0, 0)
    link_bound = CostModel(net=LinkModel.from_rate(1.0, 50.0), cpu=cpu)
    cpu_bound = CostModel(net=LinkModel.from_rate(100.0, 50.0), cpu=cpu)

    def hier(model: CostModel, segment: int) -> float:
        return predict(model, "all_reduce", "hierarchical", 2, 2, size,
                       segment_bytes=segment).time_s  # fmt: skip

    assert hier(link_bound, 1 * MiB) < hier(link_bound, 8 * MiB) < hier(link_bound, size)
    assert hier(cpu_bound, size) < hier(cpu_bound, 8 * MiB) < hier(cpu_bound, 1 * MiB)
    # the default segment of a model with a CPU term is the 8 MiB ringcomm runs
    assert predict(cpu_bound, "all_reduce", "hierarchical", 2, 2, size).time_s == hier(
        cpu_bound, HIER_SEGMENT_BYTES
    )
    # one segment with a free CPU: the steps one after another, as without the term
    free_cpu = link_bound.replace(cpu=CpuModel(cores=1.0))
    assert hier(free_cpu, size) == pytest.approx(
        predict(link_bound.replace(cpu=None), "all_reduce", "hierarchical", 2, 2, size).time_s
    )
    with pytest.raises(ValueError):
        predict(cpu_bound, "all_reduce", "hierarchical", 2, 2, size, segment_bytes=0)


def _probe_samples(model: CostModel, hosts: int, per_host: int) -> list[HostSample]:
    specs = [("cross", 64 << 10, None), ("cross", 32 * MiB, None), ("host", 32 * MiB, None),
             ("flat", 32 * MiB, None), ("hier", 32 * MiB, 8 * MiB), ("hier", 32 * MiB, MiB)]  # fmt: skip
    out = []
    for kind, size, seg in specs:
        time_s = predict_sample(model, HostSample(kind, hosts, per_host, size, 1.0, seg))
        out.append(HostSample(kind, hosts, per_host, size, time_s, seg))
    return out


@pytest.mark.parametrize("gbps", [1.0, 10.0])
def test_fit_hosts_recovers_what_the_probes_show(gbps: float) -> None:
    truth = CostModel(net=LinkModel.from_rate(gbps, 60.0),
                      cpu=CpuModel(0.6e-9, 0.4e-9, 0.3e-9, 2e-3, 2.0, 0, 0.25e-9))  # fmt: skip
    samples = _probe_samples(truth, 2, 2)
    fit = fit_hosts(samples, CostModel(), cores=2.0, shared_hosts=0, source="synthetic")
    assert fit.max_relative_error < 0.02, fit
    assert fit.model.source == "synthetic" and fit.model.cpu is not None
    assert fit.model.cpu.cores == 2.0 and fit.model.cpu.shared_hosts == 0
    assert min(fit.parameters) >= 0
    # the 64 MiB points the probes did not run: within 5 %, and the same winner
    for algo in ("ring", "hierarchical"):
        want = predict(truth, "all_reduce", algo, 2, 2, 64 * MiB).time_s
        got = predict(fit.model, "all_reduce", algo, 2, 2, 64 * MiB).time_s
        assert got == pytest.approx(want, rel=0.05), (algo, got, want)
    assert (
        best(fit.model, 2, 2, 64 * MiB, algos=("ring", "hierarchical"))[0]
        == (best(truth, 2, 2, 64 * MiB, algos=("ring", "hierarchical"))[0])
    )


def test_fit_hosts_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        fit_hosts([], CostModel(), cores=2.0, shared_hosts=0)
    with pytest.raises(ValueError):
        fit_hosts([HostSample("flat", 2, 2, MiB, 0.0)], CostModel(), cores=2.0, shared_hosts=0)
    with pytest.raises(ValueError):
        predict_sample(CostModel(), HostSample("nope", 2, 2, MiB, 1.0))


def test_link_rates() -> None:
    link = LinkModel.from_rate(1.0, 50.0)
    assert link.beta_s_per_byte == pytest.approx(8e-9)
    assert link.alpha_s == pytest.approx(50e-6)
    assert link.gbps == pytest.approx(1.0)
    with pytest.raises(ValueError):
        LinkModel.from_rate(0.0, 1.0)
    with pytest.raises(ValueError):
        LinkModel(-1.0, 0.0)


def test_fit_recovers_known_parameters() -> None:
    truth = np.array([5 * US, 20 * US, 0.4e-9, 0.15e-9])  # overhead, alpha, beta, gamma
    samples = []
    for op, algo in (("all_reduce", "ring"), ("reduce_scatter", "ring"), ("all_gather", "ring")):
        for size in (8, 1024, 65536, MiB, 4 * MiB):
            time_s = float(design_row(op, algo, 2, size) @ truth)
            samples.append(Sample(op, algo, 2, size, time_s))
    fit = fit_local(samples)
    got = [fit.overhead_s, fit.alpha_s, fit.beta_s_per_byte, fit.gamma_s_per_byte]
    assert got == pytest.approx(list(truth), rel=1e-6)
    assert fit.rms_relative_error < 1e-9
    model = fit.apply(CostModel(), source="fit")
    assert model.local.alpha_s == pytest.approx(20 * US)
    assert model.local.beta_s_per_byte == pytest.approx(0.4e-9)
    assert model.net == CostModel().net


def test_fit_never_returns_a_negative_parameter() -> None:
    # times that fall with size would need beta < 0: it is fixed at 0 instead
    samples = [Sample("sendrecv", "direct", 2, s, ts) for s, ts in ((8, 3e-4), (MiB, 2e-4))]
    samples += [Sample("all_reduce", "ring", 2, s, ts) for s, ts in ((8, 5e-4), (MiB, 4e-4))]
    fit = fit_local(samples)
    assert min(fit.overhead_s, fit.alpha_s, fit.beta_s_per_byte, fit.gamma_s_per_byte) >= 0
    assert fit.alpha_s > 0


def test_design_row_refuses_pieces_beyond_the_chunk() -> None:
    with pytest.raises(ValueError):
        design_row("sendrecv", "direct", 2, 8 * MiB, chunk_bytes=4 * MiB)


# --- ringcomm model ------------------------------------------------------------------------
def test_model_cli_prints_the_table_and_scan(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["model", "--hosts", "4", "--ranks-per-host", "8", "--size", "64M"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "4 host(s) x 8 rank(s) = 32 ranks" in out
    for algo in ALGORITHMS["all_reduce"]:
        assert f"\n{algo} " in out
    assert "hierarchical" in out.split("<- best")[0].splitlines()[-1]
    assert "assumptions:" in out and "1 Gbit/s" in out
    scan = out.split("# scan:")[1].splitlines()[2:]
    assert [int(line.split()[1]) for line in scan] == [8 << i for i in range(10)]  # 8..4096
    assert "->" in out  # crossover points


def test_model_cli_says_what_a_group_runs_with_a_cpu_term(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["model", "--hosts", "2", "--ranks-per-host", "2", "--size", "64M", "--no-scan"]
    assert cli.main(base) == 0
    assert "# a group of this shape runs: hier (segments of 8M)" in capsys.readouterr().out
    cpu = CpuModel(0.3e-9, 0.6e-9, 0.3e-9, 2e-3, 2.0, 0)
    for gbps, runs in ((1, "hier (segments of "), (10, "ring (pieces of ")):
        path = tmp_path / f"m{gbps}.json"
        CostModel(net=LinkModel.from_rate(gbps, 50.0), cpu=cpu, source=f"bed {gbps}").save(path)
        assert cli.main([*base, "--model", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"bed {gbps}" in out and "cpu: net 300 ps/B" in out
        line = out.split("# a group of this shape runs: ")[1]
        assert line.startswith(runs), line
        if gbps == 1:
            assert not line.startswith("hier (segments of 8M)"), line


def test_model_cli_options_json_and_model_file(tmp_path: Path) -> None:
    mfile, jfile = tmp_path / "m.json", tmp_path / "out.json"
    M.replace(source="hand").save(mfile)
    argv = ["model", "--hosts", "2", "--ranks-per-host", "2", "--size", "1M", "--op",
            "all_reduce", "--model", str(mfile), "--json", str(jfile), "--no-scan"]  # fmt: skip
    assert cli.main(argv) == 0
    doc = json.loads(jfile.read_text())
    ring = next(p for p in doc["predictions"] if p["algo"] == "ring")
    assert ring["time_us"] == pytest.approx(t("all_reduce", "ring", 2, 2, MiB) * 1e6)
    assert doc["model"]["source"] == "hand"
    assert doc["scan"] == []
    # a faster network option overrides the file's
    assert cli.main([*argv, "--net-gbps", "100"]) == 0
    fast = json.loads(jfile.read_text())
    ring_fast = next(p for p in fast["predictions"] if p["algo"] == "ring")
    assert ring_fast["time_us"] < ring["time_us"]
    assert fast["model"]["source"] == "hand + options"


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather", "broadcast", "sendrecv"])
def test_model_cli_other_ops(op: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli.main(["model", "--hosts", "2", "--ranks-per-host", "4", "--size", "8K", "--op", op])
        == 0
    )
    out = capsys.readouterr().out
    assert f"ringcomm model {op}" in out
    for algo in ALGORITHMS[op]:
        assert f"\n{algo} " in out


@pytest.mark.parametrize(
    "extra",
    [
        ["--hosts", "0", "--ranks-per-host", "2", "--size", "8"],
        ["--hosts", "2", "--ranks-per-host", "0", "--size", "8"],
        ["--hosts", "2", "--ranks-per-host", "2", "--size", "0"],
        ["--hosts", "2", "--ranks-per-host", "2", "--size", "8", "--net-gbps", "0"],
        ["--hosts", "2", "--ranks-per-host", "2", "--size", "8", "--ps-servers", "0"],
        ["--hosts", "2", "--ranks-per-host", "2", "--size", "8", "--model", "/nonexistent.json"],
    ],
)
def test_model_cli_bad_values_exit_2(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["model", *extra]) == 2
    assert "ringcomm model: error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra",
    [
        ["--hosts", "2", "--ranks-per-host", "2", "--size", "1X"],
        ["--hosts", "2", "--ranks-per-host", "2"],
        ["--hosts", "2", "--ranks-per-host", "2", "--size", "8", "--op", "all_to_all"],
    ],
)
def test_model_cli_bad_syntax_exit_2(extra: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["model", *extra])
    assert info.value.code == 2


def test_model_cli_plot_without_matplotlib_exits_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    argv = ["model", "--hosts", "2", "--ranks-per-host", "2", "--size", "8"]
    assert cli.main([*argv, "--plot", str(tmp_path / "f.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "f.png").exists()


@pytest.mark.needs_plot
def test_model_cli_plot(tmp_path: Path) -> None:
    png = tmp_path / "busbw.png"
    argv = ["model", "--hosts", "2", "--ranks-per-host", "4", "--size", "16M", "--plot", str(png)]
    assert cli.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- ringcomm tune ---------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_tune_fits_positive_parameters_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short probe (2 ranks, 3 sizes, 5 iterations: a few seconds). The 4 MiB size keeps
    beta clear of a busy host's noise (its transfer alone takes milliseconds)."""
    out = tmp_path / "tuned.json"
    argv = ["tune", "--out", str(out), "--sizes", "8,1M,4M", "--iters", "5", "--warmup", "1",
            "--net-gbps", "10", "--net-latency-us", "30"]  # fmt: skip
    rc = cli.main(argv)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert rc == 0, text
    assert "# fit:" in text
    assert all(op in text for op in ("all_reduce", "reduce_scatter", "all_gather")), text
    model = CostModel.load(out)
    # a busy host blurs per-call overhead and per-message alpha (both are the cost of a small
    # call): their sum must be positive, each may be fixed at 0 by the non-negative fit
    assert model.local.alpha_s + model.overhead_s > 0, text
    assert model.local.beta_s_per_byte > 0, text
    assert min(model.local.alpha_s, model.overhead_s, model.gamma_s_per_byte) >= 0
    assert math.isfinite(model.local.alpha_s + model.local.beta_s_per_byte)
    assert model.net == LinkModel.from_rate(10.0, 30.0)
    assert "ringcomm tune -n 2" in model.source
    argv = ["model", "--hosts", "2", "--ranks-per-host", "2", "--size", "1M", "--model", str(out)]
    assert cli.main([*argv, "--no-scan"]) == 0
    assert "ringcomm tune -n 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra", [["-n", "1"], ["--sizes", "8"], ["--sizes", "8,64M"], ["--net-gbps", "-1"]]
)
def test_tune_bad_args_exit_2(extra: list[str], tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    assert cli.main(["tune", "--out", str(out), *extra]) == 2
    assert not out.exists()
