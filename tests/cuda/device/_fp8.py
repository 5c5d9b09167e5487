"""What the FP8 device tests share: the vendor plugin's Triton kernels, the formats this GPU has
and a poisoned allocator (imported by test_fp8_kernels, test_fp8_amax_fusion and
test_fp8_small_tiles; their fixtures ``fmts`` and ``gen`` are in this folder's conftest.py; nothing
here runs without a CUDA device)."""

from __future__ import annotations

from typing import Any

import torch

from hal.ops.fp8 import FORMATS

if torch.cuda.is_available():
    from hal.plugin_sdk.fp8_hardware import fp8_device

    if getattr(torch.version, "hip", None):
        from hal_backend_rocm import plugin
    else:
        from hal_backend_cuda import plugin

DEV = torch.device("cuda")


def formats() -> list[str]:
    """The formats this GPU has (none: every test asking for them is skipped with the reason)."""
    return [f for f in FORMATS if not fp8_device(DEV, [f])]


def kern(op: str) -> Any:
    """The vendor plugin's Triton kernel of ``op``."""
    return next(k.fn for k in plugin.kernels if k.op == op and k.name == "triton")


def poison() -> None:
    """Fill memory the caching allocator is about to hand out with a byte pattern (0x7E: a large
    finite code, NaN-free floats), so outputs a kernel fails to write show up as wrong values."""
    junk = torch.full((64 << 20,), 0x7E, dtype=torch.uint8, device=DEV)
    del junk
