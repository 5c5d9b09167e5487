"""int8 quantisation in eager PyTorch: QuantizeLinear / DequantizeLinear as float32 tensor math,
``torch.fake_quantize_per_tensor_affine`` / ``_per_channel_affine`` (gradient by autograd), and an
int8 GEMM on ``torch._int_mm`` where it applies."""

from __future__ import annotations

from typing import Optional, Union

import torch

from hal.plugin_sdk.arrays import torch_dtype

Scalar = Union[float, int, torch.Tensor]
QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}


def _qparam(v: Scalar, x: torch.Tensor, axis: Optional[int], dtype: torch.dtype) -> torch.Tensor:
    """A scale or zero point as a ``dtype`` tensor on x's device broadcasting against x: one value,
    or one per channel along ``axis``."""
    t = torch.as_tensor(v, device=x.device).to(dtype)
    if axis is None:
        return t.reshape(())
    shape = [1] * x.ndim
    shape[axis] = -1
    return t.reshape(shape)


def quantize(x: torch.Tensor, scale: Scalar, zero_point: Scalar, axis: Optional[int], dtype: str) -> torch.Tensor:
    lo, hi = QRANGE[dtype]
    q = torch.round(x.float() / _qparam(scale, x, axis, torch.float32)) + _qparam(zero_point, x, axis, torch.float32)
    return q.nan_to_num_(nan=hi).clamp_(lo, hi).to(torch_dtype(dtype))  # NaN: the top code, as torch (ops/quant.py)


def dequantize(q: torch.Tensor, scale: Scalar, zero_point: Scalar, axis: Optional[int]) -> torch.Tensor:
    codes = q.to(torch.int32) - _qparam(zero_point, q, axis, torch.int32)
    out = codes.float() * _qparam(scale, q, axis, torch.float32)
    return out.to(scale.dtype if isinstance(scale, torch.Tensor) else torch.float32)


def fake_quantize(
    x: torch.Tensor, scale: Scalar, zero_point: Scalar, quant_min: int, quant_max: int, axis: Optional[int]
) -> torch.Tensor:
    # torch takes float32 scales and int32 zero points: 0-d per tensor, (channels,) per channel.
    s = torch.as_tensor(scale, device=x.device).to(torch.float32).reshape(-1)
    z = torch.as_tensor(zero_point, device=x.device).to(torch.int32).reshape(-1)
    if axis is None:
        return torch.fake_quantize_per_tensor_affine(x, s.reshape(()), z.reshape(()), quant_min, quant_max)
    if x.numel() == 0:  # torch's per-channel op reduces over the zero points, which fails for none
        return x.clone()
    channels = x.shape[axis]
    return torch.fake_quantize_per_channel_affine(x, s.expand(channels), z.expand(channels), axis, quant_min, quant_max)


def fake_quantize_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    scale: Scalar,
    zero_point: Scalar,
    quant_min: int,
    quant_max: int,
    axis: Optional[int],
) -> torch.Tensor:
    with torch.enable_grad():
        xl = x.detach().requires_grad_(True)
        (grad_x,) = torch.autograd.grad(fake_quantize(xl, scale, zero_point, quant_min, quant_max, axis), xl, grad_out)
    return grad_x


def _int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of int8 matrices accumulated exactly in int32.

    ``torch._int_mm`` where it applies: on the CPU for K > 1 (torch 2.13 returns garbage for K = 1
    there), on CUDA for M > 16 with K and N multiples of 8. Otherwise an int32 matmul on the CPU,
    and a float64 one on devices without integer GEMM, which is exact here (each product is below
    2**14 and the sums stay far below 2**53).
    """
    m, k = a.shape
    n = b.shape[1]
    if a.device.type == "cpu":
        return torch._int_mm(a, b) if k > 1 else a.int() @ b.int()
    if m > 16 and k % 8 == 0 and n % 8 == 0:
        return torch._int_mm(a, b)
    return (a.double() @ b.double()).to(torch.int32)


def int8_linear(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: Scalar,
    w_scale: Scalar,
    bias: Optional[torch.Tensor],
    out_dtype: str,
) -> torch.Tensor:
    """Rows that x_q repeats by broadcasting (stride 0: an expanded view) are multiplied once and the
    result expanded: work and memory stay proportional to the rows x_q holds. The epilogue is one
    pass over the int32 products (the two scales multiplied first: 0.39 against 0.96 ms for four
    passes at (2048, 1024) on the 2-core EPYC VM, 2026-12-02)."""
    lead = tuple(x_q.shape[:-1])
    held = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None) for size, stride in zip(lead, x_q.stride()[:-1]))
    base = x_q[held].contiguous()
    acc = _int8_matmul(base.reshape(base.shape[:-1].numel(), x_q.shape[-1]), w_q.t())
    x_s = torch.as_tensor(x_scale, device=x_q.device).float().reshape(())
    w_s = torch.as_tensor(w_scale, device=x_q.device).float().reshape(-1)
    scale = x_s * w_s  # one float32 factor per output column
    out = acc * scale if bias is None else torch.addcmul(bias.float(), acc, scale)  # int32 in, float32 out: one pass
    out = out.to(torch_dtype(out_dtype)).reshape(*base.shape[:-1], w_q.shape[0])
    return out.expand(*lead, w_q.shape[0]).contiguous()


__all__ = ["quantize", "dequantize", "fake_quantize", "fake_quantize_backward", "int8_linear"]
