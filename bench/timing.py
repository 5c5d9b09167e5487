"""Timing a callable: on a GPU, CUDA events around a batch of back-to-back runs (the steady state of
a model, where the host enqueues ahead of the device: host overhead shows only where it exceeds the
device time), L2 flushed before each batch; the host clock on the CPU. The median over several
batches, after a warm-up that also absorbs compilation and autotuning.

A callable that overwrites its own inputs comes with a ``before`` callable that puts them back: then
each run is timed on its own (events around the run; ``before`` and the L2 flush are enqueued ahead
of it, outside the timed region, so the device does not wait on the host between runs)."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from typing import Any, Callable, Optional

import torch

#: bytes written between GPU runs so that no input stays in L2 (50 MB on an H100/H200)
L2_FLUSH_BYTES = 256 << 20
#: a measurement whose spread (:func:`spread`) exceeds this is noisy: its ratios are not to be trusted
NOISY_SPREAD = 0.10


def spread(times: list[float]) -> float:
    """How far a measurement's samples scatter, relative to their median: the interquartile range
    over the median (the middle half of the samples lies within it), or the whole range for fewer
    than four samples. 0.02 reads "within 2%"; above :data:`NOISY_SPREAD` the row is noisy."""
    med = statistics.median(times)
    if med <= 0 or len(times) < 2:
        return 0.0
    if len(times) < 4:
        return (max(times) - min(times)) / med
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / med


class Timer:
    """Measures callables on one device with a fixed time budget per measurement."""

    def __init__(self, device: torch.device, budget_s: float = 0.4, min_reps: int = 5, max_reps: int = 200) -> None:
        self.device = device
        self.budget_s = budget_s
        self.min_reps = min_reps
        self.max_reps = max_reps
        self._flush: Optional[torch.Tensor] = None
        if device.type == "cuda":
            self._flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _batch_gpu(self, fn: Callable[[], Any], n: int) -> float:
        """Mean microseconds per run of n back-to-back runs."""
        assert self._flush is not None
        self._flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / n

    def _once_cpu(self, fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def _each_gpu(self, fn: Callable[[], Any], before: Callable[[], Any], n: int) -> list[float]:
        """Microseconds of each of n runs, ``before()`` and the flush ahead of each, untimed."""
        assert self._flush is not None
        events = []
        for _ in range(n):
            before()
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        events[-1][1].synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in events]

    def _each_cpu(self, fn: Callable[[], Any], before: Callable[[], Any]) -> float:
        before()
        return self._once_cpu(fn)

    def __call__(self, fn: Callable[[], Any], warmup: int = 2, before: Optional[Callable[[], Any]] = None) -> dict[str, float]:
        """{"median_us", "min_us", "reps", "spread"} of ``fn()`` (:func:`spread` over the timed
        samples: single runs on the CPU, batches on a GPU); with ``before``, each run timed on its
        own after ``before()`` (untimed)."""
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
        self._sync()
        if before is not None:
            return self._timed_each(fn, before)
        if self.device.type == "cuda":
            first = self._batch_gpu(fn, 1)
            per_batch = int(max(1, min(50, self.budget_s / 5 * 1e6 / max(first, 1.0))))
            times = [self._batch_gpu(fn, per_batch) for _ in range(5)]
            return {"median_us": statistics.median(times), "min_us": min(times), "reps": 5 * per_batch, "spread": spread(times)}
        first = self._once_cpu(fn)
        reps = int(max(self.min_reps, min(self.max_reps, self.budget_s * 1e6 / max(first, 1.0))))
        times = [first] + [self._once_cpu(fn) for _ in range(reps - 1)]
        return {"median_us": statistics.median(times), "min_us": min(times), "reps": len(times), "spread": spread(times)}


    def _timed_each(self, fn: Callable[[], Any], before: Callable[[], Any]) -> dict[str, float]:
        if self.device.type == "cuda":
            first = self._each_gpu(fn, before, 1)[0]
            reps = int(max(self.min_reps, min(50, self.budget_s * 1e6 / max(first, 1.0))))
            times = self._each_gpu(fn, before, reps)
        else:
            first = self._each_cpu(fn, before)
            reps = int(max(self.min_reps, min(self.max_reps, self.budget_s * 1e6 / max(first, 1.0))))
            times = [first] + [self._each_cpu(fn, before) for _ in range(reps - 1)]
        return {"median_us": statistics.median(times), "min_us": min(times), "reps": len(times), "spread": spread(times)}


def host_overhead_us(fn: Callable[[], Any], calls: int = 2000) -> float:
    """Host time per call of ``fn`` (launches are asynchronous: this is the CPU cost of the call,
    which is what dispatch adds), the best of three rounds."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def print_host_profile(label: str, step: Callable[[], Any], steps: int, sync: Callable[[], None]) -> None:
    """cProfile ``steps`` calls of ``step`` and print, per call, the 25 functions with the most host
    time of their own, then how much of the host time is spent in hal's own modules (its dispatcher,
    kits and backend plugins) rather than torch's: where a compiled step's host time goes."""
    profiler = cProfile.Profile()
    sync()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    sync()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    print(f"\n{label}: cProfile of {steps} steps, per step (own ms, calls, function)")
    for (file, line, name), (calls, _, own, _, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]:
        where = name if file == "~" else f"{'/'.join(file.split('/')[-2:])}:{line} {name}"
        print(f"  {own / steps * 1e3:8.3f} {calls / steps:8.1f}  {where}")
    total = sum(v[2] for v in stats.values())
    in_hal = sum(v[2] for (file, _, _), v in stats.items() if any(p in file for p in ("/hal/", "/hal_backend_", "/kits/")))
    print(f"  host time per step {total / steps * 1e3:.2f} ms (profiled), of which in hal's modules {in_hal / steps * 1e3:.2f} ms")
