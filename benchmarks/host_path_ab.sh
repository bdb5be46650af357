#!/usr/bin/env bash
# Host-buffer all_reduce before/after a change, interleaved A B A B (BENCHMARKING.md).
#
#   bash benchmarks/host_path_ab.sh A_REPO B_REPO OUTDIR [ROUNDS] [bench args...]
#
# Runs `python -m ringcomm bench all_reduce -n 2 -b 8 -e 64M` (or the args given) with
# PYTHONPATH=A_REPO, then B_REPO, ROUNDS times (default 2), writing A_i.json / B_i.json,
# then prints per size the median over rounds of each side's busbw and time and B/A.
set -euo pipefail
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); OUTDIR=$3; ROUNDS=${4:-2}
shift $(( $# >= 4 ? 4 : 3 ))
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(-n 2 -b 8 -e 64M)
mkdir -p "$OUTDIR"
for i in $(seq 1 "$ROUNDS"); do
    for side in A B; do
        repo=$A; [ "$side" = B ] && repo=$B
        (cd "$repo" && PYTHONPATH="$repo" python -m ringcomm bench all_reduce "${ARGS[@]}" -q \
            --json "$OUTDIR/${side}_$i.json" >/dev/null)
    done
done
python - "$OUTDIR" "$ROUNDS" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
def load(side):
    per = {}
    for i in range(1, rounds + 1):
        for line in (out / f"{side}_{i}.json").read_text().splitlines():
            r = json.loads(line)
            per.setdefault(r["bytes"], []).append(r)
    return per
a, b = load("A"), load("B")
print(f"{'bytes':>10} {'A time us':>10} {'B time us':>10} {'B/A time':>9} {'A busbw':>8} {'B busbw':>8} {'B/A bw':>7}")
ratios = []
for nbytes in sorted(a):
    ta = statistics.median(r["time_us"] for r in a[nbytes]); tb = statistics.median(r["time_us"] for r in b[nbytes])
    ba = statistics.median(r["busbw_GBps"] for r in a[nbytes]); bb = statistics.median(r["busbw_GBps"] for r in b[nbytes])
    ratios.append(tb / ta)
    print(f"{nbytes:>10} {ta:>10.1f} {tb:>10.1f} {tb / ta:>9.2f} {ba:>8.3f} {bb:>8.3f} {(bb / ba if ba else float('nan')):>7.2f}")
print(f"median B/A time over {len(ratios)} sizes: {statistics.median(ratios):.3f}")
PYEOF
