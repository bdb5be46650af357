"""ringcomm bench, the pure parts: plan, busbw factors, counts, inputs/oracle, aggregation,
table, JSON rows, footer, the sweep loop over fake implementations, argument checks."""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest

from ringcomm.bench.inputs import count_wrong, expected_output, rank_input
from ringcomm.bench.mpi import mpirun_command
from ringcomm.bench.report import (
    JSON_KEYS,
    Result,
    format_footer,
    format_header,
    format_row,
    format_table,
    json_row,
    ratio,
    summarize,
)
from ringcomm.bench.runner import aggregate, merge_rounds
from ringcomm.bench.spec import (
    OPS,
    BenchConfig,
    SizeSpec,
    busbw_factor,
    element_count,
    plan_sizes,
    sweep_bytes,
)
from ringcomm.bench.sweep import run_sweep
from ringcomm.cli import bench as bench_cli
from ringcomm.cli import build_parser

# --- plan ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 1, 0.0),
        ("reduce_scatter", 4, 0.75),
        ("all_gather", 3, 2 / 3),
        ("all_to_all", 8, 7 / 8),
        ("broadcast", 4, 1.0),
        ("sendrecv", 3, 1.0),
    ],
)
def test_busbw_factor(op: str, n: int, factor: float) -> None:
    assert busbw_factor(op, n) == pytest.approx(factor)


def test_busbw_factor_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="unknown op"):
        busbw_factor("reduce", 2)


@pytest.mark.parametrize(
    ("op", "nbytes", "itemsize", "n", "count"),
    [
        ("all_reduce", 8, 4, 3, 2),  # not rounded
        ("all_reduce", 1, 4, 2, 1),  # at least one element
        ("sendrecv", 10, 4, 2, 2),
        ("reduce_scatter", 8, 4, 3, 3),  # 2 -> 3 (a multiple of n, >= n)
        ("reduce_scatter", 8, 4, 4, 4),
        ("all_gather", 64, 4, 3, 18),  # 16 -> 18
        ("all_to_all", 64, 4, 4, 16),  # already a multiple
        ("all_gather", 1, 8, 5, 5),
        ("broadcast", 64 << 20, 4, 4, 16 << 20),
    ],
)
def test_element_count(op: str, nbytes: int, itemsize: int, n: int, count: int) -> None:
    assert element_count(op, nbytes, itemsize, n) == count


def test_sweep_bytes() -> None:
    assert sweep_bytes(8, 64, 2) == [8, 16, 32, 64]
    assert sweep_bytes(8, 100, 4) == [8, 32]
    assert sweep_bytes(5, 5, 1) == [5]
    assert len(sweep_bytes(8, 64 << 20, 2)) == 24
    with pytest.raises(ValueError):
        sweep_bytes(64, 8, 2)
    with pytest.raises(ValueError):
        sweep_bytes(8, 64, 1)


def test_plan_dedupes_sizes_that_round_alike_and_shapes() -> None:
    specs = plan_sizes(BenchConfig("all_gather", 4, begin=8, end=64))
    assert [s.count for s in specs] == [4, 8, 16]  # 8 B and 16 B both round to 4 floats
    assert [s.nbytes for s in specs] == [16, 32, 64]
    s = specs[-1]
    assert (s.block, s.in_shape, s.out_shape) == (4, (4,), (4, 4))
    assert s.redop is None and s.root == -1
    rs = plan_sizes(BenchConfig("reduce_scatter", 3, begin=48, end=48))[0]
    assert (rs.count, rs.in_shape, rs.out_shape, rs.redop) == (12, (3, 4), (4,), "sum")
    a2a = plan_sizes(BenchConfig("all_to_all", 2, begin=16, end=16, dtype="float64"))[0]
    assert (a2a.in_shape, a2a.out_shape, a2a.nbytes) == ((2, 1), (2, 1), 16)
    bc = plan_sizes(BenchConfig("broadcast", 3, begin=8, end=8, root=2))[0]
    assert (bc.root, bc.redop, bc.in_shape) == (2, None, (2,))


# --- inputs and the oracle ------------------------------------------------------------------


def _spec(
    op: str, n: int, count: int, dtype: str = "float32", redop: str | None = "sum", root: int = -1
) -> SizeSpec:
    return SizeSpec(op, n, dtype, count, redop, root)


def test_inputs_are_rank_seeded_and_deterministic() -> None:
    spec = _spec("all_reduce", 3, 100)
    a0, a0_again, a1 = rank_input(spec, 0, 7), rank_input(spec, 0, 7), rank_input(spec, 1, 7)
    assert np.array_equal(a0, a0_again) and not np.array_equal(a0, a1)
    assert a0.dtype == np.float32 and a0.shape == (100,)


@pytest.mark.parametrize("redop", ["sum", "avg", "max", "min", "prod"])
@pytest.mark.parametrize("dtype", ["float32", "int32", "uint8", "float16"])
def test_expected_all_reduce(redop: str, dtype: str) -> None:
    spec = _spec("all_reduce", 3, 50, dtype, redop)
    xs = [rank_input(spec, r, 1).astype(np.float64) for r in range(3)]
    want = {
        "sum": xs[0] + xs[1] + xs[2],
        "avg": np.trunc((xs[0] + xs[1] + xs[2]) / 3)
        if dtype != "float32" and dtype != "float16"
        else (xs[0] + xs[1] + xs[2]) / 3,
        "max": np.maximum(np.maximum(xs[0], xs[1]), xs[2]),
        "min": np.minimum(np.minimum(xs[0], xs[1]), xs[2]),
        "prod": xs[0] * xs[1] * xs[2],
    }[redop]
    got = expected_output(spec, 1, 1)
    assert got.dtype == np.dtype(dtype)
    assert count_wrong(got, want.astype(dtype)) == 0


def test_expected_bool_reduces_logically() -> None:
    spec = _spec("all_reduce", 2, 64, "bool", "sum")
    a, b = rank_input(spec, 0, 3), rank_input(spec, 1, 3)
    assert np.array_equal(expected_output(spec, 0, 3), a | b)
    spec_min = _spec("all_reduce", 2, 64, "bool", "min")
    assert np.array_equal(expected_output(spec_min, 0, 3), a & b)


def test_expected_split_and_p2p_ops() -> None:
    n = 3
    rs = _spec("reduce_scatter", n, 6)
    total = sum(rank_input(rs, r, 0) for r in range(n))
    assert np.array_equal(expected_output(rs, 2, 0), total[2])
    ag = _spec("all_gather", n, 6, redop=None)
    assert np.array_equal(expected_output(ag, 0, 0)[1], rank_input(ag, 1, 0))
    a2a = _spec("all_to_all", n, 6, redop=None)
    assert np.array_equal(expected_output(a2a, 1, 0)[2], rank_input(a2a, 2, 0)[1])
    bc = _spec("broadcast", n, 5, redop=None, root=1)
    assert np.array_equal(expected_output(bc, 0, 0), rank_input(bc, 1, 0))
    sr = _spec("sendrecv", n, 5, redop=None)
    assert np.array_equal(expected_output(sr, 0, 0), rank_input(sr, 2, 0))


def test_count_wrong() -> None:
    exp = np.arange(10, dtype=np.float32)
    got = exp.copy()
    assert count_wrong(got, exp) == 0
    got[[1, 5]] += 1
    assert count_wrong(got, exp) == 2
    assert count_wrong(got[:5], exp) == 10  # wrong shape: all wrong
    nan = np.array([np.nan, 1.0])
    assert count_wrong(nan.copy(), nan) == 0
    assert count_wrong(np.array([1, 2], np.int8), np.array([1, 3], np.int8)) == 1


# --- aggregation, table, JSON, footer ------------------------------------------------------


def test_summarize_median_per_rank_max_over_ranks() -> None:
    spec = _spec("all_reduce", 2, 256)  # 1024 B
    r = summarize("ringcomm", spec, [[1e-3, 2e-3, 9e-3], [4e-3, 5e-3, 6e-3]], [0, 2])
    assert r.time_us == pytest.approx(5000.0)  # medians 2 ms and 5 ms: max 5 ms
    assert r.p50_us == pytest.approx(4500.0)  # pooled 1,2,4,5,6,9 ms
    assert 6000.0 < r.p99_us <= 9000.0
    assert r.errors == 2 and r.iters == 3
    assert r.algbw_GBps == pytest.approx(1024 / 5e-3 / 1e9)
    assert r.busbw_GBps == pytest.approx(r.algbw_GBps * 1.0)  # 2(n-1)/n = 1 at n=2
    unchecked = summarize("gloo", spec, [[1e-3], [1e-3]], [None, None])
    assert unchecked.errors is None
    with pytest.raises(ValueError):
        summarize("gloo", spec, [[1e-3], []])


def _result(impl: str, spec: SizeSpec, time_us: float, errors: int | None = 0) -> Result:
    return Result(impl, spec, time_us, time_us, time_us * 1.5, errors, 20)


def test_ratio() -> None:
    spec = _spec("all_reduce", 4, 1 << 20)
    ours, theirs = _result("ringcomm", spec, 100.0), _result("gloo", spec, 300.0)
    bw, t = ratio(ours, theirs)
    assert bw == pytest.approx(3.0) and t == pytest.approx(1 / 3)


def test_json_row_shape() -> None:
    spec = _spec("reduce_scatter", 4, 1024)
    row = json_row(_result("ringcomm", spec, 250.0, errors=0))
    assert list(row)[: len(JSON_KEYS)] == list(JSON_KEYS)
    assert row["bytes"] == 4096 and row["count"] == 1024 and row["world_size"] == 4
    assert row["dtype"] == "float32" and row["impl"] == "ringcomm" and row["op"] == "reduce_scatter"
    assert row["algbw_GBps"] == pytest.approx(4096 / 250e-6 / 1e9, rel=1e-4)
    assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 0.75, rel=1e-4)
    assert {"p50_us", "p99_us"} <= set(row)
    json.loads(json.dumps(row))  # serialisable
    assert json_row(_result("gloo", spec, 1.0, errors=None))["errors"] is None


def test_table_columns_line_up() -> None:
    specs = [_spec("all_reduce", 2, c) for c in (2, 1 << 24)]
    results = []
    for s in specs:
        results += [_result("ringcomm", s, 150.5), _result("gloo", s, 12345.6, errors=None)]
    text = format_table(results, ("ringcomm", "gloo"))
    lines = text.splitlines()
    assert len(lines) == 5  # 3 header lines, 2 rows
    header, row = lines[1], lines[3]
    # every column title ends where its values end
    for title in ("size", "count", "time", "busbw", "#wrong", "p99"):
        end = header.index(title) + len(title)
        assert row[end - 1] != " ", (title, header, row)
    assert re.match(r"^\s+8\s+2\s+float32\s+sum\s+-1\s+150\.5\s", lines[3])
    assert "N/A" in lines[3] and "12346" in lines[3]  # >= 10 ms: no decimals
    assert "ringcomm/gloo" in lines[0]
    assert len(format_row(results[:2]).split()) == 5 + 6 + 6 + 2


def test_header_alone_matches_nccl_titles() -> None:
    text = format_header(("ringcomm",))
    assert text.splitlines()[1].split() == [
        "#",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "p50",
        "p99",
    ]


def test_footer() -> None:
    s1, s2 = _spec("all_reduce", 2, 1 << 20), _spec("all_reduce", 2, 1 << 21)
    ok = [_result("ringcomm", s1, 1000.0), _result("ringcomm", s2, 1000.0)]
    text = format_footer(ok, ("ringcomm",))
    assert "# Out of bounds values : 0 OK\n" in text
    avg = (4 * (1 << 20) / 1e-3 / 1e9 + 4 * (1 << 21) / 1e-3 / 1e9) / 2
    m = re.search(r"^# Avg bus bandwidth    : (\S+)$", text, re.MULTILINE)
    assert m is not None and float(m.group(1)) == pytest.approx(avg, rel=1e-4)
    bad = [_result("ringcomm", s1, 1000.0, errors=3), _result("gloo", s1, 2000.0)]
    text = format_footer(bad, ("ringcomm", "gloo"))
    assert "# Out of bounds values : 3 FAILED" in text
    assert "(gloo)" in text and "ringcomm/gloo busbw ratio: median 2.00" in text


# --- the sweep loop, with fake implementations ---------------------------------------------


class FakeImpl:
    """Computes the right answer locally (or a wrong one), logs what it was asked to do."""

    def __init__(self, name: str, rank: int, log: list[str], wrong: bool = False) -> None:
        self.name, self.rank, self.log, self.wrong = name, rank, log, wrong

    def sync(self) -> None:
        self.log.append(f"sync {self.name}")

    def prepare(self, spec: SizeSpec, data: np.ndarray):  # type: ignore[no-untyped-def]
        self.log.append(f"{self.name} {spec.count}")
        out = expected_output(spec, self.rank, 1234).copy()
        if self.wrong:
            out.reshape(-1)[0] += 1
        return lambda: out


def test_sweep_interleaves_checks_and_times() -> None:
    config = BenchConfig(
        "all_reduce",
        2,
        begin=8,
        end=16,
        iters=3,
        warmup=1,
        check=True,
        rounds=2,
        compare="gloo",
        quiet=True,
    )
    log: list[str] = []
    impls = [FakeImpl("ringcomm", 1, log), FakeImpl("gloo", 1, log, wrong=True)]
    records = run_sweep(impls, config, rank=1)
    assert [e for e in log if not e.startswith("sync")] == [
        "ringcomm 2",
        "gloo 2",
        "ringcomm 2",
        "gloo 2",
        "ringcomm 4",
        "gloo 4",
        "ringcomm 4",
        "gloo 4",
    ]
    assert log[0] == "sync ringcomm" and log[2] == "sync gloo"
    by = {(r["impl"], r["count"]): r for r in records}
    assert len(by[("ringcomm", 2)]["times_s"]) == 6  # 3 iters x 2 rounds
    assert by[("ringcomm", 2)]["errors"] == 0 and by[("gloo", 4)]["errors"] == 1
    json.dumps(records)  # plain data: crosses the pipe and the mpirun file


def test_aggregate_and_merge_rounds() -> None:
    config = BenchConfig("broadcast", 2, begin=8, end=16, compare="mpi", rounds=2)

    def rec(impl: str, count: int, t: list[float], e: int | None) -> dict[str, object]:
        return {"impl": impl, "count": count, "times_s": t, "errors": e}

    job_rc = [[rec("ringcomm", 2, [1e-3], 0), rec("ringcomm", 4, [2e-3], 0)]] * 2
    job_mpi = [[rec("mpi", 2, [3e-3], 0), rec("mpi", 4, [4e-3], None)]] * 2
    job_rc2 = [[rec("ringcomm", 2, [5e-3], None), rec("ringcomm", 4, [6e-3], None)]] * 2
    merged = merge_rounds([job_rc, job_mpi, job_rc2])
    results = aggregate(config, merged)
    assert [(r.impl, r.spec.count) for r in results] == [
        ("ringcomm", 2),
        ("mpi", 2),
        ("ringcomm", 4),
        ("mpi", 4),
    ]
    assert results[0].time_us == pytest.approx(3000.0)  # median of 1 ms and 5 ms
    assert results[0].iters == 2 and results[0].errors == 0


# --- command line ------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_config_from_args_defaults() -> None:
    config = bench_cli.config_from_args(_args("all_reduce", "-n", "2"))
    assert (config.begin, config.end, config.factor) == (8, 64 << 20, 2)
    assert (config.iters, config.warmup, config.dtype, config.redop) == (20, 5, "float32", "sum")
    assert config.rounds == 1 and config.compare is None


def test_config_from_args_compare_defaults_to_two_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing only, so it runs without torch: whether this installation can run Gloo is
    ``_check_available``'s business (tested through ``main`` below), stubbed out here."""
    monkeypatch.setattr(bench_cli, "_check_available", lambda config, plot: None)
    c2 = bench_cli.config_from_args(
        _args(
            "all_gather",
            "-n",
            "3",
            "-b",
            "1K",
            "-e",
            "16M",
            "-f",
            "4",
            "--compare",
            "gloo",
            "--op",
            "max",
        )
    )
    assert (c2.begin, c2.end, c2.factor, c2.rounds, c2.redop) == (1024, 16 << 20, 4, 2, "max")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["all_reduce", "-n", "2", "--hostfile", "hosts"], "cannot read hostfile hosts"),
        (["all_reduce"], "-n is required"),
        (["all_reduce", "-n", "2", "--ssh-config", "x"], "--ssh-config applies"),
        (["all_reduce", "-H", "a:1,b:1", "-n", "3"], "do not fit"),
        (["sendrecv", "-n", "1"], "sendrecv needs -n >= 2"),
        (["all_reduce", "-n", "0"], "-n must be >= 1"),
        (["all_reduce", "-n", "2", "-b", "1M", "-e", "1K"], "-e"),
        (["all_reduce", "-n", "2", "--iters", "0"], "--iters"),
        (["broadcast", "-n", "2", "--root", "2"], "--root"),
        (["all_reduce", "-n", "2", "--dtype", "bool", "--op", "avg"], "avg"),
        (["all_reduce", "-n", "2", "--compare", "gloo", "--dtype", "uint32"], "Gloo does not"),
        (["all_reduce", "-n", "2", "--mpi-tcp"], "--compare mpi"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringcomm.cli import main

    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert "ringcomm bench: error:" in err and message in err


def test_compare_mpi_missing_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from ringcomm.cli import main

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["bench", "all_reduce", "-n", "2", "--compare", "mpi"]) == 2
    err = capsys.readouterr().err
    assert "--compare mpi needs mpirun" in err and "apt-get install" in err


def test_compare_gloo_without_torch_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from ringcomm.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    assert main(["bench", "all_reduce", "-n", "2", "--compare", "gloo"]) == 2
    err = capsys.readouterr().err
    assert "--compare gloo needs PyTorch" in err and "pip install" in err


def test_plot_without_matplotlib_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringcomm.bench import plot
    from ringcomm.cli import main

    monkeypatch.setattr(plot, "matplotlib_missing", lambda: "--plot needs matplotlib: pip ...")
    assert main(["bench", "all_reduce", "-n", "2", "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_mpirun_command() -> None:
    config = BenchConfig("all_reduce", 4, mpi_tcp=True)
    cmd = mpirun_command(config, "/tmp/c.json", "/tmp/o.json")
    assert cmd[cmd.index("-np") + 1] == "4"
    assert "--oversubscribe" in cmd and cmd[cmd.index("--bind-to") + 1] == "none"
    assert cmd[cmd.index("btl") + 1] == "tcp,self" and "btl_tcp_if_include" in cmd
    assert cmd[-4:] == ["-m", "ringcomm.bench.mpi", "/tmp/c.json", "/tmp/o.json"]
    shm = mpirun_command(BenchConfig("all_reduce", 2), "c", "o")
    assert "btl" not in shm


def test_every_op_is_a_choice() -> None:
    for op in OPS:
        assert _args(op, "-n", "2").op == op


def test_format_markdown_and_figures_section(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import importlib.util
    from pathlib import Path

    from ringcomm.bench.report import format_markdown

    rows = []
    for count in (2, 1 << 18):
        spec = _spec("all_reduce", 2, count)
        rows += [json_row(_result("ringcomm", spec, 100.0)), json_row(_result("gloo", spec, 250.0))]
    text = format_markdown(rows, summary_bytes=(8, 1 << 20))
    assert "| all_reduce | 2.50 | 2.50 |" in text  # 1 MiB row: ratio 250/100
    assert "| 8 B | 100.0 |" in text and "| 1 MiB |" in text
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "figures.py"
    spec = importlib.util.spec_from_file_location("bench_figures", path)
    assert spec is not None and spec.loader is not None
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    md = tmp_path / "bench_x.md"
    md.write_text(f"# title\n{figures.BEGIN}\nold\n{figures.END}\nnotes\n")
    assert figures.update_markdown(md, "NEW")
    assert md.read_text() == f"# title\n{figures.BEGIN}\nNEW\n{figures.END}\nnotes\n"
