"""Randomized collective mismatches: shape, dtype, reduce op, root, order of calls.

Each trial builds one collective call (random kind, size, dtype, op, root; sizes reach the
pipelined ring paths through a small ``chunk_bytes``) and makes a random non-empty proper
subset of the ranks deviate in one aspect. Every rank runs the trial in a fresh sub-group
with a short deadline and reports what happened and whether its buffers changed. Over
all trials (>= 200, W = 3 and 4):

* no hang: no rank times out;
* the mismatch is detected: at least one rank raises CollectiveMismatchError, and every
  rank either raises it or completes a call that never needed another rank's data (a
  broadcast's source);
* no rank that raised has a modified buffer (the in-place operand or ``out``).
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest

import ringcomm as rc

TRIALS_PER_JOB = 110
KINDS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "scatter",
)
ASPECTS = ("shape", "dtype", "op", "root", "order")
DTYPES = (np.float32, np.float64, np.int32, np.int64)


def _trial(world: int, rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(KINDS)
    aspect = rng.choice(ASPECTS)
    if aspect == "op" and kind not in ("all_reduce", "reduce", "reduce_scatter"):
        aspect = "shape"
    if aspect == "root" and kind not in ("broadcast", "reduce", "scatter"):
        aspect = "dtype"
    deviants = rng.sample(range(world), rng.randrange(1, world))
    base = {
        "kind": kind,
        "count": rng.choice((1, 5, 300, 20_000, 70_000)),
        "dtype": rng.choice(DTYPES),
        "op": rng.choice(("sum", "max")),
        "root": rng.randrange(world),
    }
    other = dict(base)
    if aspect == "shape":
        # A multiple of the world size: the rows of reduce_scatter/all_to_all change too.
        other["count"] = base["count"] + world * rng.choice((1, 7, base["count"]))
    elif aspect == "dtype":
        other["dtype"] = rng.choice([d for d in DTYPES if d != base["dtype"]])
    elif aspect == "op":
        other["op"] = "max" if base["op"] == "sum" else "sum"
    elif aspect == "root":
        other["root"] = (base["root"] + rng.randrange(1, world)) % world
    else:  # order: the deviants call the other collective first
        other["kind"] = rng.choice([k for k in KINDS if k != kind])
    return {"aspect": aspect, "deviants": deviants, "base": base, "other": other}


def _buffers(
    call: dict[str, Any], world: int, rank: int, variant: int
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(x, out) for this rank's call; contents depend on the rank.

    ``variant`` (scatter, a rank other than the source): 0 passes ``x`` and ``out``, 1
    only ``out``, 2 only ``x``, 3 neither (dtype and shape then come from the source).
    """
    kind, count, dtype = call["kind"], call["count"], call["dtype"]
    if kind == "scatter":
        per_row = count // world + 1
        x = (np.arange(world * per_row) % 97 + rank + 1).astype(dtype).reshape(world, per_row)
        out = np.full(per_row, 55, dtype)
        if rank == call["root"] or variant == 0:
            return x, out
        return (None, out) if variant == 1 else (x, None) if variant == 2 else (None, None)
    rows = (world,) if kind in ("reduce_scatter", "all_to_all") else ()
    per_row = count // world + 1 if rows else count
    x = (np.arange(int(np.prod(rows or (1,))) * per_row) % 97 + rank + 1).astype(dtype)
    x = x.reshape(*rows, per_row)
    out = None
    if kind == "all_gather":
        out = np.full((world, per_row), 55, dtype)
    elif kind == "reduce_scatter":
        out = np.full(per_row, 55, dtype)
    elif kind == "all_to_all":
        out = np.full((world, per_row), 55, dtype)
    return x, out


def _call(
    pg: rc.ProcessGroup, call: dict[str, Any], x: np.ndarray | None, out: np.ndarray | None
) -> None:
    kind = call["kind"]
    if kind == "scatter":
        pg.scatter(x, src=call["root"], out=out)
        return
    assert x is not None
    if kind == "all_reduce":
        pg.all_reduce(x, op=call["op"])
    elif kind == "broadcast":
        pg.broadcast(x, src=call["root"])
    elif kind == "reduce":
        pg.reduce(x, dst=call["root"], op=call["op"])
    elif kind == "all_gather":
        pg.all_gather(x, out=out)
    elif kind == "reduce_scatter":
        pg.reduce_scatter(x, out=out, op=call["op"])
    else:
        pg.all_to_all(x, out=out)


def job_mismatches(pg: rc.ProcessGroup, seed: int, trials: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)  # every rank draws the same trials
    results = []
    for i in range(trials):
        trial = _trial(pg.world_size, rng)
        call = trial["other"] if pg.rank in trial["deviants"] else trial["base"]
        sub = pg.new_group(range(pg.world_size))
        assert sub is not None
        sub.timeout_s = 10.0
        sub.chunk_bytes = 16 * 1024  # many pieces: the pipelined paths
        # This rank's own scatter variant; one that passes neither x nor out cannot
        # disagree on dtype or shape, so deviants (and everyone, if the source deviates)
        # pass a buffer.
        open_ok = (
            pg.rank not in trial["deviants"] and trial["base"]["root"] not in trial["deviants"]
        )
        variant = random.Random(f"{seed}/{i}/{pg.rank}").randrange(4 if open_ok else 3)
        x, out = _buffers(call, pg.world_size, pg.rank, variant)
        x0 = None if x is None else x.copy()
        out0 = None if out is None else out.copy()
        t0 = time.monotonic()
        try:
            _call(sub, call, x, out)
            outcome = "completed"
        except rc.CollectiveMismatchError:
            outcome = "mismatch"
        except rc.CommTimeoutError as exc:
            outcome = f"timeout: {exc}"
        except Exception as exc:  # noqa: BLE001 (reported and asserted on)
            outcome = f"{type(exc).__name__}: {exc}"
        modified = (x is not None and not np.array_equal(x, x0)) or (
            out is not None and not np.array_equal(out, out0)
        )
        results.append(
            {
                "trial": i,
                "aspect": trial["aspect"],
                "kind": call["kind"],
                "outcome": outcome,
                "modified": modified,
                "seconds": time.monotonic() - t0,
                "deviant": pg.rank in trial["deviants"],
                "root": call["root"],
            }
        )
        sub.close()
        pg.barrier()  # the next trial starts together (a stray abort never races it)
    return results


def _is_root_only_sender(r: dict[str, Any]) -> bool:
    """A call that completes without data from anyone: a broadcast's source."""
    return r["kind"] == "broadcast" and r["root"] == r["rank"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [3, 4])
def test_randomized_mismatches_raise_without_hangs_or_writes(
    world: int, no_child_processes: None
) -> None:
    per_rank = rc.spawn(job_mismatches, world, args=(7 + world, TRIALS_PER_JOB), timeout_s=500)
    problems = []
    detected = 0
    for i in range(TRIALS_PER_JOB):
        rows = [dict(per_rank[r][i], rank=r) for r in range(world)]
        what = f"trial {i} ({rows[0]['aspect']}): " + ", ".join(
            f"rank {r['rank']} {r['kind']}{'*' if r['deviant'] else ''} -> {r['outcome'][:300]}"
            f"{' MODIFIED' if r['modified'] else ''}"
            for r in rows
        )
        if any(r["outcome"].startswith("timeout") for r in rows):
            problems.append("hang: " + what)
            continue
        if not any(r["outcome"] == "mismatch" for r in rows):
            problems.append("undetected: " + what)
            continue
        detected += 1
        for r in rows:
            if r["outcome"] == "completed" and not _is_root_only_sender(r):
                problems.append(f"rank {r['rank']} completed: " + what)
            elif r["outcome"] not in ("mismatch", "completed"):
                problems.append(f"rank {r['rank']} other error: " + what)
            elif r["outcome"] == "mismatch" and r["modified"]:
                problems.append(f"rank {r['rank']} buffer modified: " + what)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:20])
    assert detected == TRIALS_PER_JOB
