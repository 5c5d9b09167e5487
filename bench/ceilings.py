"""The two ceilings of a device, measured (not the datasheet's): copy bandwidth, counting bytes read
plus bytes written, and the rate of a large matrix product on random data.

The device's copy bandwidth is measured on buffers well beyond its last-level cache (DRAM or HBM:
the roof of the roofline). A case's "% copy BW" is measured against a copy of its own footprint
(:func:`copy_at`). On the CPU the cases are small (1 to 1.5 MiB moved per call) and their arrays
stay in a cache whose bandwidth is many times DRAM's: on the CI machine's EPYC (32 MiB L3, one
thread, 2026-12-03) a copy moving 1 MiB ran at 68 GB/s, one moving 64 MiB at 7.3 GB/s. Against the
DRAM copy such rows read up to 1266%: they measured the cache, not the kernel. The bytes the cases
count were right (each array read or written once).
"""

from __future__ import annotations

import functools
import glob
from typing import Any, Optional

import torch

from .timing import Timer

#: the CPU's DRAM copy uses at least this many bytes per buffer, and four times its last-level cache
CPU_COPY_BYTES = 64 << 20
#: and at most this many
CPU_COPY_MAX_BYTES = 1 << 30


def measure(device: torch.device, timer: Timer) -> dict[str, Any]:
    """{"copy_bytes_per_s", "matmul_flops_per_s", "matmul_dtype", "cache_bytes", ...} for ``device``."""
    gpu = device.type == "cuda"
    cache = cache_bytes(device)
    n_bytes = (2 << 30) if gpu else min(CPU_COPY_MAX_BYTES, max(CPU_COPY_BYTES, 4 * (cache or 0)))
    t_copy = _copy_us(device, n_bytes, timer)
    n = 8192 if gpu else 1024
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t_mm = timer(lambda: a @ b)["median_us"]
    return {
        "copy_bytes_per_s": 2 * n_bytes / (t_copy * 1e-6),
        "copy_bytes": 2 * n_bytes,
        "cache_bytes": cache,
        "matmul_flops_per_s": 2 * n**3 / (t_mm * 1e-6),
        "matmul_shape": [n, n, n],
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }


def copy_at(device: torch.device, footprint: float, timer: Timer) -> float:
    """Bytes per second (read + written) of a device-to-device copy moving ``footprint`` bytes in
    all (``footprint / 2`` read, as many written): the bandwidth a kernel moving that many bytes
    can reach from wherever they reside, the 100% of its "% copy BW"."""
    half = max(1, int(footprint) // 2)
    return 2 * half / (_copy_us(device, half, timer) * 1e-6)


def cache_bytes(device: torch.device) -> Optional[int]:
    """The device's last-level cache in bytes (a GPU's L2; the CPU's largest cache level by
    sysfs), None where not known."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(size) or None
    return _cpu_cache()


@functools.lru_cache(maxsize=None)
def _cpu_cache() -> Optional[int]:
    best: tuple[int, int] = (0, 0)
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(f"{index}/level") as f:
                level = int(f.read())
            with open(f"{index}/size") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text or 0)
        best = max(best, (level, size))
    return best[1] or None


def _copy_us(device: torch.device, n_bytes: int, timer: Timer) -> float:
    """Median time of a device-to-device copy of ``n_bytes`` (buffers freed on return)."""
    src = torch.randint(0, 255, (n_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))["median_us"]
