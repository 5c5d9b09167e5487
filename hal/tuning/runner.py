"""``hal.tune(step, *args)``: measure a step's kernel choices now, before the step is timed or
captured, so that later calls (and later processes, through the per-device cache) pay nothing.

The step runs once with measured choice on, whatever ``HAL_TUNE`` says: every call in it that
several routes could serve and that no cache answers is timed on its own inputs
(:mod:`hal.dispatch.measure`); its results go to the device's tune cache. The report lists each
measurement and what the tuning cost.

    report = hal.tune(train_step, x, y)            # once, e.g. before hal.graphs.graphed(train_step)
    print(report)                                  # op, context, winner, each route's time
    with hal.graphs.device_bound():                # choices for steps replayed from a CUDA graph
        hal.tune(train_step, x, y)
    with hal.tuning.for_compile():                 # what torch.compile graphs of the step take
        hal.tune(train_step, x, y)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator

from hal import config
from hal.dispatch import DISPATCHER
from hal.dispatch.measure import LOG, Measurement


@dataclasses.dataclass
class TuneReport:
    """What one :func:`tune` run measured, and what it cost."""

    #: every measurement made during the step, in order (none where the cache answered everything).
    measurements: list[Measurement]
    #: wall-clock seconds of the whole step, measurements included.
    seconds: float
    #: of which, seconds spent measuring (the calls' own, not counting twice those made inside
    #: another's, such as the backward op's decision while a training call's routes were timed).
    measuring_seconds: float
    #: what the step returned.
    result: Any = None

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready row per measurement."""
        return [{"key": m.key, "context": m.context, "winner": m.winner, "seconds": round(m.spent_s, 4),
                 "times_us": {label: (round(t, 2) if t != float("inf") else None) for label, t in m.times_us}}
                for m in self.measurements]

    def __str__(self) -> str:
        lines = [f"hal.tune: {len(self.measurements)} calls measured in {self.measuring_seconds:.2f} s "
                 f"(the step took {self.seconds:.2f} s in all)"]
        for m in self.measurements:
            op, rest = m.key.split("|", 1)
            times = ", ".join(f"{label} {t:.1f} us" if t != float("inf") else f"{label} raised" for label, t in m.times_us)
            lines.append(f"  {op} [{m.context}] -> {m.winner}: {times}  ({rest.split('|', 1)[-1]})")
        return "\n".join(lines)


def tune(step: Callable[..., Any], *args: Any, **kwargs: Any) -> TuneReport:
    """Run ``step(*args, **kwargs)`` once with measured choice on, and report what was measured.

    Decisions cached before the call are dropped afterwards, so later calls take the measured
    choices (a step tuned under :func:`hal.graphs.device_bound` measures device time, as replays of
    a CUDA graph pay)."""
    if not callable(step):
        from hal.errors import InvalidArgumentError

        raise InvalidArgumentError("hal.tune", "step", "a callable (the step to run once, measuring its kernel choices)",
                                   f"{type(step).__name__} {step!r}"[:200])
    first = len(LOG)
    started = time.perf_counter()
    with config.scope(tune="on"):
        result = step(*args, **kwargs)
    seconds = time.perf_counter() - started
    DISPATCHER.forget_plans()
    measured = list(LOG[first:])
    return TuneReport(measured, seconds, sum(m.spent_s for m in measured if not m.nested), result)


@contextlib.contextmanager
def for_compile() -> Iterator[None]:
    """Calls made inside measure, besides their own choice, what a torch.compile graph of them
    should run: where a call's kernel would be an opaque node in the graph and a kernel made of
    torch's ops could run it too, the two are timed (the latter compiled by ``torch.compile``) and
    the winner kept in the tune cache (context ``compiled``), which graphs traced later read
    (:mod:`hal.integration.compile`). Use it around :func:`tune`; it costs one compilation per
    such call."""
    with config.scope(for_compile=True):
        yield
