"""``ringcomm tune --hostfile``: the probe across hosts (ringcomm.tuning.hosts) on pretend
hosts and on network-namespace hosts, the CPU pools from the ranks' reports, the usage
errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ringcomm import cli
from ringcomm.bench.multihost import MARK
from ringcomm.tuning import hosts as tune_hosts
from ringcomm.tuning.costmodel import CostModel, CpuModel, HostSample, LinkModel, predict_sample
from ringcomm.tuning.hosts import HostInfo, cpu_pools, fit, probe_specs, samples_from

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "tune_probe.py"
sys.path.insert(0, str(REPO / "benchmarks"))
import netns_hosts  # noqa: E402

MiB = 1 << 20


def _probe(hosts: list[int], check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_")}
    env.update(PYTHONPATH=str(REPO), RINGCOMM_TUNE_FILE="none")
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
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
        env=env,
    )
    if check:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.mark.timeout(200)
def test_the_probe_on_pretend_hosts_checks_every_probe_and_reports_one_machine() -> None:
    out = _probe([0, 0, 1, 1]).stdout
    per_rank: list[dict] = [{}] * 4
    infos = []
    for line in out.splitlines():
        if MARK in line:
            msg = json.loads(line.partition(MARK)[2])
            rep = msg["records"]
            per_rank[msg["rank"]] = rep
            infos.append(HostInfo(rep["host"], msg["hostname"], rep["boot_id"], rep["cores"]))
    assert all(per_rank) and len(infos) == 4, out
    assert sorted(i.host for i in infos) == [0, 0, 1, 1]
    samples, mins, wrong = samples_from(per_rank)
    assert wrong == 0  # every probe's first call was checked against the sum it must give
    assert [s.kind for s in samples] == ["cross", "cross", "host", "flat", "hier", "hier"]
    assert [s.segment_bytes for s in samples][-2:] == [256 << 10, 64 << 10]
    assert all(s.hosts == 2 and s.ranks_per_host == 2 for s in samples)
    assert all(0 < low <= s.time_s for s, low in zip(samples, mins, strict=True))
    # pretend hosts are one machine (one boot id): its cores are every host's
    cores, shared = cpu_pools(infos)
    assert shared == 0 and cores == min(i.cores for i in infos) >= 1
    result = fit(samples, infos, CostModel(), "pretend hosts")
    assert result.model.cpu is not None and result.model.cpu.shared_hosts == 0
    assert all(p > 0 for p in result.predicted_s)
    for s, p in zip(samples, result.predicted_s, strict=True):
        assert predict_sample(result.model, s) == pytest.approx(p)


@pytest.mark.timeout(120)
def test_the_probe_refuses_hosts_of_different_sizes() -> None:
    out = _probe([0, 0, 0, 1], check=False)
    assert out.returncode != 0
    assert "the same number" in out.stdout + out.stderr


def test_cpu_pools_from_boot_ids() -> None:
    def info(host: int, boot: str, cores: int = 4) -> HostInfo:
        return HostInfo(host, f"h{host}", boot, cores)

    # every host on one machine: its cores shared by all (0), the fewest any rank may use
    assert cpu_pools([info(0, "a", 2), info(0, "a", 2), info(1, "a", 1), info(1, "a", 2)]) == (
        1.0,
        0,
    )
    # hosts of their own
    assert cpu_pools([info(0, "a"), info(0, "a"), info(1, "b"), info(1, "b")]) == (4.0, 1)
    # two machines holding two hosts each
    assert cpu_pools([info(h, "ab"[h // 2]) for h in range(4)]) == (4.0, 2)
    with pytest.raises(ValueError):
        cpu_pools([])


def test_probe_specs_run_both_segment_sizes() -> None:
    specs = probe_specs(32 * MiB)
    assert {k for k, _, _ in specs} == {"cross", "host", "flat", "hier"}
    assert [g for k, _, g in specs if k == "hier"] == [8 * MiB, 1 * MiB]


@pytest.mark.parametrize(
    "extra",
    [
        ["-H", "a:2,b:1"],  # hosts of different sizes
        ["-H", "a:1,b:1"],  # one rank per host: no host steps to probe
        ["-H", "a:2"],  # one host
        ["-H", "a:2,b:2", "--net-gbps", "1"],  # the network is measured across hosts
        ["-H", "a:2,b:2", "--size", "4K"],
        ["--size", "4M"],  # across-host options without hosts
        ["--ssh-config", "x"],
    ],
)
def test_tune_across_hosts_usage_errors_exit_2(extra: list[str], tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    assert cli.main(["tune", "--out", str(out), *extra]) == 2
    assert not out.exists()


def test_tune_across_hosts_prints_the_fit_and_writes_a_version_2_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's side of the probe (ssh replaced by reports a known model makes)."""
    truth = CostModel(
        net=LinkModel.from_rate(10.0, 60.0),
        cpu=CpuModel(0.6e-9, 0.4e-9, 0.3e-9, 2e-3, 2.0, 0, 0.25e-9),
    )
    seen = {}

    def fake_run_probe(hosts, size, iters, warmup, timeout_s):  # type: ignore[no-untyped-def]
        seen.update(hosts=hosts.describe(), size=size, iters=iters, timeout_s=timeout_s)
        records = []
        for kind, nbytes, seg in probe_specs(size):
            t = predict_sample(truth, HostSample(kind, 2, 2, nbytes, 1.0, seg))
            records.append(
                {
                    "kind": kind,
                    "size": nbytes,
                    "segment": seg,
                    "times_s": [t, t * 1.01, t * 0.99],
                    "errors": 0,
                }
            )
        per_rank = [
            {
                "host": r // 2,
                "hosts": 2,
                "ranks_per_host": 2,
                "boot_id": "one",
                "cores": 2,
                "records": records,
            }
            for r in range(4)
        ]
        return per_rank, [HostInfo(r // 2, f"h{r // 2}", "one", 2) for r in range(4)]

    monkeypatch.setattr(tune_hosts, "run_probe", fake_run_probe)
    out = tmp_path / "bed.json"
    assert cli.main(["tune", "-H", "h0:2,h1:2", "--out", str(out), "--iters", "3"]) == 0
    text = capsys.readouterr().out
    assert seen == {"hosts": "h0:2, h1:2", "size": 32 * MiB, "iters": 3, "timeout_s": 300.0}
    assert "2 hosts on 1 machine(s)" in text and "shared by the ranks of every host" in text
    assert len(re.findall(r"^(cross|host|flat|hier) ", text, re.MULTILINE)) == 6, text
    assert "# predicted: flat all_reduce of 64M on 2 x 2" in text
    model = CostModel.load(out)
    assert json.loads(out.read_text())["version"] == 2
    assert model.cpu is not None and model.cpu.cores == 2.0 and model.cpu.shared_hosts == 0
    assert "ringcomm tune --hostfile on h0:2, h1:2" in model.source
    for kind in ("flat", "hier"):
        sample = HostSample(kind, 2, 2, 64 * MiB, 1.0, 8 * MiB)
        assert predict_sample(model, sample) == pytest.approx(
            predict_sample(truth, sample), rel=0.05
        )


@pytest.mark.needs_ssh
@pytest.mark.timeout(400)
def test_tune_across_two_netns_hosts_writes_a_model_with_a_cpu_term(tmp_path: Path) -> None:
    why = netns_hosts.unavailable()
    if why is not None:
        pytest.skip(f"network-namespace hosts: {why}")
    prefix = "rctune"
    bed = netns_hosts.start(hosts=2, rate="1gbit", prefix=prefix, slots=2, subnet="10.74.0")
    try:
        model_file = tmp_path / "bed.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_")}
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "ringcomm",
                "tune",
                "--hostfile",
                str(bed.hostfile),
                "--ssh-config",
                str(bed.ssh_config),
                "--size",
                "2M",
                "--iters",
                "2",
                "--warmup",
                "1",
                "--out",
                str(model_file),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            env={**env, "PYTHONPATH": str(REPO)},
        )
    finally:
        netns_hosts.stop(prefix)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "2 hosts on 1 machine(s)" in text, text
    assert len(re.findall(r"^(cross|host|flat|hier) ", out.stdout, re.MULTILINE)) == 6, text
    model = CostModel.load(model_file)
    assert model.cpu is not None and model.cpu.shared_hosts == 0
    # a 1 Gbit/s link (tbf counts frames: a little less payload): the fit sees it
    assert 0.5 < model.net.gbps < 1.5, model.describe()
