"""Regenerate the published bench figures and tables from their JSON rows.

    python benchmarks/figures.py [benchmarks/results/bench_gloo_W2.json ...]

For each JSON file (``ringcomm bench --json`` rows, several ops may be concatenated; default:
every ``benchmarks/results/bench_*.json``):

* ``<stem>.png`` -- busbw and time vs size, one row of panels per op (needs matplotlib);
* ``<stem>.md`` -- the text between ``<!-- bench-table:begin -->`` and
  ``<!-- bench-table:end -->`` is replaced by the generated tables (ratios at 8 B, 64 KiB,
  1 MiB, 16 MiB and 64 MiB, then every size); the rest (command, date, machine, notes) is
  hand-written and kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ringcomm.bench.report import format_markdown

RESULTS = Path(__file__).resolve().parent / "results"
BEGIN, END = "<!-- bench-table:begin -->", "<!-- bench-table:end -->"
SUMMARY_BYTES = (8, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


def load_rows(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def update_markdown(md: Path, table: str) -> bool:
    """Replace the generated section of ``md``; False if it has no markers."""
    text = md.read_text()
    if BEGIN not in text or END not in text:
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    md.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1].strip())
    parser.add_argument(
        "json", nargs="*", type=Path, help="JSON rows (default: results/bench_*.json)"
    )
    parser.add_argument("--no-plot", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    paths = args.json or sorted(RESULTS.glob("bench_*.json"))
    if not paths:
        print(f"no bench_*.json under {RESULTS}", file=sys.stderr)
        return 1
    for path in paths:
        rows = load_rows(path)
        impls = " vs ".join(dict.fromkeys(r["impl"] for r in rows))
        world = rows[0]["world_size"]
        if not args.no_plot:
            from ringcomm.bench.plot import plot_rows

            png = path.with_suffix(".png")
            plot_rows(rows, str(png), title=f"ringcomm bench: {impls}, {world} ranks")
            print(f"wrote {png}")
        md = path.with_suffix(".md")
        if md.exists() and update_markdown(md, format_markdown(rows, SUMMARY_BYTES)):
            print(f"updated {md}")
        elif md.exists():
            print(f"{md}: no {BEGIN} ... {END} section; left alone", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
