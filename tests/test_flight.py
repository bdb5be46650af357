"""The flight recorder (ringcomm.core.flight): the ring buffer, the comms summary, the files a
rank writes to RINGCOMM_TRACE_DIR, the desync report and the Chrome trace
(``ringcomm trace DIR``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ringcomm as rc
from ringcomm.collectives import ALGORITHMS, WORKSPACE_ALGO
from ringcomm.core import flight


# ------------------------------------------------------------------------------ in-process
def test_the_ring_keeps_the_newest_entries_and_the_summary_counts_every_call() -> None:
    rec = flight.FlightRecorder(3, rank=0)
    for seq in range(1, 6):
        e = rec.start(0, seq, "all_reduce", "float32", (256,), 1024, "ring", (0, 1))
        rec.end(e)
    assert [r["seq"] for r in rec.records()] == [3, 4, 5]  # the last 3
    e = rec.start(0, 6, "broadcast", "int8", (3,), 3, "chain", (0, 1))
    rec.end(e, RuntimeError("boom"))
    assert rec.records()[-1]["state"] == "failed: RuntimeError: boom"
    rows = {(r["op"], r["bucket_bytes"]): r for r in rec.summary()}
    assert list(rows) == [("all_reduce", 1024)]  # a failed call is not in the summary
    row = rows["all_reduce", 1024]
    assert row["count"] == 5 and row["bytes"] == 5 * 1024
    assert row["median_s"] > 0 and row["busbw_GBps"] > 0
    assert flight.summary_table(rec.summary()).splitlines()[1].startswith("all_reduce")


def test_the_inline_protocol_folds_on_the_sequence_number_and_keeps_running_ops_pending() -> None:
    """What ringcomm.collectives.api does per blocking call: push the entry, store the end
    time (the state stays ``running`` and reads ``done``), fold at ``seq & FOLD_MASK == 0``;
    an asynchronous one still running at a fold stays pending and is counted once, when
    it ends; a failed one is in the ring but not in the summary."""
    rec = flight.FlightRecorder(8, rank=0)
    running = rec.start(0, 0, "all_gather", "int32", (3,), 12, "ring", (0, 1))
    assert running is not None
    for seq in range(1, flight.FOLD_BATCH + 3):
        e = [
            0,
            seq,
            "all_reduce",
            np.dtype("float32"),
            (2,),
            None,
            "ws",
            (0, 1),
            flight.now(),
            None,
            flight.RUNNING,
        ]
        rec.push(e)
        e[flight.E_END] = flight.now()
        if not seq & flight.FOLD_MASK:
            rec.fold()
            assert rec.pending == [running]  # everything else went to the ring
    assert len(rec.pending) == 3 and len(rec.entries) == 8  # the ring keeps 8
    failed = rec.start(0, 999, "broadcast", "int8", (1,), 1, "chain", (0, 1))
    rec.end(failed, RuntimeError("boom"))
    records = rec.records()
    assert len(records) == 8 and records[-1]["state"] == "failed: RuntimeError: boom"
    assert records[-2]["state"] == "done" and records[-2]["seq"] == flight.FOLD_BATCH + 2
    assert [r["seq"] for r in records if r["op"] == "all_gather"] == []  # older than the last 8
    assert rec.newest()[0][flight.E_SEQ] == flight.FOLD_BATCH - 4
    rows = {(r["op"], r["bucket_bytes"]): r["count"] for r in rec.summary()}
    assert rows == {("all_reduce", 8): flight.FOLD_BATCH + 2}  # the running one: not yet
    rec.end(running)
    rows = {(r["op"], r["bucket_bytes"]): r["count"] for r in rec.summary()}
    assert rows == {("all_reduce", 8): flight.FOLD_BATCH + 2, ("all_gather", 16): 1}
    assert rec.pending == []
    assert {(r["op"], r["bucket_bytes"]): r["count"] for r in rec.summary()} == rows  # once


def test_many_outstanding_calls_do_not_make_every_end_fold() -> None:
    rec = flight.FlightRecorder(4096, rank=0)
    waiting = [rec.start(0, t, "recv", "int8", (1,), 1, "p2p", (1,)) for t in range(300)]
    rec.fold()  # all still running: all stay pending
    assert len(rec.pending) == 300 and rec.fold_at == 300 + flight.FOLD_BATCH
    rec.end(waiting[0])  # no fold for this one
    assert len(rec.pending) == 300 and not rec.entries
    for e in waiting[1:]:
        rec.end(e)
    assert {(r["op"], r["count"]) for r in rec.summary()} == {("recv", 300)}
    assert len(rec.records()) == 300 and not rec.pending


def test_records_are_on_the_wall_clock() -> None:
    rec = flight.FlightRecorder(4, rank=0)
    before = time.time()
    rec.end(rec.start(0, 1, "barrier", None, None, 0, "shm", (0, 1)))
    after = time.time()
    (r,) = rec.records()
    assert before - 0.01 <= r["start_s"] <= r["end_s"] <= after + 0.01


def test_an_off_recorder_records_nothing_and_writes_nothing(tmp_path: Path) -> None:
    rec = flight.FlightRecorder(0, rank=0, trace_dir=str(tmp_path))
    assert rec.start(0, 1, "barrier", None, None, 0, "shm", (0,)) is None
    rec.end(None)
    assert rec.dump("test") is None and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("n", "want"), [(0, 0), (1, 1), (3, 4), (4, 4), (5, 8), (1 << 20, 1 << 20)]
)
def test_size_buckets_are_the_next_power_of_two(n: int, want: int) -> None:
    assert flight.size_bucket(n) == want


def test_bus_factors_are_nccl_tests() -> None:
    assert flight.bus_factor("all_reduce", 4) == 1.5
    assert flight.bus_factor("all_gather", 4) == 0.75
    assert flight.bus_factor("broadcast", 4) == 1.0


def _entry(
    seq: int, op: str, state: str = "done", start: float = 100.0, group: int = 0
) -> dict[str, Any]:
    return {
        "group": group,
        "seq": seq,
        "op": op,
        "dtype": "float32",
        "shape": [10],
        "bytes": 40,
        "algo": "shm",
        "peers": [0, 1, 2],
        "start_s": start,
        "end_s": None if state == "running" else start + 0.1,
        "state": state,
    }


def _file(rank: int, entries: list[dict[str, Any]], dumped: float = 110.0) -> dict[str, Any]:
    return {"rank": rank, "reason": "test", "dumped_s": dumped, "entries": entries}


def test_the_report_names_the_rank_behind_and_who_waits_for_it() -> None:
    files = [
        _file(0, [_entry(1, "all_reduce"), _entry(2, "broadcast", "running", 105.0)]),
        _file(1, [_entry(1, "all_reduce"), _entry(2, "broadcast", "running", 105.0)]),
        _file(2, [_entry(1, "all_reduce", start=79.0)]),
    ]
    text = flight.desync_report(files)
    assert (
        "rank 2 is at op #1 all_reduce(float32[10]), entered 31.0 s ago (finished; it has "
        "not entered the next collective); ranks 0, 1 wait in op #2 broadcast(float32[10]) "
        "for rank 2"
    ) in text


def test_the_report_names_a_mismatch_and_missing_files() -> None:
    files = [
        _file(0, [_entry(3, "all_reduce", "running")]),
        _file(1, [_entry(3, "all_gather", "running")]),
    ]
    text = flight.desync_report(files, world_size=3)
    assert (
        "mismatch at op #3: rank 0: all_reduce(float32[10]); rank 1: all_gather(float32[10])"
        in text
    )
    assert "no trace file from rank 2" in text


def test_the_chrome_trace_has_a_track_per_rank_and_a_slice_per_op() -> None:
    files = [
        _file(0, [_entry(1, "all_reduce"), _entry(2, "barrier", "running", 101.0)]),
        _file(1, [_entry(1, "all_reduce", start=100.5)]),
    ]
    trace = json.loads(json.dumps(flight.chrome_trace(files)))
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert sorted(e["pid"] for e in names) == [0, 1]
    assert [(e["pid"], e["name"]) for e in slices] == [
        (0, "all_reduce"),
        (0, "barrier"),
        (1, "all_reduce"),
    ]
    assert slices[0]["ts"] == 0 and slices[2]["ts"] == pytest.approx(0.5e6)
    assert slices[1]["dur"] == pytest.approx(9e6)  # running: until its rank's dump
    assert slices[0]["args"]["bytes"] == 40


# ------------------------------------------------------------------------------ three ranks
def _wait_for_files(folder: Path, names: list[str], timeout_s: float) -> None:
    """Until every file of ``names`` exists in ``folder`` (what rank 2 waits for)."""
    give_up = time.monotonic() + timeout_s
    while not all((folder / n).exists() for n in names):
        if time.monotonic() > give_up:
            raise TimeoutError(f"no {names} in {folder} within {timeout_s} s")
        time.sleep(0.01)  # polling for the files (the event), not ordering by time


def _late_rank(pg: rc.ProcessGroup, folder: str) -> str:
    x = np.arange(4, dtype=np.float32)
    pg.all_reduce(x)  # op #1, everyone
    if pg.rank == 2:  # stays out of op #2 until the others timed out and wrote their records
        _wait_for_files(Path(folder), ["rank0.json", "rank1.json"], 60)
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler writes rank2.json
        _wait_for_files(Path(folder), ["rank2.json"], 10)
        return "late"
    try:
        pg.broadcast(x, timeout_s=1.0)
    except (rc.CommTimeoutError, rc.PeerFailedError) as exc:
        return type(exc).__name__
    return "no error"


@pytest.mark.timeout(120)
def test_a_rank_that_stays_out_of_a_collective_is_named_by_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RINGCOMM_TRACE_DIR", str(tmp_path))
    got = rc.spawn(_late_rank, 3, args=(str(tmp_path),), timeout_s=90)
    assert got[2] == "late" and set(got[:2]) <= {"CommTimeoutError", "PeerFailedError"}
    files = flight.load_dir(tmp_path)
    assert [f["rank"] for f in files] == [0, 1, 2]
    assert files[2]["reason"] == "SIGUSR1"
    text = flight.desync_report(files)
    assert "rank 2 is at op #1 all_reduce(float32[4])" in text, text
    assert "wait in op #2 broadcast(float32[4]) for rank 2" in text, text
    first = files[0]["entries"][0]  # every field where it belongs (api.py records inline)
    assert (first["op"], first["dtype"], first["shape"], first["peers"]) == (
        "all_reduce",
        "float32",
        [4],
        [0, 1, 2],
    )
    assert first["algo"] in {*ALGORITHMS["all_reduce"], WORKSPACE_ALGO}, first
    for f in files[:2]:
        last = f["entries"][-1]
        assert last["op"] == "broadcast" and last["state"].startswith("failed: ")
    # The command line: the same report, and a Chrome trace with a track per rank.
    chrome = tmp_path / "trace.json"
    out = subprocess.run(
        [sys.executable, "-m", "ringcomm", "trace", str(tmp_path), "--chrome", str(chrome)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "rank 2 is at op #1 all_reduce(float32[4])" in out.stdout
    events = json.loads(chrome.read_text())["traceEvents"]
    tracks = {e["pid"] for e in events if e["ph"] == "X"}
    assert tracks == {0, 1, 2}
    assert sorted(e["name"] for e in events if e["ph"] == "X" and e["pid"] == 0) == [
        "all_reduce",
        "broadcast",
    ]


def _summary(pg: rc.ProcessGroup) -> list[dict[str, Any]]:
    for n in (1, 1000, 1000):
        pg.all_reduce(np.ones(n, np.float64))
    work = pg.all_gather(np.ones(3, np.int32), async_op=True)
    work.wait()
    return pg.comm_summary()


@pytest.mark.timeout(60)
def test_comm_summary_counts_each_op_and_size_bucket() -> None:
    rows = rc.spawn(_summary, 2, timeout_s=50)[0]
    got = {(r["op"], r["bucket_bytes"]): r["count"] for r in rows}
    assert got == {("all_reduce", 8): 1, ("all_reduce", 8192): 2, ("all_gather", 16): 1}
    assert all(r["busbw_GBps"] >= 0 and r["total_s"] > 0 for r in rows)


def _many(pg: rc.ProcessGroup, calls: int) -> tuple[list[dict[str, Any]], list[int]]:
    sub = pg.new_group([0, 1])
    x = np.ones(2, np.float32)
    for i in range(calls):
        pg.all_reduce(x)
        if i % 3 == 0 and sub is not None:  # (rank 2 is not in it)
            sub.all_reduce(x)
        if i % 50 == 0:
            pg.all_reduce(x, async_op=True).wait()
    seqs = [r["seq"] for r in pg.core.state.recorder.records() if r["group"] == pg.core.group_id]
    return pg.comm_summary(), seqs


@pytest.mark.timeout(120)
def test_comm_summary_counts_every_call_across_many_folds() -> None:
    calls = 3 * 256 + 7  # several folds of the world group's, the sub-group's in between
    rows, seqs = rc.spawn(_many, 3, args=(calls,), timeout_s=100)[0]
    got = {(r["op"], r["bucket_bytes"]): r["count"] for r in rows}
    world = calls + len(range(0, calls, 50))
    assert got == {("all_reduce", 8): world + len(range(0, calls, 3))}
    assert seqs == sorted(seqs) and seqs[-1] == world  # the newest, in the order called


def _close_writes(pg: rc.ProcessGroup) -> None:
    pg.barrier()


@pytest.mark.timeout(60)
def test_close_writes_the_record_with_ringcomm_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RINGCOMM_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("RINGCOMM_TRACE", "1")
    rc.spawn(_close_writes, 2, timeout_s=50)
    files = flight.load_dir(tmp_path)
    assert [(f["rank"], f["reason"]) for f in files] == [(0, "close()"), (1, "close()")]
    assert [e["op"] for e in files[0]["entries"]] == ["barrier"]


def test_the_command_says_when_there_is_nothing_to_read(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ringcomm", "trace", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "no trace files" in out.stderr


def _p2p(pg: rc.ProcessGroup) -> list[dict[str, Any]]:
    x = np.zeros(3, np.int64)
    if pg.rank == 0:
        pg.send(x + 1, 1, tag=5)
        pg.irecv(x, rc.ANY_SOURCE, tag=6).wait()
    else:
        pg.recv(x, 0, tag=5)
        pg.isend(x, 0, tag=6).wait()
    return pg.comm_summary()


@pytest.mark.timeout(60)
def test_point_to_point_calls_are_recorded_too() -> None:
    rows = rc.spawn(_p2p, 2, timeout_s=50)
    assert {(r["op"], r["count"]) for r in rows[0]} == {("send", 1), ("recv", 1)}
    assert {(r["op"], r["bucket_bytes"]) for r in rows[1]} == {("send", 32), ("recv", 32)}


@pytest.mark.timeout(120)
def test_train_comm_summary(tmp_path: Path) -> None:
    out_json = tmp_path / "train.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringcomm",
            "train",
            "--strategy",
            "dp",
            "-n",
            "2",
            "--steps",
            "3",
            "--hidden",
            "16",
            "-q",
            "--comm-summary",
            "--json",
            str(out_json),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr
    assert "collectives of rank 0" in out.stdout
    per_rank = json.loads(out_json.read_text())["comm_summary"]
    assert len(per_rank) == 2
    # 3 steps: a gradient all_reduce (one bucket here) and the loss's, per step
    assert sum(r["count"] for r in per_rank[0] if r["op"] == "all_reduce") == 6
