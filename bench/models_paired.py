"""The comparisons a model row is judged on, timed again side by side (issue 28).

The sweep of ``hal bench --models`` measures the variants of a row one after the other, each built
after the previous one was freed. On a host whose speed drifts (the H200's: an uncaptured compiled
Llama step is host-bound, and torch.compile's step measured 10.35 ms in one process and 13.24 ms in
another), the ratio of two variants measured a minute apart carries that drift. So after the sweep,
the variants of the judged pairs, (``compile``, ``hal+compile``) and (best peer, best hal), are
built again, all alive at once, and timed in alternating rounds (the order rotating every round); a
pair's ratio is the median over the rounds of the ratio within each round.

``row["paired"]``: ``{"rounds", "times_us": {variant: [one median per round]}, "pairs": [{"peer",
"hal", "peer_us", "hal_us", "ratio", "ratio_range"}]}``, or ``{"error"}`` when a rebuild failed (the
sweep's figures then stand alone).
"""

from __future__ import annotations

import statistics
import traceback
from typing import Any, Callable, Optional

from .timing import Timer
from .workload import Step

#: alternating rounds of the side-by-side timing
ROUNDS = 5
#: steps each rebuilt variant runs before its rounds: torch.compile traces (its caches are warm
#: from the sweep), hal.graphs captures after its two warm-up calls, hal's tuning measures
WARMUP_STEPS = 5


def judged_pairs(row: dict[str, Any]) -> list[tuple[str, str]]:
    """The (peer, hal) variant pairs whose ratios targets judge: torch.compile against hal under
    torch.compile, and the row's best peer against its best hal step, where both were measured."""
    measured = {r["variant"] for r in row["variants"] if r.get("step_us")}
    pairs = []
    if {"compile", "hal+compile"} <= measured:
        pairs.append(("compile", "hal+compile"))
    best = row.get("best") or {}
    if best.get("peer") and best.get("hal"):
        pair = (best["peer"]["variant"], best["hal"]["variant"])
        if pair not in pairs:
            pairs.append(pair)
    return pairs


def time_side_by_side(pairs: list[tuple[str, str]], build: Callable[[str], Step], timer: Timer, sync: Callable[[], None],
                      rounds: int = ROUNDS) -> dict[str, Any]:
    """Build each variant of ``pairs`` (a row's :func:`judged_pairs`) with ``build(name)``, warm it
    up and time them all in ``rounds`` alternating rounds; the record of the module docstring."""
    names = list(dict.fromkeys(name for pair in pairs for name in pair))
    steps: dict[str, Step] = {}
    try:
        for name in names:
            steps[name] = build(name)
            for _ in range(WARMUP_STEPS):
                steps[name]()
            sync()
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(timer(steps[name], warmup=1)["median_us"])
    except Exception as exc:  # noqa: BLE001 - the sweep's figures stand; the record says why there is no pair
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]}
    finally:
        steps.clear()
    out = []
    for peer, hal in pairs:
        ratios = [a / b for a, b in zip(times[peer], times[hal])]
        out.append({"peer": peer, "hal": hal, "peer_us": statistics.median(times[peer]), "hal_us": statistics.median(times[hal]),
                    "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]})
    return {"rounds": rounds, "times_us": times, "pairs": out}


def paired_ratio(row: dict[str, Any], peer: Optional[str], hal: Optional[str]) -> Optional[float]:
    """The side-by-side ratio (peer time / hal time) of one pair of the row, or None if not timed so."""
    for pair in (row.get("paired") or {}).get("pairs", []):
        if pair["peer"] == peer and pair["hal"] == hal:
            return pair["ratio"]
    return None
