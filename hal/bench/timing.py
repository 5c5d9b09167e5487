"""Timing a callable: on a GPU, CUDA events around a batch of back-to-back runs (the steady state of
a model, where the host enqueues ahead of the device: host overhead shows only where it exceeds the
device time), L2 flushed before each batch; the host clock on the CPU. The median over several
batches, after a warm-up that also absorbs compilation and autotuning."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch

#: bytes written between GPU runs so that no input stays in L2 (50 MB on an H100/H200)
L2_FLUSH_BYTES = 256 << 20


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

    def __call__(self, fn: Callable[[], Any], warmup: int = 2) -> dict[str, float]:
        """{"median_us", "min_us", "reps"} of ``fn()``."""
        for _ in range(warmup):
            fn()
        self._sync()
        if self.device.type == "cuda":
            first = self._batch_gpu(fn, 1)
            per_batch = int(max(1, min(50, self.budget_s / 5 * 1e6 / max(first, 1.0))))
            times = [self._batch_gpu(fn, per_batch) for _ in range(5)]
            return {"median_us": statistics.median(times), "min_us": min(times), "reps": 5 * per_batch}
        first = self._once_cpu(fn)
        reps = int(max(self.min_reps, min(self.max_reps, self.budget_s * 1e6 / max(first, 1.0))))
        times = [first] + [self._once_cpu(fn) for _ in range(reps - 1)]
        return {"median_us": statistics.median(times), "min_us": min(times), "reps": len(times)}


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
