"""quantize, dequantize, fake_quantize (+ backward): Triton elementwise kernels in float32
arithmetic (see hal.triton.quant); int8_linear: cuBLASLt int8 GEMM (torch._int_mm, operands in the
TN layout it runs fast in) + a Triton dequantising epilogue, or one Triton int8 GEMM with the
epilogue fused; ``tuned`` times both once per device and shape bucket and keeps the faster."""

from __future__ import annotations

import dataclasses

import torch

from hal.plugin import Inputs

from . import autotune, launch
from ._common import FLOATS, family, kernel

QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}
QDTYPES = {"int8": torch.int8, "uint8": torch.uint8}
OUT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@kernel("quantize", name="triton", priority=20, dtypes=FLOATS, triton=True)
def quantize(x, scale, zero_point, axis, dtype):
    qmin, qmax = QRANGE[dtype]
    return family("quant").quantize(x, scale, zero_point, axis, QDTYPES[dtype], qmin, qmax, **launch.elementwise(x))


@kernel("dequantize", name="triton", priority=20, dtypes=("int8", "uint8"), triton=True)
def dequantize(q, scale, zero_point, axis):
    out = scale.dtype if isinstance(scale, torch.Tensor) else torch.float32
    return family("quant").dequantize(q, scale, zero_point, axis, out, **launch.elementwise(q))


@kernel("fake_quantize", name="triton", priority=20, dtypes=FLOATS, triton=True)
def fake_quantize(x, scale, zero_point, quant_min, quant_max, axis):
    return family("quant").fake_quantize(x, scale, zero_point, quant_min, quant_max, axis, **launch.elementwise(x))


@kernel("fake_quantize_backward", name="triton", priority=20, dtypes=FLOATS, triton=True)
def fake_quantize_backward(grad_out, x, scale, zero_point, quant_min, quant_max, axis):
    return family("quant").fake_quantize_backward(grad_out, x, scale, zero_point, quant_min, quant_max, axis, **launch.elementwise(x))


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


@kernel("int8_linear", name="cublaslt", priority=30, triton=True, checks=[_int_mm_shapes])
def int8_linear_cublaslt(x_q, w_q, x_scale, w_scale, bias, out_dtype):
    k = x_q.shape[-1]
    acc = torch._int_mm(x_q.reshape(-1, k).contiguous(), w_q.contiguous().t())  # A row-major, B column-major
    out = family("quant").int32_dequant(acc, x_scale, w_scale, bias, OUT_DTYPES[out_dtype], **launch.elementwise(acc))
    return out.view(*x_q.shape[:-1], w_q.shape[0])


@kernel("int8_linear", name="triton", priority=20, triton=True)
def int8_linear_triton(x_q, w_q, x_scale, w_scale, bias, out_dtype):
    gemm = family("gemm")
    x2 = x_q.reshape(-1, x_q.shape[-1])
    m, k = x2.shape
    n = w_q.shape[0]
    out = OUT_DTYPES[out_dtype]
    if x_q.device.type == "cuda":
        key = f"int8_linear/m{autotune.bucket(m)}/k{k}/n{n}"
        cfg = autotune.choose(x_q.device, key, launch.INT8_CANDIDATES,
                              lambda c: gemm.int8_linear(x2, w_q, x_scale, w_scale, bias, out, c), 2.0 * m * n * k)
    else:
        cfg = launch.CPU_INT8_GEMM
    return gemm.int8_linear(x2, w_q, x_scale, w_scale, bias, out, cfg).view(*x_q.shape[:-1], n)


@dataclasses.dataclass(frozen=True)
class Path:
    """A choice between kernels, cached by the autotuner like a tile configuration."""

    name: str


_INT8_PATHS = (Path("cublaslt"), Path("triton"))


@kernel("int8_linear", name="tuned", priority=40, triton=True, checks=[_int_mm_shapes])
def int8_linear_tuned(x_q, w_q, x_scale, w_scale, bias, out_dtype):
    args = (x_q, w_q, x_scale, w_scale, bias, out_dtype)
    paths = {"cublaslt": int8_linear_cublaslt, "triton": int8_linear_triton}
    m = x_q.numel() // x_q.shape[-1]
    k, n = x_q.shape[-1], w_q.shape[0]
    key = f"int8_linear_path/m{autotune.bucket(m)}/k{k}/n{n}/{out_dtype}"
    path = autotune.choose(x_q.device, key, _INT8_PATHS, lambda p: paths[p.name](*args), 2.0 * m * n * k)
    return paths[path.name](*args)
