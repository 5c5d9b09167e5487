"""FP8 quantisation, dequantisation and the scaled GEMM, emulating each format exactly.

Encoding does not trust any library's cast: it rounds to the nearest of the format's values, as
decoded from their bit patterns by ``hal.ops.fp8.format_values``, ties to the even bit pattern
(the even mantissa), saturating at the largest finite value. The float32 steps of ops/fp8.py
(amax, scale, division) are done in float32, step by step, so results match to the bit.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from hal.plugin_sdk.arrays import numpy_dtype
from hal.ops.fp8 import FORMATS, format_values

from ._common import f64, reference

_TABLES: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _positive_table(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(bit patterns, values) of the format's finite values >= 0, ascending (code order)."""
    if fmt not in _TABLES:
        values = format_values(fmt)[:128]
        codes = np.flatnonzero(np.isfinite(values))
        _TABLES[fmt] = codes.astype(np.uint8), values[codes]
    return _TABLES[fmt]


def encode(v: np.ndarray, fmt: str) -> np.ndarray:
    """The bit patterns of float values ``v`` in ``fmt``: round to nearest, ties to even,
    saturating (infinities included) at the largest finite value; NaN becomes the canonical NaN;
    the fnuz formats have no negative zero."""
    f = FORMATS[fmt]
    codes, table = _positive_table(fmt)
    v = np.asarray(v, dtype=np.float64)
    a = np.minimum(np.abs(v), table[-1])  # saturation; NaN stays NaN
    finite_a = np.where(np.isnan(a), 0.0, a)
    hi = np.clip(np.searchsorted(table, finite_a, side="left"), 0, len(table) - 1)
    lo = np.maximum(hi - 1, 0)
    below, above = finite_a - table[lo], table[hi] - finite_a
    even = np.where(codes[lo] % 2 == 0, lo, hi)
    pick = np.where(below < above, lo, np.where(above < below, hi, even))
    out = codes[pick]
    negative = np.signbit(v) if not f.fnuz else (np.signbit(v) & (out != 0))
    out = np.where(negative, out | np.uint8(0x80), out)
    return np.where(np.isnan(v), np.uint8(f.nan_bits), out).astype(np.uint8)


def decode(q: np.ndarray, fmt: str) -> np.ndarray:
    """The float32 values of bit patterns ``q`` (every FP8 value is exact in float32)."""
    return format_values(fmt).astype(np.float32)[np.asarray(q, dtype=np.intp)]


def expand(scale: Any, shape: tuple[int, ...], block_size: int) -> np.ndarray:
    """float32 scales of any granularity broadcast to every element of an array of ``shape``."""
    s = np.asarray(scale, dtype=np.float32)
    if s.ndim >= 2 and len(shape) >= 2 and s.shape[-2:] != (shape[-2], 1) and s.shape != ():
        # block scales: each one repeated over its tile, the tiles at the edges cropped
        s = np.repeat(np.repeat(s, block_size, axis=-2), block_size, axis=-1)[..., : shape[-2], : shape[-1]]
    return np.broadcast_to(s, shape)


def amax(x32: np.ndarray, granularity: str, block_size: int) -> np.ndarray:
    """max |x| per group (NaN propagates; 0 for an empty group), as float32 in the scales' shape."""
    a = np.abs(x32)
    if granularity == "tensor":
        return np.max(a, initial=np.float32(0)).astype(np.float32).reshape(())
    if granularity == "row":
        return np.max(a, axis=-1, keepdims=True, initial=np.float32(0)).astype(np.float32)
    m, k = a.shape[-2:]
    mb, kb = -(-m // block_size), -(-k // block_size)
    padded = np.zeros(a.shape[:-2] + (mb * block_size, kb * block_size), dtype=np.float32)
    padded[..., :m, :k] = a
    tiles = padded.reshape(a.shape[:-2] + (mb, block_size, kb, block_size))
    return np.max(tiles, axis=(-3, -1), initial=np.float32(0)).astype(np.float32)


def current_scale(group_amax: np.ndarray, fmt: str) -> np.ndarray:
    """``amax / max_finite`` in float32, 1 where amax is 0 (NaN and infinite amax propagate)."""
    s = (group_amax / np.float32(FORMATS[fmt].max_finite)).astype(np.float32)
    return np.where(group_amax == 0, np.float32(1), s).astype(np.float32)


@reference("fp8_quantize")
def fp8_quantize(x, format, granularity, scale, block_size):
    x32 = np.asarray(x).astype(np.float32)
    if scale is None:
        scale = current_scale(amax(x32, granularity, block_size), format)
    else:
        scale = np.array(scale, dtype=np.float32)
    q = encode(x32 / expand(scale, x32.shape, block_size), format)
    return np.array(q, order="C"), np.array(scale, dtype=np.float32, order="C")  # (ascontiguousarray makes 0-d 1-D)


@reference("fp8_quantize_transpose")
def fp8_quantize_transpose(x, format, granularity, scale, block_size):
    """fp8_quantize of x and of x.mT (given scales: the same 0-d scale, or the block scales transposed)."""
    x = np.asarray(x)
    q, s = fp8_quantize(x, format, granularity, scale, block_size)
    scale_t = None if scale is None else (np.asarray(scale) if granularity == "tensor" else np.swapaxes(np.asarray(scale), -1, -2))
    q_t, s_t = fp8_quantize(np.swapaxes(x, -1, -2), format, granularity, scale_t, block_size)
    return q, s, q_t, s_t


@reference("fp8_quantize_amax")
def fp8_quantize_amax(x, scale, format):
    """fp8_quantize with the given per-tensor scale, and max |float32(x)| (0 for an empty x)."""
    x32 = np.asarray(x).astype(np.float32)
    q, s = fp8_quantize(x32, format, "tensor", scale, 128)
    return q, s, amax(x32, "tensor", 128)


@reference("fp8_quantize_transpose_amax")
def fp8_quantize_transpose_amax(x, scale, format):
    """fp8_quantize_transpose's q, scale and q_t with the given per-tensor scale, and the amax."""
    x32 = np.asarray(x).astype(np.float32)
    q, s, q_t, _ = fp8_quantize_transpose(x32, format, "tensor", scale, 128)
    return q, s, q_t, amax(x32, "tensor", 128)


@reference("fp8_quantize_from_amax")
def fp8_quantize_from_amax(x, amax, format):
    """fp8_quantize with the current scale of the given amax (1 where it is 0)."""
    x32 = np.asarray(x).astype(np.float32)
    return fp8_quantize(x32, format, "tensor", current_scale(np.asarray(amax, dtype=np.float32), format), 128)


@reference("fp8_quantize_transpose_from_amax")
def fp8_quantize_transpose_from_amax(x, amax, format):
    """fp8_quantize_transpose's q, scale and q_t with the current scale of the given amax."""
    x32 = np.asarray(x).astype(np.float32)
    q, s, q_t, _ = fp8_quantize_transpose(x32, format, "tensor", current_scale(np.asarray(amax, dtype=np.float32), format), 128)
    return q, s, q_t


@reference("fp8_dequantize")
def fp8_dequantize(q, scale, format, block_size, out_dtype):
    s = np.float32(scale) if not isinstance(scale, np.ndarray) else scale
    out = decode(q, format) * expand(s, q.shape, block_size)
    return np.array(out, dtype=numpy_dtype(out_dtype), order="C")


def _operand(q: np.ndarray, scale: np.ndarray, fmt: str, block_size: int) -> np.ndarray:
    return decode(q, fmt).astype(np.float64) * f64(expand(scale, q.shape, block_size))


@reference("fp8_scaled_mm")
def fp8_scaled_mm(a, b, a_scale, b_scale, bias: Optional[np.ndarray], a_format, b_format, out_dtype, block_size):
    out = _operand(a, a_scale, a_format, block_size) @ _operand(b, b_scale, b_format, block_size).T
    if bias is not None:
        out = out + f64(bias)
    return np.array(out, dtype=numpy_dtype(out_dtype), order="C")
