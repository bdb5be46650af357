"""ringcomm.config: resolve_init_config, the settings that belong to no group, parse_size,
parse_slurm_nodelist: pure, every case through env= dicts (a few CLI cases at the end)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.config import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STAGING_MAX_BYTES,
    DEFAULT_TIMEOUT_S,
    InitConfig,
    TorchAgentStore,
    UsageError,
    bind_mode,
    binds_to_core,
    default_of,
    env_master_addr,
    env_token,
    format_size,
    mpirun_job_id,
    mpirun_master_port,
    parse_size,
    parse_slurm_nodelist,
    ps_log_level,
    resolve_init_config,
    slurm_master_port,
    staging_max_bytes,
)
from ringcomm.errors import RendezvousError

pytestmark = pytest.mark.timeout(60)

TORCHRUN = {
    "RANK": "2",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
RINGCOMM = {
    "RINGCOMM_RANK": "3",
    "RINGCOMM_WORLD_SIZE": "8",
    "RINGCOMM_MASTER_ADDR": "10.0.0.9",
    "RINGCOMM_MASTER_PORT": "31000",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "6",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
}
PMI = {"PMI_RANK": "1", "PMI_SIZE": "3"}
SLURM = {
    "SLURM_PROCID": "7",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "3",
    "SLURM_JOB_NODELIST": "gpu[003-004,010],login1",
    "SLURM_JOB_ID": "4242",
}


# -- singleton and each convention ---------------------------------------------------------


def test_nothing_set_is_a_singleton() -> None:
    cfg = resolve_init_config(env={})
    assert cfg == InitConfig(
        rank=0,
        world_size=1,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=0,
        timeout_s=DEFAULT_TIMEOUT_S,
        token=None,
        chunk_bytes=None,
        algo=None,
        log=None,
        store_external=False,
        source="singleton",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rank = 1  # type: ignore[misc]


def test_explicit_arguments() -> None:
    cfg = resolve_init_config(
        1, 2, master_addr="h", master_port=1234, timeout_s=5, token="tok", env={}
    )
    assert (cfg.rank, cfg.world_size, cfg.master_addr, cfg.master_port) == (1, 2, "h", 1234)
    assert (cfg.timeout_s, cfg.token, cfg.source) == (5.0, "tok", "explicit")


def test_ringcomm_variables() -> None:
    cfg = resolve_init_config(env={**RINGCOMM, "RINGCOMM_LOCAL_RANK": "2"})
    assert (cfg.rank, cfg.world_size, cfg.local_rank) == (3, 8, 2)
    assert (cfg.master_addr, cfg.master_port, cfg.source) == ("10.0.0.9", 31000, "ringcomm")


def test_torchrun_variables() -> None:
    cfg = resolve_init_config(env=TORCHRUN)
    assert (cfg.rank, cfg.world_size, cfg.local_rank) == (2, 4, 1)
    assert (cfg.master_addr, cfg.master_port, cfg.source) == ("10.0.0.1", 29500, "torchrun")


@pytest.mark.parametrize("flag", ["True", "1", "true"])
def test_torchrun_agent_store_means_a_port_from_the_os(flag: str) -> None:
    # MASTER_PORT is the agent's TCPStore: rank 0 serves ours on a port from the OS and
    # publishes it there (no guessed port next to torch's: no collision).
    env = {
        **TORCHRUN,
        "TORCHELASTIC_USE_AGENT_STORE": flag,
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    cfg = resolve_init_config(env=env)
    assert cfg.master_port == 0
    assert cfg.torch_store == TorchAgentStore("10.0.0.1", 29500, "ringcomm/job7/attempt_2")


@pytest.mark.parametrize("flag", ["False", "0", ""])
def test_torchrun_without_agent_store_keeps_port(flag: str) -> None:
    cfg = resolve_init_config(env={**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": flag})
    assert cfg.master_port == 29500


def test_agent_store_does_not_shift_a_ringcomm_port() -> None:
    env = {**TORCHRUN, "RINGCOMM_MASTER_PORT": "31000", "TORCHELASTIC_USE_AGENT_STORE": "1"}
    assert resolve_init_config(env=env).master_port == 31000


def test_agent_store_port_out_of_range_is_rejected() -> None:
    env = {**TORCHRUN, "MASTER_PORT": "65536", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(RendezvousError, match="65536"):
        resolve_init_config(env=env)


def test_a_world_size_by_hand_that_disagrees_with_the_launcher_is_refused() -> None:
    # Every rank would wait for a rank never started: refused at once, naming both values.
    with pytest.raises(RendezvousError, match=r"world_size=3 .*WORLD_SIZE=4"):
        resolve_init_config(world_size=3, env=TORCHRUN)
    with pytest.raises(RendezvousError, match=r"world_size=9 .*RINGCOMM_WORLD_SIZE=8"):
        resolve_init_config(world_size=9, env=RINGCOMM)
    # The same size, a world of one, or a store of one's own: the caller's business.
    assert resolve_init_config(world_size=4, env=TORCHRUN).world_size == 4
    assert resolve_init_config(0, 1, env=TORCHRUN).world_size == 1
    cfg = resolve_init_config(1, 3, master_port=4000, env=TORCHRUN)
    assert (cfg.world_size, cfg.master_port) == (3, 4000)


def test_mpirun_variables() -> None:
    env = {**OMPI, "MASTER_ADDR": "head", "MASTER_PORT": "4000"}  # as `mpirun -x` exports
    cfg = resolve_init_config(env=env)
    assert (cfg.rank, cfg.world_size, cfg.local_rank, cfg.source) == (5, 6, 1, "mpirun")
    assert (cfg.master_addr, cfg.master_port) == ("head", 4000)


def test_mpirun_without_master_port_is_an_error() -> None:
    with pytest.raises(RendezvousError, match="MASTER_PORT"):
        resolve_init_config(env=OMPI)


# What `mpirun --allow-run-as-root -np 2 env` shows under Open MPI 4.1 on one host.
OMPI_LOCAL = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_MCA_ess_base_jobid": "1243938817",
    "PMIX_NAMESPACE": "1243938817",
}


def test_mpirun_on_one_host_derives_address_and_port() -> None:
    cfg = resolve_init_config(env=OMPI_LOCAL)
    assert (cfg.rank, cfg.world_size, cfg.local_rank, cfg.source) == (1, 2, 1, "mpirun")
    assert (cfg.master_addr, cfg.master_port) == ("127.0.0.1", 64940)
    assert cfg.master_port == mpirun_master_port("1243938817")
    assert cfg.master_port_origin == "derived from Open MPI's job id (PMIX_NAMESPACE=1243938817)"
    rank0 = resolve_init_config(env={**OMPI_LOCAL, "OMPI_COMM_WORLD_RANK": "0"})
    assert (rank0.master_addr, rank0.master_port) == (cfg.master_addr, cfg.master_port)


@pytest.mark.parametrize(
    ("names", "winner"),
    [
        (("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"), 0),
        (("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"), 0),
        (("OMPI_MCA_orte_ess_jobid",), 0),
        (("PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid"), 0),
    ],
)
def test_mpirun_job_id_order(names: tuple[str, ...], winner: int) -> None:
    env = {name: f"job-{name}" for name in names}
    assert mpirun_job_id(env) == (names[winner], f"job-{names[winner]}")


def test_mpirun_job_id_none_and_blank() -> None:
    assert mpirun_job_id({}) is None
    assert mpirun_job_id({"PMIX_NAMESPACE": " ", "OMPI_MCA_ess_base_jobid": "7"}) == (
        "OMPI_MCA_ess_base_jobid",
        "7",
    )


@pytest.mark.parametrize(
    "job_id", ["0", "1", "1243938817", "prterun-vm-12345@1", "x" * 200, "4294967295"]
)
def test_mpirun_port_range_and_stability(job_id: str) -> None:
    port = mpirun_master_port(job_id)
    assert 61000 <= port <= 65535  # above Linux's default ephemeral range
    assert port == mpirun_master_port(job_id)


def test_mpirun_port_is_the_same_in_another_process() -> None:
    # zlib.crc32, not hash(): PYTHONHASHSEED differs between processes
    code = "from ringcomm.config import mpirun_master_port as p; print(p('prterun-vm-1@1'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout) == mpirun_master_port("prterun-vm-1@1")


def test_mpirun_given_master_wins_over_derivation() -> None:
    cfg = resolve_init_config(env={**OMPI_LOCAL, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (cfg.master_addr, cfg.master_port, cfg.master_port_origin) == ("head", 4000, None)
    cfg = resolve_init_config(env={**OMPI_LOCAL, "MASTER_ADDR": "10.1.2.3"})
    assert (cfg.master_addr, cfg.master_port) == ("10.1.2.3", 64940)
    cfg = resolve_init_config(env={**OMPI_LOCAL, "RINGCOMM_MASTER_PORT": "5000"})
    assert (cfg.master_addr, cfg.master_port) == ("127.0.0.1", 5000)


def test_mpirun_across_hosts_keeps_the_master_error() -> None:
    env = {**OMPI_LOCAL, "OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(RendezvousError) as info:
        resolve_init_config(env=env)
    text = str(info.value)
    assert "no store port to meet at" in text and "MASTER_PORT" in text
    assert "span hosts (OMPI_COMM_WORLD_LOCAL_SIZE=2, OMPI_COMM_WORLD_SIZE=4)" in text
    assert "mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port>" in text


def test_mpirun_without_local_size_or_job_id_is_an_error() -> None:
    env = {k: v for k, v in OMPI_LOCAL.items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"}
    with pytest.raises(RendezvousError, match="Without OMPI_COMM_WORLD_LOCAL_SIZE"):
        resolve_init_config(env=env)
    env = {k: v for k, v in OMPI_LOCAL.items() if "JOB" not in k.upper() and "PMIX" not in k}
    with pytest.raises(RendezvousError, match="PMIX_NAMESPACE, OMPI_MCA_ess_base_jobid"):
        resolve_init_config(env=env)


def test_mpirun_singleton_needs_no_port() -> None:
    env = {
        **OMPI_LOCAL,
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    }
    cfg = resolve_init_config(env=env)
    assert (cfg.world_size, cfg.master_port, cfg.master_port_origin) == (1, 0, None)


def test_slurm_port_origin() -> None:
    assert resolve_init_config(env=SLURM).master_port_origin == (
        "derived from the Slurm job id (SLURM_JOB_ID=4242)"
    )


def test_pmi_variables() -> None:
    cfg = resolve_init_config(env={**PMI, "MASTER_PORT": "4000"})
    assert (cfg.rank, cfg.world_size, cfg.local_rank, cfg.source) == (1, 3, 0, "pmi")
    assert cfg.master_addr == "127.0.0.1"  # world > 1 without an address: loopback
    cfg = resolve_init_config(env={**PMI, "MASTER_PORT": "4000", "MPI_LOCALRANKID": "2"})
    assert cfg.local_rank == 2


def test_slurm_variables_derive_address_and_port() -> None:
    cfg = resolve_init_config(env=SLURM)
    assert (cfg.rank, cfg.world_size, cfg.local_rank, cfg.source) == (7, 16, 3, "slurm")
    assert cfg.master_addr == "gpu003"
    assert cfg.master_port == 20000 + 4242 % 40000 == slurm_master_port(4242)


def test_slurm_explicit_master_wins_over_derivation() -> None:
    env = {**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4000"}
    cfg = resolve_init_config(env=env)
    assert (cfg.master_addr, cfg.master_port) == ("head", 4000)
    cfg = resolve_init_config(env={**SLURM, "MASTER_ADDR": "head"})
    assert (cfg.master_addr, cfg.master_port) == ("head", slurm_master_port(4242))


def test_slurm_without_job_id_has_no_port() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}
    with pytest.raises(RendezvousError, match="MASTER_PORT"):
        resolve_init_config(env=env)


@pytest.mark.parametrize("job_id", [0, 1, 39999, 40000, 123456789])
def test_slurm_port_range(job_id: int) -> None:
    assert 20000 <= slurm_master_port(job_id) <= 59999


def test_empty_values_count_as_unset() -> None:
    cfg = resolve_init_config(
        env={
            "RINGCOMM_RANK": "",
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_PORT": "5000",
            "RINGCOMM_TOKEN": "",
        }
    )
    assert (cfg.rank, cfg.source, cfg.token) == (1, "torchrun", None)


# -- precedence ----------------------------------------------------------------------------

PRECEDENCE = [
    (RINGCOMM, "ringcomm", 3),
    (TORCHRUN, "torchrun", 2),
    (OMPI, "mpirun", 5),
    (PMI, "pmi", 1),
    (SLURM, "slurm", 7),
]


@pytest.mark.parametrize("winner", range(len(PRECEDENCE)))
def test_precedence_order(winner: int) -> None:
    env: dict[str, str] = {"MASTER_PORT": "4000"}
    for conv_env, _, _ in PRECEDENCE[winner:]:
        env.update(conv_env)
    _, source, rank = PRECEDENCE[winner]
    cfg = resolve_init_config(env=env)
    assert (cfg.source, cfg.rank) == (source, rank)


def test_explicit_beats_every_variable() -> None:
    env = {**RINGCOMM, **TORCHRUN, **OMPI, **PMI, **SLURM}
    cfg = resolve_init_config(0, 1, master_addr="me", master_port=7, env=env)
    assert (cfg.rank, cfg.world_size, cfg.master_addr, cfg.master_port) == (0, 1, "me", 7)
    assert cfg.source == "explicit"


def test_each_variable_resolves_separately() -> None:
    # rank from RINGCOMM_*, world size from torchrun, port from torchrun's MASTER_PORT.
    env = {"RINGCOMM_RANK": "1", "WORLD_SIZE": "3", "MASTER_PORT": "5000", "LOCAL_RANK": "1"}
    cfg = resolve_init_config(env=env)
    assert (cfg.rank, cfg.world_size, cfg.master_port, cfg.local_rank) == (1, 3, 5000, 1)
    assert cfg.source == "ringcomm"


def test_ringcomm_local_rank_beats_torchrun() -> None:
    env = {**TORCHRUN, "RINGCOMM_LOCAL_RANK": "3"}
    assert resolve_init_config(env=env).local_rank == 3


# -- tunables ------------------------------------------------------------------------------


def test_tunables_from_environment() -> None:
    env = {
        "RINGCOMM_TIMEOUT_S": "12.5",
        "RINGCOMM_TOKEN": "s3cret",
        "RINGCOMM_CHUNK_BYTES": "4M",
        "RINGCOMM_ALGO": "ring",
        "RINGCOMM_LOG": "debug",
        "RINGCOMM_STORE_EXTERNAL": "1",
    }
    cfg = resolve_init_config(env=env)
    assert cfg.timeout_s == 12.5
    assert cfg.token == "s3cret"
    assert cfg.chunk_bytes == 4 << 20
    assert (cfg.algo, cfg.log, cfg.store_external) == ("ring", "debug", True)


def test_explicit_timeout_and_token_win() -> None:
    env = {"RINGCOMM_TIMEOUT_S": "12.5", "RINGCOMM_TOKEN": "env"}
    cfg = resolve_init_config(timeout_s=3, token="arg", env=env)
    assert (cfg.timeout_s, cfg.token) == (3.0, "arg")


@pytest.mark.parametrize(
    ("env_value", "host_store", "expected"),
    [
        (None, None, False),
        ("1", None, True),
        ("true", None, True),
        ("0", None, False),
        ("1", True, False),
        ("0", False, True),
        (None, False, True),
    ],
)
def test_store_external(env_value: str | None, host_store: bool | None, expected: bool) -> None:
    env = {} if env_value is None else {"RINGCOMM_STORE_EXTERNAL": env_value}
    assert resolve_init_config(host_store=host_store, env=env).store_external is expected


# -- validation errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "env", "pattern"),
    [
        (
            {},
            {**TORCHRUN, "RANK": "5", "WORLD_SIZE": "4"},
            r"RANK=5 >= WORLD_SIZE=4 \(from torchrun variables\)",
        ),
        ({}, {**TORCHRUN, "RANK": "-1"}, r"RANK=-1 must be >= 0 \(from torchrun variables\)"),
        ({}, {**TORCHRUN, "WORLD_SIZE": "0"}, r"WORLD_SIZE=0 must be >= 1"),
        ({}, {**TORCHRUN, "RANK": "two"}, r"RANK='two' is not an integer"),
        (
            {},
            {**OMPI, "OMPI_COMM_WORLD_RANK": "6", "MASTER_PORT": "1"},
            r"OMPI_COMM_WORLD_RANK=6 >= OMPI_COMM_WORLD_SIZE=6 \(from mpirun variables\)",
        ),
        (
            {"rank": 4},
            {"WORLD_SIZE": "4", "MASTER_PORT": "1"},
            r"rank=4 >= WORLD_SIZE=4 \(rank from explicit argument, WORLD_SIZE from torchrun",
        ),
        ({"rank": 2}, {}, r"rank=2 >= world size 1"),
        ({"world_size": 3, "master_port": 1}, {}, r"no rank is set"),
        ({}, {**TORCHRUN, "LOCAL_RANK": "-2"}, r"LOCAL_RANK=-2 must be >= 0"),
        ({}, {**TORCHRUN, "MASTER_PORT": "65536"}, r"MASTER_PORT=65536 is not in 0..65535"),
        ({}, {**TORCHRUN, "MASTER_PORT": "-1"}, r"MASTER_PORT=-1 is not in 0..65535"),
        ({"master_port": 70000}, {}, r"master_port=70000 is not in 0..65535"),
        ({}, {**TORCHRUN, "MASTER_PORT": "http"}, r"MASTER_PORT='http' is not an integer"),
        ({}, {"RANK": "0", "WORLD_SIZE": "2"}, r"world_size=2 .*MASTER_PORT"),
        ({"rank": 0, "world_size": 2, "master_port": 0}, {}, r"master_port=0"),
        ({}, {"RINGCOMM_TIMEOUT_S": "0"}, r"RINGCOMM_TIMEOUT_S=0 must be .* > 0"),
        ({}, {"RINGCOMM_TIMEOUT_S": "-3"}, r"RINGCOMM_TIMEOUT_S=-3"),
        ({}, {"RINGCOMM_TIMEOUT_S": "nan"}, r"RINGCOMM_TIMEOUT_S=nan"),
        ({}, {"RINGCOMM_TIMEOUT_S": "soon"}, r"RINGCOMM_TIMEOUT_S=soon is not a number"),
        ({"timeout_s": 0}, {}, r"timeout_s=0 must be"),
        ({}, {"RINGCOMM_CHUNK_BYTES": "0"}, r"RINGCOMM_CHUNK_BYTES=0 must be > 0"),
        ({}, {"RINGCOMM_CHUNK_BYTES": "1.5M"}, r"RINGCOMM_CHUNK_BYTES=1.5M: invalid size"),
        ({}, {"RINGCOMM_STORE_EXTERNAL": "maybe"}, r"RINGCOMM_STORE_EXTERNAL=maybe"),
        ({"rank": 1.0, "world_size": 2, "master_port": 1}, {}, r"rank=1.0 is not an integer"),
        ({}, {**SLURM, "SLURM_JOB_ID": "abc"}, r"SLURM_JOB_ID='abc'"),
        ({}, {**SLURM, "SLURM_JOB_NODELIST": "gpu[1-"}, r"SLURM_JOB_NODELIST"),
    ],
)
def test_validation_errors(kwargs: dict[str, object], env: dict[str, str], pattern: str) -> None:
    with pytest.raises(RendezvousError, match=pattern):
        resolve_init_config(**kwargs, env=env)  # type: ignore[arg-type]


# -- parse_size ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8", 8),
        ("0", 0),
        ("64M", 64 << 20),
        ("64m", 64 << 20),
        ("4K", 4096),
        ("4k", 4096),
        ("1G", 1 << 30),
        ("2g", 2 << 30),
        (" 16 M ", 16 << 20),
        ("4KB", 4096),
        ("4KiB", 4096),
        ("8B", 8),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "1.5K", "-4", "+4", "4T", "K", "64 MB extra", "0x10", "4KK"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


@given(st.integers(min_value=0, max_value=1 << 40), st.sampled_from(["", "K", "M", "G"]))
def test_parse_size_roundtrip(n: int, suffix: str) -> None:
    shift = {"": 0, "K": 10, "M": 20, "G": 30}[suffix]
    assert parse_size(f"{n}{suffix}") == n << shift
    assert parse_size(f"{n}{suffix.lower()}") == n << shift


# -- parse_slurm_nodelist ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("node1", ["node1"]),
        ("node1,node2", ["node1", "node2"]),
        (
            "node[01-03,07],gpu5,a[1-2]b",
            ["node01", "node02", "node03", "node07", "gpu5", "a1b", "a2b"],
        ),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("n[5]", ["n5"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("c[1-2],d[3,5-6]", ["c1", "c2", "d3", "d5", "d6"]),
        ("rack-1-node[1-2]", ["rack-1-node1", "rack-1-node2"]),
        ("", []),
    ],
)
def test_parse_slurm_nodelist(text: str, expected: list[str]) -> None:
    assert parse_slurm_nodelist(text) == expected


@pytest.mark.parametrize("text", ["node[1-", "node1]", "n[[1]]", "n[3-1]", "n[a-b]", "n[1-2-3]"])
def test_parse_slurm_nodelist_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid Slurm host list"):
        parse_slurm_nodelist(text)


# -- transport mode ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "env", "expected"),
    [
        ({}, {}, "auto"),
        ({}, {"RINGCOMM_TRANSPORT": "tcp"}, "tcp"),
        ({}, {"RINGCOMM_TRANSPORT": " ipc "}, "ipc"),
        ({}, {"RINGCOMM_TRANSPORT": ""}, "auto"),
        ({"transport": "ipc"}, {"RINGCOMM_TRANSPORT": "tcp"}, "ipc"),
        ({"transport": ""}, {"RINGCOMM_TRANSPORT": "tcp"}, "tcp"),  # "" means not given
    ],
)
def test_transport_mode(kwargs: dict[str, str], env: dict[str, str], expected: str) -> None:
    assert resolve_init_config(**kwargs, env=env).transport == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "env", "pattern"),
    [
        ({}, {"RINGCOMM_TRANSPORT": "udp"}, r"RINGCOMM_TRANSPORT must be one of .*'udp'"),
        ({"transport": "shm"}, {}, r"^transport= \(as RINGCOMM_TRANSPORT\) must be one of .*'shm'"),
    ],
)
def test_transport_mode_rejects(kwargs: dict[str, str], env: dict[str, str], pattern: str) -> None:
    with pytest.raises(RendezvousError, match=pattern):
        resolve_init_config(**kwargs, env=env)  # type: ignore[arg-type]


def test_endpoints_take_the_modes_from_config() -> None:
    from ringcomm import config
    from ringcomm.transport import endpoints

    assert endpoints.TRANSPORT_MODES is config.TRANSPORT_MODES == ("auto", "ipc", "tcp")


# -- chunk_bytes -----------------------------------------------------------------------------


def test_chunk_bytes_default_is_4_mib() -> None:
    from ringcomm import group

    cfg = resolve_init_config(env={})
    assert cfg.chunk_bytes is None and cfg.effective_chunk_bytes == 4 << 20
    assert DEFAULT_CHUNK_BYTES == group.DEFAULT_CHUNK_BYTES == 4 << 20
    assert "4 MiB" in (group.init_process_group.__doc__ or "")


@pytest.mark.parametrize(
    ("kwargs", "env", "expected"),
    [
        ({}, {"RINGCOMM_CHUNK_BYTES": "64K"}, 64 << 10),
        ({}, {"RINGCOMM_CHUNK_BYTES": "1m"}, 1 << 20),
        ({}, {"RINGCOMM_CHUNK_BYTES": "1G"}, 1 << 30),
        ({}, {"RINGCOMM_CHUNK_BYTES": "4096"}, 4096),
        ({"chunk_bytes": 512}, {}, 512),
        ({"chunk_bytes": 512}, {"RINGCOMM_CHUNK_BYTES": "1M"}, 512),  # the argument wins
    ],
)
def test_chunk_bytes(kwargs: dict[str, int], env: dict[str, str], expected: int) -> None:
    cfg = resolve_init_config(**kwargs, env=env)  # type: ignore[arg-type]
    assert cfg.chunk_bytes == cfg.effective_chunk_bytes == expected


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "1M"])
def test_chunk_bytes_argument_must_be_a_positive_int(value: object) -> None:
    # 0 used to mean "the default" silently; now it is an error naming the argument,
    # even when RINGCOMM_CHUNK_BYTES is set.
    with pytest.raises(ValueError, match=r"chunk_bytes=.* must be an int > 0"):
        resolve_init_config(chunk_bytes=value, env={"RINGCOMM_CHUNK_BYTES": "1M"})  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["0", "0K", "-1", "1.5M", "big"])
def test_chunk_bytes_variable_rejects(text: str) -> None:
    with pytest.raises(RendezvousError, match=rf"RINGCOMM_CHUNK_BYTES={text}"):
        resolve_init_config(env={"RINGCOMM_CHUNK_BYTES": text})


@pytest.mark.parametrize("text", ["0", "0K", "-1", "1.5M", "big"])
def test_tune_reads_chunk_bytes_as_the_group_does(text: str) -> None:
    # ringcomm tune's reading (config.env_chunk_bytes) refuses what a group refuses, in
    # the same words, and takes what a group takes, blanks around it included.
    from ringcomm.config import env_chunk_bytes

    env = {"RINGCOMM_CHUNK_BYTES": text}
    with pytest.raises(RendezvousError) as by_group:
        resolve_init_config(env=env)
    with pytest.raises(ValueError) as by_tune:
        env_chunk_bytes(env)
    assert str(by_tune.value) == str(by_group.value)
    assert env_chunk_bytes({"RINGCOMM_CHUNK_BYTES": " 64K "}) == 64 << 10
    assert resolve_init_config(env={"RINGCOMM_CHUNK_BYTES": " 64K "}).chunk_bytes == 64 << 10
    assert env_chunk_bytes({"RINGCOMM_CHUNK_BYTES": "  "}) == DEFAULT_CHUNK_BYTES
    assert env_chunk_bytes({}) == DEFAULT_CHUNK_BYTES


def test_security_mode_blank_is_unset() -> None:
    from ringcomm.config import security_mode

    assert security_mode({"RINGCOMM_SECURITY": "  "}) == "handshake"
    assert security_mode({"RINGCOMM_SECURITY": " CURVE "}) == "curve"
    with pytest.raises(ValueError, match="RINGCOMM_SECURITY must be one of"):
        security_mode({"RINGCOMM_SECURITY": "tls"})


def test_init_process_group_refuses_chunk_bytes_0() -> None:
    import ringcomm as rc

    with pytest.raises(ValueError, match="chunk_bytes=0 must be an int > 0"):
        rc.init_process_group(0, 1, master_port=0, chunk_bytes=0, env={})


def test_init_process_group_hands_settings_to_the_engine() -> None:
    import ringcomm as rc

    env = {
        "RINGCOMM_MAX_UNEXPECTED_MESSAGES": "7",
        "RINGCOMM_MAX_UNEXPECTED_BYTES": "2K",
        "RINGCOMM_CHUNK_BYTES": "64K",
    }
    with rc.init_process_group(0, 1, master_port=0, env=env) as pg:
        assert (
            pg.core.progress.max_unexpected_messages,
            pg.core.progress.max_unexpected_bytes,
        ) == (7, 2048)
        assert pg.core.progress.log_ops is False
        assert pg.chunk_bytes == 64 << 10
        sub = pg.new_group([0])
        assert sub is not None and sub.chunk_bytes == 64 << 10
    with rc.init_process_group(0, 1, master_port=0, chunk_bytes=1000, timeout_s=7, env={}) as pg:
        from ringcomm.core.progress import MAX_UNEXPECTED_BYTES, MAX_UNEXPECTED_MESSAGES

        assert pg.core.progress.max_unexpected_messages == MAX_UNEXPECTED_MESSAGES
        assert pg.core.progress.max_unexpected_bytes == MAX_UNEXPECTED_BYTES
        pg.chunk_bytes = 2000  # still a tunable attribute; sub-groups inherit it
        sub = pg.new_group([0])
        assert sub is not None and (sub.chunk_bytes, sub.timeout_s) == (2000, 7.0)


def test_log_debug() -> None:
    assert resolve_init_config(env={}).log_debug is False
    assert resolve_init_config(env={"RINGCOMM_LOG": "DEBUG"}).log_debug is True
    assert resolve_init_config(env={"RINGCOMM_LOG": "info"}).log_debug is False
    assert resolve_init_config(env={"RINGCOMM_LOG": "info"}).log_info is True
    assert resolve_init_config(env={"RINGCOMM_LOG": "debug"}).log_info is True
    assert resolve_init_config(env={"RINGCOMM_LOG": "Off"}).log is None


@pytest.mark.parametrize("value", ["loud", "1", "warning"])
def test_an_invalid_log_level_raises_naming_it(value: str) -> None:
    with pytest.raises(RendezvousError, match=f"RINGCOMM_LOG='{value}' is not a level: use one of"):
        resolve_init_config(env={"RINGCOMM_LOG": value})


def test_log_info_logs_the_group_summary_once_on_rank_0(caplog: pytest.LogCaptureFixture) -> None:
    import ringcomm as rc

    # A world of one: no sockets to peers, but the whole summary (rank 0 logs it; on
    # stderr unless the application set up logging, as pytest does).
    with (
        caplog.at_level("INFO", logger="ringcomm"),
        rc.init_process_group(0, 1, env={"RINGCOMM_LOG": "info"}) as pg,
    ):
        assert pg.world_size == 1
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text.count("ringcomm: rank 0 of 1 (1 host), group pg") == 1, text
    for words in ("collectives:", "algorithms:", "pieces of 4M bytes", "token on"):
        assert words in text, text


# -- staging pool bound ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, DEFAULT_STAGING_MAX_BYTES),
        ({"RINGCOMM_STAGING_MAX_BYTES": ""}, DEFAULT_STAGING_MAX_BYTES),
        ({"RINGCOMM_STAGING_MAX_BYTES": "1048576"}, 1 << 20),
        ({"RINGCOMM_STAGING_MAX_BYTES": "64K"}, 64 << 10),
        ({"RINGCOMM_STAGING_MAX_BYTES": "16m"}, 16 << 20),
        ({"RINGCOMM_STAGING_MAX_BYTES": "2G"}, 2 << 30),
        ({"RINGCOMM_STAGING_MAX_BYTES": "0"}, 0),  # as before: one buffer at a time
    ],
)
def test_staging_max_bytes(env: dict[str, str], expected: int) -> None:
    assert DEFAULT_STAGING_MAX_BYTES == 1 << 30
    assert staging_max_bytes(env) == expected


@pytest.mark.parametrize("text", ["1.5G", "-1", "lots", "4T"])
def test_staging_max_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=rf"RINGCOMM_STAGING_MAX_BYTES={text}: invalid size"):
        staging_max_bytes({"RINGCOMM_STAGING_MAX_BYTES": text})


def test_staging_backend_takes_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringcomm.device.staging import HostStandinBackend

    monkeypatch.setenv("RINGCOMM_STAGING_MAX_BYTES", "8M")
    assert HostStandinBackend().pool.max_bytes == 8 << 20
    assert HostStandinBackend(max_staging_bytes=4096).pool.max_bytes == 4096
    monkeypatch.setenv("RINGCOMM_STAGING_MAX_BYTES", "8 units")
    with pytest.raises(ValueError, match="RINGCOMM_STAGING_MAX_BYTES"):
        HostStandinBackend()


# -- core binding ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "auto"),
        ({"RINGCOMM_BIND": ""}, "auto"),
        ({"RINGCOMM_BIND": "Core"}, "core"),
        ({"RINGCOMM_BIND": " none "}, "none"),
    ],
)
def test_bind_mode(env: dict[str, str], expected: str) -> None:
    assert bind_mode(env) == expected
    assert resolve_init_config(env=env).bind == expected


def test_bind_mode_rejects() -> None:
    with pytest.raises(ValueError, match=r"RINGCOMM_BIND must be one of .*'socket'"):
        bind_mode({"RINGCOMM_BIND": "socket"})
    with pytest.raises(RendezvousError, match="RINGCOMM_BIND"):
        resolve_init_config(env={"RINGCOMM_BIND": "socket"})


@pytest.mark.parametrize(
    ("bind", "local_world_size", "ncores", "expected"),
    [
        ("core", None, 4, True),
        ("core", 1, 4, True),
        ("none", 8, 2, False),
        ("auto", 8, 2, True),
        ("auto", 2, 2, False),
        ("auto", 1, 2, False),
        ("auto", None, 1, False),  # ranks on the host unknown: leave it to the OS
    ],
)
def test_binds_to_core(
    bind: str, local_world_size: int | None, ncores: int, expected: bool
) -> None:
    assert binds_to_core(bind, local_world_size, ncores) is expected


def test_binds_to_core_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError, match="bind must be one of"):
        binds_to_core("socket", 2, 1)


# -- ps-server log level, token, master address ----------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "WARNING"),
        ({"RINGCOMM_PS_LOG": ""}, "WARNING"),
        ({"RINGCOMM_PS_LOG": "debug"}, "DEBUG"),
        ({"RINGCOMM_PS_LOG": "Info"}, "INFO"),
        ({"RINGCOMM_PS_LOG": "ERROR"}, "ERROR"),
    ],
)
def test_ps_log_level(env: dict[str, str], expected: str) -> None:
    assert ps_log_level(env) == expected


@pytest.mark.parametrize("text", ["loud", "10", "warnings"])
def test_ps_log_level_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=rf"RINGCOMM_PS_LOG={text} is not a log level"):
        ps_log_level({"RINGCOMM_PS_LOG": text})


def test_env_token() -> None:
    assert env_token({}) is None
    assert env_token({"RINGCOMM_TOKEN": ""}) is None
    assert env_token({"RINGCOMM_TOKEN": " s3cret "}) == " s3cret "  # a secret: kept as written
    assert resolve_init_config(env={"RINGCOMM_TOKEN": "t"}).token == "t"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "127.0.0.1"),
        ({"MASTER_ADDR": "10.0.0.1"}, "10.0.0.1"),
        ({"MASTER_ADDR": "10.0.0.1", "RINGCOMM_MASTER_ADDR": "10.0.0.9"}, "10.0.0.9"),
        ({"MASTER_ADDR": "10.0.0.1", "RINGCOMM_MASTER_ADDR": ""}, "10.0.0.1"),
    ],
)
def test_env_master_addr(env: dict[str, str], expected: str) -> None:
    assert env_master_addr(env) == expected


# -- command-line helpers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [(8, "8"), (0, "0"), (4096, "4K"), (64 << 20, "64M"), (3 << 30, "3G"), (1536, "1536")],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text
    assert parse_size(text) == n


def test_default_of() -> None:
    @dataclasses.dataclass(frozen=True)
    class Example:
        required: int
        plain: int = 3
        made: dict[str, float] = dataclasses.field(default_factory=lambda: {"lr": 0.5})

    assert default_of(Example, "plain") == 3
    assert default_of(Example, "made") == {"lr": 0.5}
    with pytest.raises(ValueError, match="no default"):
        default_of(Example, "required")
    with pytest.raises(ValueError, match="no field"):
        default_of(Example, "other")


def test_cli_defaults_are_the_config_defaults() -> None:
    from ringcomm.bench.spec import BenchConfig
    from ringcomm.cli import build_parser
    from ringcomm.cli.bench import config_from_args as bench_config
    from ringcomm.cli.ps_server import config_from_args as ps_config
    from ringcomm.cli.train import config_from_args as train_config
    from ringcomm.engine.strategy import TrainConfig
    from ringcomm.ps.config import PSConfig

    parser = build_parser()
    bench = bench_config(parser.parse_args(["bench", "all_reduce", "-n", "2"]), environ={})
    assert bench == BenchConfig("all_reduce", 2, bind="auto")
    train = train_config(parser.parse_args(["train", "--strategy", "single"]))
    assert train == TrainConfig(strategy="single", verbose=True)
    ps = ps_config(
        parser.parse_args(
            ["ps-server", "--coordinator", "h:1", "--index", "0", "--num-workers", "2"]
        )
    )
    assert ps == PSConfig(num_workers=2, optimizer_args={"lr": 0.01, "momentum": 0.0})


# -- bad settings through the command line: one error path, exit 2 -------------------------------


def test_bench_bad_bind_variable_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringcomm.cli import main

    monkeypatch.setenv("RINGCOMM_BIND", "socket")
    assert main(["bench", "all_reduce", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ringcomm bench: error: RINGCOMM_BIND must be one of"), err


def test_ps_server_bad_log_level_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringcomm.cli import main

    monkeypatch.setenv("RINGCOMM_PS_LOG", "loud")
    argv = ["ps-server", "--coordinator", "127.0.0.1:1", "--index", "0", "--num-workers", "1"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "ringcomm ps-server: error: RINGCOMM_PS_LOG=loud is not a log level: use one of "
        "CRITICAL, FATAL, ERROR, WARN, WARNING, INFO, DEBUG, NOTSET\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ps-server", "--coordinator", "h:1", "--index", "3", "--num-workers", "1"], "--index"),
        (
            ["ps-server", "--coordinator", "h:1", "--index", "0", "--num-workers", "0"],
            "num_workers",
        ),
        (["train", "--strategy", "dp", "-n", "0"], "-n must be >= 1"),
        (["bench", "all_reduce", "-n", "0"], "-n must be >= 1"),
    ],
)
def test_usage_errors_print_once(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringcomm.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ringcomm {argv[0]}: error: ") and message in err, err
    assert err.count("error:") == 1 and err.endswith("\n") and err.count("\n") == 1


def test_a_usage_error_raised_by_any_subcommand_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringcomm import cli
    from ringcomm.launch import local

    def refuse(args: object) -> int:
        raise UsageError("no such thing")

    monkeypatch.setattr(local, "config_from_args", refuse)
    assert cli.main(["run", "x.py"]) == 2
    assert capsys.readouterr().err == "ringcomm run: error: no such thing\n"


def test_environ_changed_sets_unsets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringcomm.config import environ_changed

    monkeypatch.setenv("RC_TEST_A", "a")
    monkeypatch.delenv("RC_TEST_B", raising=False)
    seen: list[tuple[str | None, str | None]] = []

    def body() -> None:
        with environ_changed({"RC_TEST_A": None, "RC_TEST_B": "b"}):
            seen.append((os.environ.get("RC_TEST_A"), os.environ.get("RC_TEST_B")))
            raise RuntimeError  # restored on the way out of an error too

    with pytest.raises(RuntimeError):
        body()
    assert seen == [(None, "b")]
    assert os.environ["RC_TEST_A"] == "a" and "RC_TEST_B" not in os.environ
