"""Hostfile formats and rank placement (ringcomm.launch.hostfile): pure, no hosts needed."""

from __future__ import annotations

import pytest

from ringcomm.launch.hostfile import (
    HostfileError,
    HostSlots,
    Placement,
    assign_ranks,
    parse_hostfile,
    parse_hosts_option,
    read_hostfile,
)


def test_all_formats_comments_and_blank_lines() -> None:
    text = """
# a comment line
node1 slots=4            # OpenMPI / DeepSpeed
node2:2                  # Horovod
   node3                 # one slot by default

gpu-4.cluster.example slots=2 max_slots=8
alice@10.0.0.7:3
[fe80::1]:2
::1
"""
    assert parse_hostfile(text) == [
        HostSlots("node1", 4),
        HostSlots("node2", 2),
        HostSlots("node3", 1),
        HostSlots("gpu-4.cluster.example", 2),
        HostSlots("alice@10.0.0.7", 3),
        HostSlots("fe80::1", 2),
        HostSlots("::1", 1),
    ]


def test_a_host_named_twice_adds_its_slots_in_first_position() -> None:
    assert parse_hostfile("a slots=2\nb\na:3\n") == [HostSlots("a", 5), HostSlots("b", 1)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no hosts listed"),
        ("# only a comment\n\n", "no hosts listed"),
        ("node1 slots=0", "hostfile:1: slots must be a positive integer"),
        ("ok\nnode1 slots=two", "hostfile:2: slots must be a positive integer"),
        ("node1:x", "slots must be a positive integer"),
        ("node1 cpus=2", "unknown setting 'cpus'"),
        ("node1 2", "expected key=value"),
        ("node1:2 slots=3", "slots given twice"),
        ("-oProxyCommand=evil", "is not a host name"),
        ("no;way", "is not a host name"),
        ("[fe80::1", r"unclosed '\['"),
        ("[fe80::1]:2 slots=3", "slots given twice"),
    ],
)
def test_hostfile_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(text)


def test_read_hostfile(tmp_path) -> None:
    path = tmp_path / "hosts"
    path.write_text("h1 slots=2\nh2:1\n")
    assert read_hostfile(str(path)) == [HostSlots("h1", 2), HostSlots("h2", 1)]
    with pytest.raises(HostfileError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path / "missing"))
    (tmp_path / "bad").write_text("h1 slots=-1\n")
    with pytest.raises(HostfileError, match=r"bad:1: slots"):
        read_hostfile(str(tmp_path / "bad"))


def test_hosts_option() -> None:
    assert parse_hosts_option("h1:2,h2:2") == [HostSlots("h1", 2), HostSlots("h2", 2)]
    assert parse_hosts_option("h1, h2") == [HostSlots("h1", 1), HostSlots("h2", 1)]
    for bad in ("", "h1,,h2", "h1:0", "h1:2:3x"):
        with pytest.raises(HostfileError):
            parse_hosts_option(bad)


def test_ranks_are_contiguous_per_host_in_order() -> None:
    hosts = [HostSlots("a", 2), HostSlots("b", 3), HostSlots("c", 1)]
    placed = assign_ranks(hosts)
    assert placed == [
        Placement(0, "a", 0, 0, 2),
        Placement(1, "a", 0, 1, 2),
        Placement(2, "b", 1, 0, 3),
        Placement(3, "b", 1, 1, 3),
        Placement(4, "b", 1, 2, 3),
        Placement(5, "c", 2, 0, 1),
    ]


def test_fewer_ranks_fill_the_first_hosts() -> None:
    hosts = [HostSlots("a", 2), HostSlots("b", 3), HostSlots("c", 1)]
    placed = assign_ranks(hosts, nproc=3)
    assert [(p.rank, p.host, p.local_rank, p.local_world_size) for p in placed] == [
        (0, "a", 0, 2),
        (1, "a", 1, 2),
        (2, "b", 0, 1),  # only one of b's slots in use: its local world is 1
    ]


def test_nproc_per_node_overrides_slots() -> None:
    hosts = [HostSlots("a", 1), HostSlots("b", 8)]
    placed = assign_ranks(hosts, nproc_per_node=3)
    assert [(p.host, p.local_rank) for p in placed] == [
        ("a", 0),
        ("a", 1),
        ("a", 2),
        ("b", 0),
        ("b", 1),
        ("b", 2),
    ]
    assert len(assign_ranks(hosts, nproc=4, nproc_per_node=3)) == 4


@pytest.mark.parametrize(
    ("nproc", "per_node", "message"),
    [
        (7, None, r"-n 7 ranks do not fit in 6 slot\(s\) \(a:2, b:4\)"),
        (0, None, "-n must be >= 1"),
        (None, 0, "--nproc-per-node must be >= 1"),
        (5, 2, "do not fit in 4 slot"),
    ],
)
def test_placement_errors(nproc, per_node, message) -> None:
    with pytest.raises(HostfileError, match=message):
        assign_ranks([HostSlots("a", 2), HostSlots("b", 4)], nproc, per_node)
