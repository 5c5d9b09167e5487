"""quantize, dequantize, fake_quantize (+ backward) and int8_linear: torch's CPU kernels
(``fake_quantize_per_*_affine``, the int8 GEMM ``torch._int_mm``) with hal_torch's tensor math
around them, and the op's formula where torch's kernels refuse the zero points; per-tensor
quantize and dequantize in one numba pass (``_nb.quant``)."""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from hal.plugin import Inputs
from hal_torch import quant as eager

from . import _numba
from ._common import FLOATS, NUMBA_FLOATS, contiguous, kernel, numba_kernel

Scalar = Union[float, int, torch.Tensor]

kernel("quantize", name="torch", priority=20, dtypes=FLOATS)(eager.quantize)
kernel("dequantize", name="torch", priority=20, dtypes=("int8", "uint8"))(eager.dequantize)

QRANGE = eager.QRANGE
NUMPY_QTYPES = {"int8": np.int8, "uint8": np.uint8}


#: per dtype of the arithmetic: (type, magic, bound). 1.5 * 2**(mantissa bits): (v + magic) - magic
#: is rint(v), ties to even, for |v| < 2**(mantissa bits - 1); the kernels use it only for values
#: that stay below ``bound`` (a safety factor of two), or that saturate anyway.
ROUNDING = {"float32": (np.float32, np.float32(1.5 * 2**23), 2**21), "float64": (np.float64, np.float64(1.5 * 2**52), 2**50)}


def _per_tensor_numbers(inputs: Inputs) -> list[str]:
    """The numba kernels take one scale and one zero point given as numbers (the op checker has
    checked them), over a C-contiguous array."""
    reasons = []
    if inputs["axis"] is not None or isinstance(inputs["scale"], (np.ndarray, torch.Tensor)) or isinstance(inputs["zero_point"], (np.ndarray, torch.Tensor)):
        reasons.append("per-channel, or scale / zero point given as arrays (the torch kernel runs them)")
    return reasons


@numba_kernel("quantize", priority=30, dtypes=NUMBA_FLOATS, checks=[_per_tensor_numbers, contiguous("x")])
def quantize_numba(x, scale, zero_point, axis, dtype):
    out = np.empty(x.shape, dtype=NUMPY_QTYPES[dtype])
    _numba.family("quant").quantize_flat(x.reshape(-1), float(scale), float(zero_point), *QRANGE[dtype], ROUNDING["float32"][1], out.reshape(-1))
    return out


@numba_kernel("dequantize", priority=30, dtypes=("int8", "uint8"), checks=[_per_tensor_numbers, contiguous("q")])
def dequantize_numba(q, scale, zero_point, axis):
    out = np.empty(q.shape, dtype=np.float32)
    _numba.family("quant").dequantize_flat(q.reshape(-1), float(scale), int(zero_point), out.reshape(-1))
    return out
kernel("int8_linear", name="torch", priority=20)(eager.int8_linear)


def _in_range(zero_point: Scalar, quant_min: int, quant_max: int) -> bool:
    """Whether torch's fake-quant kernels take these zero points (they refuse any outside the
    clamping range, which the op allows for array zero points)."""
    z = torch.as_tensor(zero_point)
    return bool(((z >= quant_min) & (z <= quant_max)).all())


def _fake_codes(x: torch.Tensor, scale: Scalar, zero_point: Scalar, axis: Optional[int]) -> tuple:
    """The op's float formula up to the clamp, in torch ops: ``(round(x * inv) + zero_point,
    scale, zero_point)``, inv = 1 / scale in float32, the product in float32 (float64 for float64 x)."""
    shape = [1] * x.ndim
    if axis is not None:
        shape[axis] = -1
    s = torch.as_tensor(scale).to(torch.float32).reshape(shape if axis is not None else ())
    z = torch.as_tensor(zero_point).to(torch.float64).reshape(shape if axis is not None else ())
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = (1.0 / s).to(work)
    return torch.round(x.to(work) * inv).to(torch.float64) + z, s, z


@kernel("fake_quantize", name="torch", priority=20, dtypes=FLOATS)
def fake_quantize(x, scale, zero_point, quant_min, quant_max, axis):
    if _in_range(zero_point, quant_min, quant_max):
        return eager.fake_quantize(x, scale, zero_point, quant_min, quant_max, axis)
    codes, s, z = _fake_codes(x, scale, zero_point, axis)
    out = (codes.clamp(quant_min, quant_max) - z) * s.double()  # exact: a small integer times a float32
    if axis is None or x.dtype != torch.float64:
        out = out.float()  # torch rounds to float32, except per channel on float64 inputs
    return out.to(x.dtype)




def _fake_grad_numba_takes(inputs: Inputs) -> list[str]:
    """Per-tensor numbers, grad_out laid out as x, and a quantised range small enough that codes
    past it are told apart by the vectorised rounding."""
    reasons = _per_tensor_numbers(inputs)
    if not reasons and inputs["grad_out"].shape != inputs["x"].shape:
        reasons.append("grad_out broadcast against x (the torch kernel runs it)")
    bound = ROUNDING.get(inputs.dtype, (None, None, 0))[2]
    if not reasons and max(abs(inputs["quant_min"]), abs(inputs["quant_max"])) >= bound:
        reasons.append(f"quantised range beyond +-{bound} (the torch kernel runs it)")
    return reasons


@numba_kernel("fake_quantize_backward", priority=30, dtypes=NUMBA_FLOATS,
              checks=[_fake_grad_numba_takes, contiguous("x"), contiguous("grad_out")])
def fake_quantize_backward_numba(grad_out, x, scale, zero_point, quant_min, quant_max, axis):
    """One pass (torch's kernel recomputes the forward with its mask, then masks the gradient)."""
    work, magic, _ = ROUNDING[x.dtype.name]
    inv = work(np.float32(1.0) / np.float32(scale))  # the reference's inverse: float32, then x's dtype
    out = np.empty(x.shape, dtype=grad_out.dtype)
    _numba.family("quant").fake_quantize_grad_flat(grad_out.reshape(-1), x.reshape(-1), inv, magic, work(zero_point),
                                                   float(quant_min), float(quant_max), out.reshape(-1))
    return out


@kernel("fake_quantize_backward", name="torch", priority=20, dtypes=FLOATS)
def fake_quantize_backward(grad_out, x, scale, zero_point, quant_min, quant_max, axis):
    if _in_range(zero_point, quant_min, quant_max):  # torch's kernel gives the mask with the forward
        s = torch.as_tensor(scale).to(torch.float32).reshape(-1)
        z = torch.as_tensor(zero_point).to(torch.int32).reshape(-1)
        if axis is None:
            _, inside = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask(x, float(s[0]), int(z[0]), quant_min, quant_max)
        else:
            c = x.shape[axis]
            _, inside = torch.ops.aten.fake_quantize_per_channel_affine_cachemask(x, s.expand(c), z.expand(c), axis, quant_min, quant_max)
        return grad_out.masked_fill(~inside, 0)
    codes, _, _ = _fake_codes(x, scale, zero_point, axis)
    return grad_out.masked_fill(~((codes >= quant_min) & (codes <= quant_max)), 0)  # NaN codes: outside
