"""Conventions users bring from nccl-tests, torchrun and mpirun, and failing before work.

* Output paths (``--json``, ``--plot``, ``--chrome``, ``--out``, checkpoint folders) are
  checked before anything runs: one line, exit 2 (DESIGN.md §8).
* ``ringcomm run -np N`` (mpirun) and ``--nproc-per-node N`` without hosts (torchrun);
  launcher options end at the script (no abbreviations, ``--`` respected).
* ``bench -w -c -d -o -r`` as nccl-tests; ``-n`` far beyond the cores draws a warning.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringcomm import cli
from ringcomm.cli.bench import config_from_args, crowding_warning

BAD = "/nonexistent/x.json"


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "all_reduce", "-n", "2", "--json", BAD],
        ["bench", "all_reduce", "-n", "2", "--plot", "/nonexistent/x.png"],
        ["train", "--strategy", "dp", "-n", "2", "--json", BAD],
        ["train", "--strategy", "ps", "-n", "2", "--checkpoint-dir", "/proc/1/no/such"],
        ["trace", ".", "--chrome", BAD],
        ["model", "--hosts", "2", "--ranks-per-host", "2", "--size", "1M", "--json", BAD],
        ["tune", "--out", BAD],
    ],
)
def test_an_unwritable_output_is_refused_before_any_work(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.monotonic()
    assert cli.main(argv) == 2
    assert time.monotonic() - t0 < 2.0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"ringcomm {argv[0]}: error: --"), err


def test_a_directory_given_as_an_output_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "all_reduce", "-n", "2", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_command_line_refuses_a_bad_json_path_in_one_line() -> None:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ringcomm", "bench", "all_reduce", "-n", "2", "--json", BAD],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "ringcomm bench: error: --json /nonexistent/x.json: no such directory: /nonexistent"
    )
    assert proc.stdout == ""  # no sweep started
    assert elapsed < 10.0  # (interpreter start included; the check itself: above, < 2 s)


# -- ringcomm run --------------------------------------------------------------------------------
def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["run", "--dry-run", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "spelling",
    [["-np", "3"], ["-n", "3"], ["--nproc-per-node", "3"], ["-n", "3", "--nproc-per-node", "3"]],
)
def test_run_takes_mpirun_and_torchrun_spellings(
    spelling: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "x.py"
    script.write_text("pass\n")
    code, out, err = _dry_run(capsys, *spelling, str(script))
    assert code == 0, err
    assert "# 3 rank(s) on this host" in out
    assert out.count("RINGCOMM_WORLD_SIZE=3 ") == 3


def test_run_refuses_disagreeing_rank_counts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "x.py"
    script.write_text("pass\n")
    code, _, err = _dry_run(capsys, "-n", "2", "--nproc-per-node", "3", str(script))
    assert code == 2 and "disagree" in err


def test_run_options_end_at_the_script(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = tmp_path / "x.py"
    script.write_text("pass\n")
    code, out, _ = _dry_run(capsys, "-n", "2", str(script), "-n", "5", "--master-port", "1")
    assert code == 0 and out.count("x.py -n 5 --master-port 1\n") == 2
    code, out, _ = _dry_run(capsys, "-n", "2", "--", str(script), "--x")
    assert code == 0 and out.count("x.py --x\n") == 2
    with pytest.raises(SystemExit) as exit_info:  # no abbreviations of the launcher's options
        _dry_run(capsys, "--dry", str(script))
    assert exit_info.value.code == 2


# -- bench: nccl-tests' short flags ------------------------------------------------------------
def test_bench_takes_nccl_tests_short_flags() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(
        [
            "bench",
            "broadcast",
            "-n",
            "2",
            "-w",
            "3",
            "-c",
            "1",
            "-d",
            "float64",
            "-r",
            "1",
            "--iters",
            "7",
        ]
    )
    config = config_from_args(args)
    assert (config.warmup, config.check, config.dtype, config.root, config.iters) == (
        3,
        True,
        "float64",
        1,
        7,
    )
    args = parser.parse_args(["bench", "all_reduce", "-n", "2", "-o", "max", "-c", "0"])
    config = config_from_args(args)
    assert (config.redop, config.check) == ("max", False)


def test_bench_warns_when_n_is_far_beyond_the_cores() -> None:
    assert crowding_warning(4, 2) is None and crowding_warning(8, 2) is None
    text = crowding_warning(20, 2)
    assert text is not None and "-n 20 starts 20 ranks on 2 core(s)" in text and "--iters" in text


# -- small things ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command", ["run", "bench", "train", "ps-server", "trace", "model", "tune"]
)
def test_help_is_plain_text(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "-h"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for markup in ("``", ":mod:`", ":func:`", ":class:`", "DESIGN.md"):
        assert markup not in out, (command, markup)


def test_an_unknown_option_is_reported_against_the_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "all_reduce", "-n", "2", "--foo"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ringcomm bench ")
    assert err.rstrip().endswith("ringcomm bench: error: unrecognized arguments: --foo")


def test_train_ps_with_one_rank_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--strategy", "ps", "-n", "1"]) == 2
    assert "--strategy ps needs -n >= 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("new", "old"),
    [
        ("--timeout-s", "--timeout"),
        ("--checkpoint-interval", "--checkpoint-every"),
        ("--join-timeout-s", "--join-timeout"),
    ],
)
def test_ps_server_takes_train_spellings_and_keeps_the_old_ones(new: str, old: str) -> None:
    base = ["ps-server", "--coordinator", "h:1", "--index", "0", "--num-workers", "1"]
    parser = cli.build_parser()
    a = parser.parse_args([*base, new, "7"])
    b = parser.parse_args([*base, old, "7"])
    assert vars(a) == vars(b)
