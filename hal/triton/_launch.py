"""Host-side helpers shared by the kernel families: dtype maps, sizes, launches.

Entry kernels declare the integer arguments that Triton must not specialise on (sizes and strides
whose value 1 or divisibility by 16 buys nothing): every specialisation is a separate compilation,
and a conformance run meets hundreds of shapes.
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from .config import cdiv, next_pow2  # noqa: F401  (re-exported for the kernel families)

#: torch dtype -> Triton element type (for pointers cast from integer addresses, and outputs).
TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int8: tl.int8,
    torch.uint8: tl.uint8,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}


def compute_dtype(dtype: torch.dtype) -> Any:
    """The arithmetic type of a kernel for inputs of ``dtype``: float64 stays float64, every other
    floating type computes in float32 (half-precision inputs are rounded once, at the store)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def torch_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch twin of :func:`compute_dtype` (for partial-sum buffers)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def launch(kernel: Any, grid: Sequence[int], *args: Any, num_warps: int = 4, num_stages: int = 2, fp_fusion: bool = True, **constexprs: Any) -> None:
    """Launch ``kernel`` on ``grid`` with its runtime ``args`` and ``constexprs``.

    ``fp_fusion=False`` forbids contracting a multiply and an add into one FMA, for kernels whose
    rounding must match a reference bit for bit (quantisation).
    """
    kernel[tuple(grid)](*args, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=fp_fusion, **constexprs)


_F32 = struct.Struct("f")


def split_f64(v: float) -> tuple[float, float]:
    """v as two float32 numbers whose sum, in float64, is v to about 48 bits (kernels get Python
    floats as float32, too coarse for float64 statistics and epsilons)."""
    hi = _F32.unpack(_F32.pack(v))[0]  # round to float32 (struct: no tensor on the hot path)
    return hi, v - hi


def bf16_dot_workaround(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands of ``dtype`` must be upcast to float32 first: the Triton interpreter
    (3.9) multiplies bfloat16 tiles wrongly. The upcast products are exact, so results agree with a
    compiled bfloat16 dot with float32 accumulation; compiled kernels never take this path."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)
