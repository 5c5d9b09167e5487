"""int8_linear through cuBLASLt: its int8 GEMM (torch._int_mm, operands in the TN layout it runs
fast in) + a Triton dequantising epilogue; ``tuned`` times it against the one-kernel Triton int8
GEMM of hal_triton.kernels once per device and shape bucket and keeps the faster. (quantize,
dequantize and fake_quantize are Triton's alone, registered by hal_triton.kernels.)"""

from __future__ import annotations

import torch

from hal.plugin import Inputs
from hal_triton import autotune
from hal_triton.checks import triton_check
from hal_triton.kernels import int32_dequant

from . import TRITON_KERNELS
from ._common import kernel
from .launch import TABLES


def _int_mm_shapes(inputs: Inputs) -> list[str]:
    x, w = inputs["x_q"], inputs["w_q"]
    m = x.numel() // int(x.shape[-1])
    k, n = int(x.shape[-1]), int(w.shape[0])
    reasons = []
    if m <= 16:
        reasons.append(f"{m} rows; torch._int_mm needs more than 16")
    if k % 8 or n % 8:
        reasons.append(f"K={k}, N={n}; torch._int_mm needs both multiples of 8")
    return reasons


@kernel("int8_linear", name="cublaslt", priority=30, checks=[triton_check, _int_mm_shapes])
def int8_linear_cublaslt(x_q, w_q, x_scale, w_scale, bias, out_dtype):
    k = x_q.shape[-1]
    acc = torch._int_mm(x_q.reshape(-1, k).contiguous(), w_q.contiguous().t())  # A row-major, B column-major
    out = int32_dequant(TABLES, acc, x_scale, w_scale, bias, out_dtype)
    return out.view(*x_q.shape[:-1], w_q.shape[0])


@kernel("int8_linear", name="tuned", priority=40, checks=[triton_check, _int_mm_shapes])
def int8_linear_tuned(x_q, w_q, x_scale, w_scale, bias, out_dtype):
    args = (x_q, w_q, x_scale, w_scale, bias, out_dtype)
    triton = TRITON_KERNELS[("int8_linear", "triton")]
    runs = {"cublaslt": lambda: int8_linear_cublaslt(*args), "triton": lambda: triton(*args)}
    m = x_q.numel() // x_q.shape[-1]
    k, n = x_q.shape[-1], w_q.shape[0]
    key = f"int8_linear_path/m{autotune.bucket(m)}/k{k}/n{n}/{out_dtype}"
    return runs[autotune.fastest(TABLES, x_q.device, key, runs, 2.0 * m * n * k)]()
