"""The two ceilings of a device, measured (not the datasheet's): copy bandwidth, counting bytes read
plus bytes written, and the rate of a large matrix product on random data."""

from __future__ import annotations

from typing import Any

import torch

from .timing import Timer


def measure(device: torch.device, timer: Timer) -> dict[str, Any]:
    """{"copy_bytes_per_s", "matmul_flops_per_s", "matmul_dtype", ...} for ``device``."""
    gpu = device.type == "cuda"
    n_bytes = (2 << 30) if gpu else (64 << 20)
    t_copy = _copy_us(device, n_bytes, timer)
    n = 8192 if gpu else 1024
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t_mm = timer(lambda: a @ b)["median_us"]
    return {
        "copy_bytes_per_s": 2 * n_bytes / (t_copy * 1e-6),
        "copy_bytes": 2 * n_bytes,
        "matmul_flops_per_s": 2 * n**3 / (t_mm * 1e-6),
        "matmul_shape": [n, n, n],
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }


def _copy_us(device: torch.device, n_bytes: int, timer: Timer) -> float:
    """Median time of a device-to-device copy of ``n_bytes`` (buffers freed on return)."""
    src = torch.randint(0, 255, (n_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))["median_us"]
