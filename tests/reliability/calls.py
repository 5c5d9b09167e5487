"""Counting the op calls the property-based tests generate, and judging each one's outcome.

Every generated call goes through :func:`outcome`, which runs it, counts it, and classifies how it
ended: a result, a ``hal.HalError``, or anything else (a raw exception: a bug). The session summary
(``conftest.py``) prints the counts, the number the issue asks CI to report.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import hal

#: outcome -> number of generated calls that ended so, over the whole test session.
COUNTS: collections.Counter = collections.Counter()


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """Run one generated call: ("result", value) or ("hal_error", the error); any other exception
    is counted as "raw" and re-raised, so the test fails with its traceback."""
    try:
        value = call()
    except hal.HalError as exc:
        COUNTS["hal_error"] += 1
        return "hal_error", exc
    except BaseException:
        COUNTS["raw"] += 1
        raise
    COUNTS["result"] += 1
    return "result", value


def summary() -> str:
    total = sum(COUNTS.values())
    parts = ", ".join(f"{COUNTS[k]} {k.replace('_', ' ')}" for k in ("result", "hal_error", "raw"))
    return f"hal property tests: {total} generated op calls ({parts})"
