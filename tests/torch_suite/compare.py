"""Compare two junit files of the suite driver (ringcomm's and Gloo's runs).

    python tests/torch_suite/compare.py gloo_w2.xml ringcomm_w2.xml

prints the counts of each and every test that passed on Gloo but not on ringcomm,
marked with its exclusion reason or known gap (``exclusions.py``) or as a new gap; exits 1
if any test outside ``EXCLUDED`` is left.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from exclusions import EXCLUDED, KNOWN_GAPS


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """{test name: (passed|failed|skipped, message)} from a pytest junit file."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        state, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                state = "skipped" if tag == "skipped" else "failed"
                msg = (el.get("message") or "").splitlines()[0][:200] if el.get("message") else ""
                break
        out[name] = (state, msg)
    return out


def counts(res: dict[str, tuple[str, str]]) -> dict[str, int]:
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for state, _ in res.values():
        c[state] += 1
    return c


def gaps(ref: dict[str, tuple[str, str]], got: dict[str, tuple[str, str]]) -> list[str]:
    """Tests that pass on the reference and not here (failed, skipped or missing)."""
    return sorted(
        t
        for t, (s, _) in ref.items()
        if s == "passed" and got.get(t, ("missing", ""))[0] != "passed"
    )


def main(argv: list[str]) -> int:
    ref, got = outcomes(argv[1]), outcomes(argv[2])
    print(f"reference {argv[1]}: {counts(ref)}")
    print(f"ringcomm  {argv[2]}: {counts(got)}")
    left = 0
    for t in gaps(ref, got):
        state, msg = got.get(t, ("missing", ""))
        if t in EXCLUDED:
            print(f"  excluded {t}: {state} ({EXCLUDED[t]})")
        elif t in KNOWN_GAPS:
            left += 1
            print(f"  known gap {t}: {state} ({KNOWN_GAPS[t]})")
        else:
            left += 1
            print(f"  GAP      {t}: {state}: {msg}")
    extra = sorted(
        t for t, (s, _) in got.items() if s == "passed" and ref.get(t, ("", ""))[0] != "passed"
    )
    for t in extra:
        print(f"  passes on ringcomm only: {t} (reference: {ref.get(t, ('missing', ''))[0]})")
    print(f"{left} test(s) pass on the reference and fail on ringcomm outside the exclusions")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
