"""grouped_gemm and its backward through ``torch._grouped_mm`` (torch's CUTLASS grouped GEMM on
sm_90) beside the Triton kernels of hal_triton.kernels; ``tuned`` times both once per device model
and shape bucket and keeps the faster (the H200 measurements are in backends/cuda/PERF_NOTES.md).

torch._grouped_mm runs its CUTLASS kernel for bfloat16 operands on sm_90 with 16-byte aligned
strides; for anything else torch falls back to one GEMM per group after copying the offsets to the
host, a synchronisation no kernel of this backend makes, so those calls are refused here and the
Triton kernel takes them. K and N must be multiples of 8 (otherwise torch pads the result's rows).
"""

from __future__ import annotations

import torch

from hal.plugin import Archs, Inputs
from hal_torch.gemm import grouped_mm, grouped_mm_backward, grouped_mm_layout
from hal_triton import autotune
from hal_triton.checks import triton_check

from . import TRITON_KERNELS
from ._common import kernel
from ._device import sm_number
from .launch import TABLES

#: where torch._grouped_mm runs its CUTLASS kernel, as tested here (the H200)
CUTLASS_ARCHS = Archs(lambda name: sm_number(name) == 90, "sm_90 (H100/H200: torch's CUTLASS grouped GEMM)")


def _shapes(inputs: Inputs) -> list[str]:
    if not hasattr(torch, "_grouped_mm"):
        return [f"torch {torch.__version__} has no torch._grouped_mm"]
    x, w = inputs["x"], inputs["weight"]
    (rows, k), (groups, _, n) = x.shape, w.shape
    if 0 in (rows, k, n, groups):
        return [f"x {tuple(x.shape)}, weight {tuple(w.shape)}: an empty dimension"]
    return [f"K={k}, N={n}: torch._grouped_mm needs both multiples of 8"] if k % 8 or n % 8 else []


def _forward(inputs: Inputs) -> list[str]:
    return _shapes(inputs) or grouped_mm_layout("x", inputs["x"]) + grouped_mm_layout("weight", inputs["weight"])


def _backward(inputs: Inputs) -> list[str]:
    g, x, w = inputs["grad_out"], inputs["x"], inputs["weight"]
    return _shapes(inputs) or (grouped_mm_layout("grad_out", g) + grouped_mm_layout("weight", w.transpose(1, 2))
                               + grouped_mm_layout("x", x.t()))


@kernel("grouped_gemm", name="grouped_mm", priority=15, dtypes=("bfloat16",), checks=[_forward], archs=CUTLASS_ARCHS)
def grouped_gemm_cutlass(x, weight, group_sizes):
    return grouped_mm(x, weight, group_sizes)


@kernel("grouped_gemm_backward", name="grouped_mm", priority=15, dtypes=("bfloat16",), checks=[_backward],
        archs=CUTLASS_ARCHS)
def grouped_gemm_backward_cutlass(grad_out, x, weight, group_sizes):
    return grouped_mm_backward(grad_out, x, weight, group_sizes)


@kernel("grouped_gemm", name="tuned", priority=40, dtypes=("bfloat16",), checks=[triton_check, _forward],
        archs=CUTLASS_ARCHS)
def grouped_gemm_tuned(x, weight, group_sizes):
    """The faster of torch._grouped_mm and the Triton kernel for this shape bucket."""
    triton = TRITON_KERNELS[("grouped_gemm", "triton")]
    runs = {"grouped_mm": lambda: grouped_mm(x, weight, group_sizes), "triton": lambda: triton(x, weight, group_sizes)}
    flops = 2.0 * x.shape[0] * weight.shape[1] * weight.shape[2]
    return runs[autotune.fastest(TABLES, x.device, autotune.grouped_key("grouped_gemm_route", x, weight), runs, flops)]()


@kernel("grouped_gemm_backward", name="tuned", priority=40, dtypes=("bfloat16",), checks=[triton_check, _backward],
        archs=CUTLASS_ARCHS)
def grouped_gemm_backward_tuned(grad_out, x, weight, group_sizes):
    """The faster of torch._grouped_mm and the Triton kernels for this shape bucket."""
    triton = TRITON_KERNELS[("grouped_gemm_backward", "triton")]
    args = (grad_out, x, weight, group_sizes)
    runs = {"grouped_mm": lambda: grouped_mm_backward(*args), "triton": lambda: triton(*args)}
    flops = 4.0 * x.shape[0] * weight.shape[1] * weight.shape[2]
    return runs[autotune.fastest(TABLES, x.device, autotune.grouped_key("grouped_gemm_backward_route", x, weight), runs, flops)]()
