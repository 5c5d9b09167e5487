"""int8 quantisation: ONNX QuantizeLinear / DequantizeLinear, torch's fake-quant, int8 GEMM.

The float arithmetic of these ops is specified in float32 (see ops/quant.py), so these kernels do
exactly that arithmetic, step by step, instead of computing in float64. Array-valued scales and
zero points are validated here on every call (ops/quant.py says why the kernels do it).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from hal.plugin_sdk.arrays import numpy_dtype
from hal.plugin import Inputs

from ._common import F64, elements, f64, like, reference

QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}


def _qparam(v, axis: Optional[int], ndim: int, dtype: type) -> np.ndarray:
    """A scale or zero point as an array of ``dtype`` broadcasting against x: one value, or one per
    channel along ``axis``."""
    a = np.asarray(v).astype(dtype)
    if axis is None:
        return a.reshape(())
    shape = [1] * ndim
    shape[axis] = a.size
    return a.reshape(shape)


@reference("quantize")
def quantize(x, scale, zero_point, axis, dtype):
    s = _qparam(scale, axis, x.ndim, np.float32)
    z = _qparam(zero_point, axis, x.ndim, np.float64)
    lo, hi = QRANGE[dtype]
    q = np.rint(x.astype(np.float32) / s) + z  # float32 division, ties to even
    return np.clip(np.where(np.isnan(q), hi, q), lo, hi).astype(dtype)  # NaN: the top code, as torch (ops/quant.py)


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
    # fmin/fmax as torch clamps: a NaN code (x NaN) gives quant_min; infinities saturate
    out = (np.fmin(np.fmax(codes, quant_min), quant_max) - z) * f64(s)  # exact: a small integer times a float32
    if axis is None or x.dtype != np.float64:
        out = out.astype(np.float32)  # torch rounds to float32, except per channel on float64 inputs
    return like(out, x)


@reference("fake_quantize_backward")
def fake_quantize_backward(grad_out, x, scale, zero_point, quant_min, quant_max, axis):
    codes, _, _ = _fake_codes(x, scale, zero_point, axis)
    inside = (codes >= quant_min) & (codes <= quant_max)
    return like(np.where(inside, f64(grad_out), 0.0), grad_out)


#: rows of x converted to float64 at a time by int8_linear.
INT8_BLOCK_ELEMENTS = 2**22


def _int8_linear_footprint(inputs: Inputs) -> int:
    x, w = inputs["x_q"], inputs["w_q"]
    rows, (n, k) = elements(x.shape[:-1]), (int(s) for s in w.shape)
    return F64 * (3 * rows * n + n * k + 2 * INT8_BLOCK_ELEMENTS) + rows * k


@reference("int8_linear", _int8_linear_footprint)
def int8_linear(x_q, w_q, x_scale, w_scale, bias, out_dtype):
    # Products of int8 values are below 2**14 and sums of them stay below 2**53, so this float64
    # matmul is the exact integer accumulation (and runs on BLAS, unlike an integer matmul). x is
    # converted a block of rows at a time: an expanded x_q is never materialised in float64.
    k, n = x_q.shape[-1], w_q.shape[0]
    x2, w = x_q.reshape(elements(x_q.shape[:-1]), k), w_q.astype(np.float64).T
    acc = np.empty((x2.shape[0], n))
    step = max(1, INT8_BLOCK_ELEMENTS // max(1, k))
    for start in range(0, x2.shape[0], step):
        acc[start : start + step] = f64(x2[start : start + step]) @ w
    out = acc * f64(x_scale).reshape(()) * f64(w_scale).reshape(-1)
    if bias is not None:
        out = out + f64(bias)
    return np.array(out.reshape(x_q.shape[:-1] + (n,)), dtype=numpy_dtype(out_dtype))
