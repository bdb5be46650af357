"""resolve_init_config, parse_size, parse_slurm_nodelist: pure, every case through env= dicts."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.config import (
    DEFAULT_TIMEOUT_S,
    InitConfig,
    parse_size,
    parse_slurm_nodelist,
    resolve_init_config,
    slurm_master_port,
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
def test_torchrun_agent_store_uses_next_port(flag: str) -> None:
    cfg = resolve_init_config(env={**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": flag})
    assert cfg.master_port == 29501


@pytest.mark.parametrize("flag", ["False", "0", ""])
def test_torchrun_without_agent_store_keeps_port(flag: str) -> None:
    cfg = resolve_init_config(env={**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": flag})
    assert cfg.master_port == 29500


def test_agent_store_does_not_shift_a_ringcomm_port() -> None:
    env = {**TORCHRUN, "RINGCOMM_MASTER_PORT": "31000", "TORCHELASTIC_USE_AGENT_STORE": "1"}
    assert resolve_init_config(env=env).master_port == 31000


def test_agent_store_port_overflow_is_rejected() -> None:
    env = {**TORCHRUN, "MASTER_PORT": "65535", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(RendezvousError, match="65536"):
        resolve_init_config(env=env)


def test_mpirun_variables() -> None:
    env = {**OMPI, "MASTER_ADDR": "head", "MASTER_PORT": "4000"}  # as `mpirun -x` exports
    cfg = resolve_init_config(env=env)
    assert (cfg.rank, cfg.world_size, cfg.local_rank, cfg.source) == (5, 6, 1, "mpirun")
    assert (cfg.master_addr, cfg.master_port) == ("head", 4000)


def test_mpirun_without_master_port_is_an_error() -> None:
    with pytest.raises(RendezvousError, match="MASTER_PORT"):
        resolve_init_config(env=OMPI)


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
