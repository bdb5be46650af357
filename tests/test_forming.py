"""Forming a group apart from using it: ringcomm.core.forming (config -> core),
ringcomm.transport.endpoints.bind_host, and the validated tunables of ProcessGroup."""

from __future__ import annotations

import math

import numpy as np
import pytest

import ringcomm as rc
from ringcomm.config import resolve_init_config
from ringcomm.core import forming
from ringcomm.core.group_core import GroupCore
from ringcomm.errors import RendezvousError
from ringcomm.group import ProcessGroup
from ringcomm.transport.endpoints import bind_host


def test_bind_host_listens_on_a_local_address_itself() -> None:
    assert bind_host("127.0.0.1") == "127.0.0.1"


def test_bind_host_listens_everywhere_for_an_address_not_of_this_host() -> None:
    assert bind_host("192.0.2.1") == "0.0.0.0"  # TEST-NET-1: nobody's (e.g. behind a NAT)


def test_bind_host_names_an_address_that_does_not_resolve() -> None:
    with pytest.raises(RendezvousError, match=r"'no-such-host\.invalid'"):
        bind_host("no-such-host.invalid")


def test_form_world_makes_the_core_of_a_singleton() -> None:
    cfg = resolve_init_config(0, 1, master_port=0, env={})
    core = forming.form_world(cfg, None, None, 0)
    assert isinstance(core, GroupCore)
    with ProcessGroup(core) as pg:
        assert (pg.rank, pg.world_size, pg.epoch, pg.slots) == (0, 1, 0, [0])
        x = np.arange(4.0)
        assert pg.all_reduce(x) is x


def test_share_cost_model_without_a_tune_file_or_store() -> None:
    assert forming.share_cost_model(resolve_init_config(0, 1, env={}), None, None) is None


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "1M", None])
def test_chunk_bytes_setter_refuses_what_init_refuses(value: object) -> None:
    with rc.init_process_group(0, 1, master_port=0, env={}) as pg:
        before = pg.chunk_bytes
        with pytest.raises(ValueError, match=r"chunk_bytes=.* must be an int > 0"):
            pg.chunk_bytes = value  # type: ignore[assignment]
        assert pg.chunk_bytes == before
        pg.chunk_bytes = np.int64(1024)  # type: ignore[assignment]
        assert pg.chunk_bytes == 1024 and type(pg.chunk_bytes) is int


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "5", None])
def test_timeout_s_setter_refuses_what_init_refuses(value: object) -> None:
    with rc.init_process_group(0, 1, master_port=0, timeout_s=7, env={}) as pg:
        with pytest.raises(
            ValueError, match=r"timeout_s=.* must be a finite number of seconds > 0"
        ):
            pg.timeout_s = value  # type: ignore[assignment]
        assert pg.timeout_s == 7.0
        pg.timeout_s = 2
        assert pg.timeout_s == 2.0 and type(pg.timeout_s) is float
