"""Tests of torch's suite that pass on Gloo and not on ringcomm, each with why.

``EXCLUDED``: only tests where torch itself compares the backend's *name* with "gloo" (the
driver keeps ``BACKEND="gloo"`` for the test bodies while the groups run on ringcomm, see
``driver.py``): nothing ringcomm could change short of calling itself "gloo".

``KNOWN_GAPS``: tests that fail for a missing ringcomm feature, with the exact error; each
entry goes once the feature lands (``tests/test_torch_suite.py`` fails on a stale entry).
"""

from __future__ import annotations

_MONITORED = (
    "calls dist.monitored_barrier(), which raises 'ValueError: monitored_barrier is only "
    "implemented for GLOO backend.' for any group whose backend name is not gloo "
    "(distributed_c10d.monitored_barrier); pg.monitored_barrier() itself works on ringcomm "
    "(test_monitored_barrier_gloo_rank_0_timeout passes)"
)

EXCLUDED: dict[str, str] = {
    "test_get_backend": (
        "asserts dist.get_backend() == BACKEND ('gloo'): 'ringcomm' != 'gloo' "
        "(the driver keeps BACKEND='gloo' for the test bodies)"
    ),
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
}

KNOWN_GAPS: dict[str, str] = {}
