"""int8 quantisation: ONNX QuantizeLinear / DequantizeLinear, torch's fake-quant, int8 GEMM.

The float arithmetic of these ops is specified in float32 (see ops/quant.py), so these kernels do
exactly that arithmetic, step by step, instead of computing in float64.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from hal.arrays import numpy_dtype

from ._common import f64, like, reference

QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}


def _qparam(v, axis: Optional[int], ndim: int, dtype: type) -> np.ndarray:
    """A scale or zero point as an array of ``dtype`` broadcasting against x: one value, or one per
    channel along ``axis``."""
    a = np.asarray(v).astype(dtype)
    if axis is None:
        return a.reshape(())
    shape = [1] * ndim
    shape[axis] = -1
    return a.reshape(shape)


@reference("quantize")
def quantize(x, scale, zero_point, axis, dtype):
    s = _qparam(scale, axis, x.ndim, np.float32)
    z = _qparam(zero_point, axis, x.ndim, np.float64)
    q = np.rint(x.astype(np.float32) / s) + z  # float32 division, ties to even
    return np.clip(q, *QRANGE[dtype]).astype(dtype)


@reference("dequantize")
def dequantize(q, scale, zero_point, axis):
    s = _qparam(scale, axis, q.ndim, np.float32)
    z = _qparam(zero_point, axis, q.ndim, np.int32)
    out = (q.astype(np.int32) - z).astype(np.float32) * s
    return out.astype(np.asarray(scale).dtype if isinstance(scale, np.ndarray) else np.float32)


def _fake_codes(x, scale, zero_point, axis):
    """torch's float formula up to the clamp: ``(round(x * inv) + zero_point, scale, zero_point)``
    with inv = 1 / scale in float32 and the product in float32 (float64 for float64 x)."""
    s = _qparam(scale, axis, x.ndim, np.float32)
    z = _qparam(zero_point, axis, x.ndim, np.float64)
    work = np.float64 if x.dtype == np.float64 else np.float32
    inv = (np.float32(1.0) / s).astype(work)
    return np.rint(x.astype(work) * inv) + z, s, z


@reference("fake_quantize")
def fake_quantize(x, scale, zero_point, quant_min, quant_max, axis):
    codes, s, z = _fake_codes(x, scale, zero_point, axis)
    out = (np.clip(codes, quant_min, quant_max) - z) * f64(s)  # exact: a small integer times a float32
    if axis is None or x.dtype != np.float64:
        out = out.astype(np.float32)  # torch rounds to float32, except per channel on float64 inputs
    return like(out, x)


@reference("fake_quantize_backward")
def fake_quantize_backward(grad_out, x, scale, zero_point, quant_min, quant_max, axis):
    codes, _, _ = _fake_codes(x, scale, zero_point, axis)
    inside = (codes >= quant_min) & (codes <= quant_max)
    return like(np.where(inside, f64(grad_out), 0.0), grad_out)


@reference("int8_linear")
def int8_linear(x_q, w_q, x_scale, w_scale, bias, out_dtype):
    # Products of int8 values are below 2**14 and sums of them stay below 2**53, so this float64
    # matmul is the exact integer accumulation (and runs on BLAS, unlike an integer matmul).
    acc = x_q.astype(np.float64) @ w_q.astype(np.float64).T
    out = acc * f64(x_scale).reshape(()) * f64(w_scale).reshape(-1)
    if bias is not None:
        out = out + f64(bias)
    return np.array(out, dtype=numpy_dtype(out_dtype))
