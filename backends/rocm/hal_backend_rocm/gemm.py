"""linear through hipBLASLt and matmul through hipBLAS (torch's ROCm build).

linear has three kernels: ``hipblaslt`` here (``torch._addmm_activation``: hipBLASLt's GEMM with
the bias and relu or gelu_tanh as its epilogue; none as a plain GEMM with the bias), and from
hal_triton.kernels ``hipblas_triton`` (the library GEMM with the bias, then the activation in
place by one Triton pass, any activation) and ``triton`` (a Triton GEMM with bias and activation
applied to the accumulator before its only store, autotuned tiles). Where torch's build has no
hipBLASLt for the device it runs the GEMM on rocBLAS and the activation as a separate pass, which
computes the same function. grouped_gemm is Triton's alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hal.plugin import Inputs
from hal.plugin_sdk.linear import add_product_in_slices

from ._common import FLOATS, NOT_F64, eager_kernel, ieee_fp32, kernel

#: activations hipBLASLt applies as a GEMM epilogue through torch._addmm_activation
EPILOGUE_ACTS = ("none", "relu", "gelu_tanh")


def blas_linear(x2: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """The library GEMM with the bias, IEEE float32 for float32 data (the kit's ``hipblas_triton`` linear)."""
    with ieee_fp32(x2):
        return F.linear(x2, weight, bias)


_MM_F32_OUT: dict[str, bool] = {}


def gemm_f32(a: torch.Tensor, b: torch.Tensor, acc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` returned in float32 (float64 for float64): half-precision operands go to the
    library as they are with float32 output (``torch.mm(..., out_dtype=)``) where torch's build has
    that kernel for the device (asked once), else upcast; float32 in IEEE float32. Given ``acc``,
    the product is added into it (through temporaries of at most ``SLICE_ELEMENTS``) and ``acc``
    returned."""
    if acc is not None:
        return add_product_in_slices(acc, a, b, gemm_f32)
    if a.dtype in (torch.float16, torch.bfloat16):
        key = str(a.device)
        if a.device.type == "cuda" and _MM_F32_OUT.get(key, True):
            try:
                out = torch.mm(a, b, out_dtype=torch.float32)
                _MM_F32_OUT[key] = True
                return out
            except (RuntimeError, NotImplementedError, TypeError):
                _MM_F32_OUT[key] = False
        return torch.mm(a.float(), b.float())
    with ieee_fp32(a):
        return torch.mm(a, b)


def _epilogue(inputs: Inputs) -> list[str]:
    act = inputs["act"]
    return [] if act in EPILOGUE_ACTS else [f"act {act!r} has no hipBLASLt epilogue ({', '.join(EPILOGUE_ACTS)})"]


@kernel("linear", name="hipblaslt", priority=30, dtypes=NOT_F64, checks=[_epilogue])
def linear_hipblaslt(x, weight, bias, act):
    x2 = x.reshape(-1, x.shape[-1])
    n = weight.shape[0]
    with ieee_fp32(x):
        if act == "none":
            y = F.linear(x2, weight, bias)
        else:
            b = bias if bias is not None else x2.new_zeros(n)
            y = torch._addmm_activation(b, x2, weight.t(), use_gelu=act == "gelu_tanh")
    return y.view(*x.shape[:-1], n)


eager_kernel("matmul", name="hipblas", priority=10, dtypes=FLOATS)
eager_kernel("matmul_backward", name="hipblas", priority=10, dtypes=FLOATS)
