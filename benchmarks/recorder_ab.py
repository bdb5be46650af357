"""The flight recorder's cost, A/B in one job: W ranks run blocks of all_reduce calls,
the recorder on in even blocks and off in odd ones (both ranks switch together, after a
barrier), so drift hits both. Prints the max over ranks of the median of block medians,
and of the median of block means (the mean counts what a median hides: the recorder folds
its summary every FOLD_BATCH calls, a spike in one call of many).

    python benchmarks/recorder_ab.py [--world 2] [--bytes 8] [--blocks 40] [--per 500]
                                     [--runs 3]

(A blocking collective records inline, ringcomm.collectives.api: there is no separate
"branch only" variant to time any more.)
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ringcomm as rc


def _body(pg: rc.ProcessGroup, blocks: int, per: int, nbytes: int) -> dict[str, float]:
    x = np.zeros(max(1, nbytes // 4), np.float32)
    rec = pg.core.state.recorder
    for _ in range(min(200, per)):
        pg.all_reduce(x)
    out: dict[bool, list[float]] = {True: [], False: []}
    means: dict[bool, list[float]] = {True: [], False: []}
    for b in range(blocks):
        on = b % 2 == 0
        rec.enabled = on
        pg.barrier()
        ts = []
        for _ in range(per):
            t = time.perf_counter()
            pg.all_reduce(x)
            ts.append(time.perf_counter() - t)
        out[on].append(float(np.median(ts)) * 1e6)
        means[on].append(float(np.mean(ts)) * 1e6)
    rec.enabled = True
    return {"on": float(np.median(out[True])), "off": float(np.median(out[False])),
            "on_mean": float(np.median(means[True])), "off_mean": float(np.median(means[False]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--per", type=int, default=500)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    for _ in range(a.runs):
        res = rc.spawn(_body, a.world, args=(a.blocks, a.per, a.bytes))
        on, off = max(r["on"] for r in res), max(r["off"] for r in res)
        mon, moff = max(r["on_mean"] for r in res), max(r["off_mean"] for r in res)
        print(f"W={a.world} {a.bytes} B: median on {on:.2f} us, off {off:.2f} us, "
              f"on - off {on - off:+.2f} us ({(on / off - 1) * 100:+.1f} %); "
              f"mean on {mon:.2f}, off {moff:.2f}, on - off {mon - moff:+.2f} us "
              f"({(mon / moff - 1) * 100:+.1f} %)", flush=True)


if __name__ == "__main__":
    main()
