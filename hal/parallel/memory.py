"""Peak memory of a block of code, on the CPU as on a GPU: how the parallel layers prove their memory bounds.

    with PeakMemory("cpu") as peak:
        loss = vocab_parallel_linear_cross_entropy(x, w, t, group)
        loss.backward()
    print(peak.bytes)   # the most bytes allocated at once inside the block, above what was live before

On a CUDA device this reads the caching allocator's counters (``torch.cuda.max_memory_allocated``
against ``memory_allocated`` at entry). The CPU allocator keeps no such counters, but it reports
every allocation and free to the profiler: with ``profile_memory=True`` each one is a ``[memory]``
event carrying its signed size, so the running sum of those events, in time order, is the bytes
live above the entry level, and its maximum the peak. That counts every tensor the c10 allocator
hands out, temporaries inside kernels included (what a kernel library allocates on its own, e.g.
oneDNN's scratchpads, it does not see).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from hal.errors import InvalidArgumentError


class PeakMemory:
    """Context manager: ``bytes`` is the peak of bytes allocated inside the block (above the level
    at entry); ``events`` the number of allocator events seen (CPU)."""

    def __init__(self, device: Any = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError("PeakMemory", "device", "a CPU or CUDA device", str(device))
        self.bytes = 0
        self.events = 0
        self._profile: Optional[Any] = None
        self._base = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
            return
        assert self._profile is not None
        self._profile.__exit__(*exc)
        cpu = torch._C._autograd.DeviceType.CPU
        events = [(e.start_ns(), e.nbytes()) for e in self._profile.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == cpu]
        events.sort(key=lambda ev: ev[0])
        live = peak = 0
        for _, n in events:
            live += n
            peak = max(peak, live)
        self.bytes, self.events = peak, len(events)
        self._profile = None


__all__ = ["PeakMemory"]
