"""FP8 in eager PyTorch: torch's FP8 casts (``Tensor.to(torch.float8_*)``) for quantisation and
dequantisation, ``torch._scaled_mm`` for the scaled GEMM with per-tensor scales of the OCP formats,
and a dequantise-then-matmul emulation in float32 for the other granularities and formats.

Values travel as uint8 bit patterns (ops/fp8.py), viewed as torch's FP8 dtypes without a copy.
torch's casts round to nearest even but do not saturate in every format (e4m3fnuz turns 300 into
NaN) and keep the sign of a NaN, so quantisation clamps first and writes the canonical NaN after.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from hal.plugin_sdk.arrays import torch_dtype
from hal.ops.fp8 import FORMATS, TORCH_DTYPE_NAMES
from hal.plugin_sdk.fp8_hardware import FP8_CHECKS as CHECKS  # noqa: F401  (read by hal_torch.table)

Scalar = Union[float, torch.Tensor]


def fp8_dtype(fmt: str) -> torch.dtype:
    """torch's dtype of an FP8 format."""
    return getattr(torch, TORCH_DTYPE_NAMES[fmt])


def encode(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 bit patterns of float32 ``v``: round to nearest even, saturating, canonical NaN."""
    f = FORMATS[fmt]
    bits = v.clamp(-f.max_finite, f.max_finite).to(fp8_dtype(fmt)).view(torch.uint8)
    return torch.where(torch.isnan(v), torch.full_like(bits, f.nan_bits), bits)


def decode(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 values of uint8 bit patterns (exact)."""
    return q.contiguous().view(fp8_dtype(fmt)).float()


def expand(scale: torch.Tensor, shape: torch.Size, block_size: int) -> torch.Tensor:
    """float32 scales of any granularity broadcast over an array of ``shape`` (block scales
    repeated over their tiles, cropped at the edges)."""
    s = scale.float()
    if s.dim() >= 2 and len(shape) >= 2 and tuple(s.shape[-2:]) != (shape[-2], 1):
        s = s.repeat_interleave(block_size, -2).repeat_interleave(block_size, -1)[..., : shape[-2], : shape[-1]]
    return s.expand(shape)


def amax(x32: torch.Tensor, granularity: str, block_size: int) -> torch.Tensor:
    """max |x| per group (NaN propagates, 0 for an empty group) in the scales' shape."""
    a = x32.abs()
    if granularity == "tensor":
        return a.amax() if a.numel() else a.new_zeros(())
    if granularity == "row":
        return a.amax(-1, keepdim=True) if a.shape[-1] else a.new_zeros(a.shape[:-1] + (1,))
    m, k = a.shape[-2:]
    mb, kb = -(-m // block_size), -(-k // block_size)
    padded = F.pad(a, (0, kb * block_size - k, 0, mb * block_size - m))
    tiles = padded.reshape(a.shape[:-2] + (mb, block_size, kb, block_size))
    return tiles.amax(dim=(-3, -1)) if tiles.numel() else a.new_zeros(a.shape[:-2] + (mb, kb))


def fp8_quantize(x: torch.Tensor, format: str, granularity: str, scale: Optional[torch.Tensor], block_size: int) -> tuple:
    x32 = x.float()
    if scale is None:
        scale = _current_scale(amax(x32, granularity, block_size), format)
    else:
        scale = scale.float().clone()
    return encode(x32 / expand(scale, x32.shape, block_size), format).contiguous(), scale.contiguous()


def fp8_quantize_transpose(x: torch.Tensor, format: str, granularity: str, scale: Optional[torch.Tensor], block_size: int) -> tuple:
    """fp8_quantize of x and of x.mT (given scales: the same 0-d scale, or the block scales transposed)."""
    q, s = fp8_quantize(x, format, granularity, scale, block_size)
    scale_t = None if scale is None else (scale if granularity == "tensor" else scale.mT)
    q_t, s_t = fp8_quantize(x.mT, format, granularity, scale_t, block_size)
    return q, s, q_t, s_t


def fp8_quantize_amax(x: torch.Tensor, scale: torch.Tensor, format: str) -> tuple:
    """fp8_quantize with the given per-tensor scale, and the tensor's amax (a separate reduction
    here: eager torch has no cast that reduces)."""
    x32 = x.float()  # fp8_quantize works on float32 too: the same codes, one conversion for both
    q, s = fp8_quantize(x32, format, "tensor", scale, 128)
    return q, s, amax(x32, "tensor", 128).contiguous()


def fp8_quantize_transpose_amax(x: torch.Tensor, scale: torch.Tensor, format: str) -> tuple:
    """fp8_quantize_transpose's q, scale and q_t with the given per-tensor scale, and the amax."""
    x32 = x.float()
    q, s, q_t, _ = fp8_quantize_transpose(x32, format, "tensor", scale, 128)
    return q, s, q_t, amax(x32, "tensor", 128).contiguous()


def _current_scale(group: torch.Tensor, format: str) -> torch.Tensor:
    """``amax / max_finite`` (a device tensor divisor: an IEEE division), 1 where amax is 0."""
    s = group / torch.tensor(FORMATS[format].max_finite, dtype=torch.float32, device=group.device)
    return torch.where(group == 0, torch.ones_like(s), s)


def fp8_quantize_from_amax(x: torch.Tensor, amax: torch.Tensor, format: str) -> tuple:
    """fp8_quantize with the current scale of the given amax."""
    return fp8_quantize(x, format, "tensor", _current_scale(amax.float(), format), 128)


def fp8_quantize_transpose_from_amax(x: torch.Tensor, amax: torch.Tensor, format: str) -> tuple:
    """fp8_quantize_transpose's q, scale and q_t with the current scale of the given amax."""
    q, s, q_t, _ = fp8_quantize_transpose(x, format, "tensor", _current_scale(amax.float(), format), 128)
    return q, s, q_t


def fp8_dequantize(q: torch.Tensor, scale: Scalar, format: str, block_size: int, out_dtype: str) -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (decode(q, format) * expand(s, q.shape, block_size)).to(torch_dtype(out_dtype))


def fp8_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    a_format: str,
    b_format: str,
    out_dtype: str,
    block_size: int,
) -> torch.Tensor:
    scaled_mm = getattr(torch, "_scaled_mm", None)
    ocp = a_format in ("e4m3fn", "e5m2") and b_format in ("e4m3fn", "e5m2") and (a_format, b_format) != ("e5m2", "e5m2")
    if scaled_mm is not None and a.device.type == "cpu" and ocp and a_scale.dim() == 0 and b_scale.dim() == 0 and min(a.shape + b.shape) > 0:
        # per-tensor scales on the CPU: torch's own FP8 GEMM (float32 out; the bias added in float32,
        # then one rounding). GPUs get their own kernels (cuBLASLt / hipBLASLt); there this emulates.
        out = scaled_mm(a.contiguous().view(fp8_dtype(a_format)), b.contiguous().view(fp8_dtype(b_format)).t(),
                        a_scale.float(), b_scale.float(), out_dtype=torch.float32)
    else:
        da = decode(a, a_format) * expand(a_scale, a.shape, block_size)
        db = decode(b, b_format) * expand(b_scale, b.shape, block_size)
        out = da @ db.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(torch_dtype(out_dtype))


__all__ = ["fp8_quantize", "fp8_quantize_transpose", "fp8_quantize_amax", "fp8_quantize_transpose_amax", "fp8_quantize_from_amax",
           "fp8_quantize_transpose_from_amax", "fp8_dequantize", "fp8_scaled_mm"]
