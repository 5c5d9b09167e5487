"""Code run in processes spawned by test_cache.py (a spawned process imports its target by module,
so it cannot live in the test file): each one writes many keys into one shared tuning cache."""

from __future__ import annotations

from multiprocessing.synchronize import Barrier
from pathlib import Path

from hal.tuning.cache import TuneCache

DEVICE = "cpu-test-model"
VERSIONS = {"hal": "0.1.0", "torch": "2.11.0"}


def put_keys(directory: str, worker: int, count: int, start: Barrier) -> None:
    """Wait until every worker is ready, then put ``count`` keys of this worker's own."""
    cache = TuneCache(DEVICE, VERSIONS, Path(directory))
    start.wait(timeout=120)
    for i in range(count):
        cache.put(f"w{worker}-k{i}", {"winner": f"worker{worker}", "times_us": {"a": float(i)}, "source": "measured"})
