"""int8 quantisation: ONNX QuantizeLinear / DequantizeLinear, fake-quant for QAT, int8 GEMM.

Scales and zero points are Python numbers or 0-d/1-d arrays: one element for per-tensor
quantisation, ``x.shape[axis]`` elements for per-channel quantisation along ``axis``. The float
arithmetic of these ops is specified in float32 (as ONNX and torch do), so kernels can match the
reference exactly away from rounding ties.

Every scale must be positive and finite, every zero point an integer within the quantised range
(torch raises for a Python-number zero point outside [quant_min, quant_max]; a scale of 0, below 0,
NaN or infinite quantises nothing). Python numbers are checked by the op checkers. Array values
change from call to call while the decision cache keys arrays by shape and dtype, so they are
checked by the kernels, on every call, where the values are readable without a device
synchronisation: a kernel that receives host arrays (NumPy, CPU tensors) calls
:func:`check_qparam_values` / :func:`check_scale_values`, which raise
:class:`hal.InvalidArgumentError` naming the argument and the offending value. Device kernels
(CUDA) do not read parameters on the host: they check the values they load and turn every result
element with an invalid parameter into NaN (float results; quantize's integer result cannot carry
one), so a bad parameter shows in the output instead of passing as plausible numbers, at no host
cost and with no synchronisation in a training loop.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np
import torch

from hal.arrays import FLOAT_DTYPES, dtype_name, is_array, to_numpy, torch_dtype
from hal.registry import declare
from hal.types import OptionalTensor, ScalarOrTensor, Tensor

from . import _checks as c
from . import _empty as e
from ._fake import like
from ._tolerances import INTEGER, QUANTIZED, REDUCTION

#: where this family's ops stand among hal's (hal.ops: the order of API.md and docs/ops.md)
ORDER = 70

QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}


def check_qparams(op: str, x: Any, scale: Any, zero_point: Any, axis: Any, qmin: int, qmax: int) -> dict[str, Any]:
    """Check scale / zero point against x and axis; return the canonical axis (None: per tensor),
    and a number scale as a float, a number zero point as an int (what kernels receive)."""
    out: dict[str, Any] = {}
    if axis is None:
        canon = None
        numel = (1,)
    else:
        canon = c.integer(op, "axis", axis, low=-x.ndim, high=x.ndim - 1) % x.ndim
        numel = (int(x.shape[canon]),)
    if is_array(scale):
        c.scalar_or_array(op, "scale", scale, numel=numel)
        if axis is not None and scale.ndim != 1:
            raise c.fail(op, "scale", f"a 1-D array of {numel[0]} elements for per-channel quantisation", scale)
    else:
        out["scale"] = c.number(op, "scale", scale, low=0.0, low_open=True)
        if axis is not None and numel != (1,):
            raise c.fail(op, "scale", f"a 1-D array of {numel[0]} elements (one per channel along axis {canon})", scale)
    if is_array(zero_point):
        c.scalar_or_array(op, "zero_point", zero_point, numel=numel, floating=False)
        if dtype_name(zero_point) not in ("int8", "uint8", "int32", "int64", "float32"):
            raise c.fail(op, "zero_point", "of an integer dtype (or float32 holding integers)", zero_point)
        same_shape = c.shape_of(zero_point) == c.shape_of(scale) if is_array(scale) else zero_point.ndim <= 1
        if not same_shape:
            raise c.fail(op, "zero_point", "of the same shape as scale", zero_point)
    else:
        if not c.is_int(zero_point) and not (c.is_number(zero_point) and float(zero_point).is_integer()):
            raise c.fail(op, "zero_point", "an integer", zero_point)
        out["zero_point"] = c.integer(op, "zero_point", int(zero_point), low=qmin, high=qmax)
    out["axis"] = canon
    return out


def _host_values(v: Any) -> Optional[np.ndarray]:
    """The values of a host-resident array as float64 (None for device tensors and numbers)."""
    if isinstance(v, torch.Tensor):
        return np.asarray(to_numpy(v), dtype=np.float64) if v.device.type == "cpu" else None
    return np.asarray(v, dtype=np.float64) if isinstance(v, np.ndarray) else None


def _first_bad(a: Any, values: np.ndarray, good: np.ndarray) -> str:
    """The first value of ``a`` that is not ``good``, described for an error message."""
    i = int(np.argmin(good.reshape(-1)))
    v = float(values.reshape(-1)[i])
    where = f" at index {tuple(int(j) for j in np.unravel_index(i, values.shape))}" if values.ndim else ""
    return f"{dtype_name(a)} values of shape {tuple(values.shape)} holding {int(v) if v.is_integer() else v}{where}"


def check_scale_values(op: str, name: str, scale: Any) -> None:
    """A host-resident scale array must hold positive, finite values (called by kernels)."""
    values = _host_values(scale)
    if values is None or values.size == 0:
        return
    good = np.isfinite(values) & (values > 0)
    if not good.all():
        raise c.fail(op, name, "positive, finite scale values (0, negative, NaN or infinite scales quantise nothing)",
                     _first_bad(scale, values, good))


def check_qparam_values(op: str, scale: Any, zero_point: Any, qmin: int, qmax: int) -> None:
    """Host-resident scale and zero-point arrays: positive finite scales, integer zero points in
    [qmin, qmax] (called by kernels on every call; see the module docstring)."""
    check_scale_values(op, "scale", scale)
    values = _host_values(zero_point)
    if values is None or values.size == 0:
        return
    good = (values == np.round(values)) & (values >= qmin) & (values <= qmax)
    if not good.all():
        raise c.fail(op, "zero_point", f"integers in [{qmin}, {qmax}] (the quantised range)",
                     _first_bad(zero_point, values, good))


@declare(dtypes=FLOAT_DTYPES, tolerances=INTEGER)
def quantize(x: Tensor, scale: ScalarOrTensor, zero_point: ScalarOrTensor, axis: Optional[int] = None, dtype: str = "int8") -> Tensor:
    """ONNX QuantizeLinear: ``saturate(round_half_even(x / scale) + zero_point)`` to int8 or uint8.

    The division is float32 (x and scale converted to float32). Per-tensor when axis is None, else
    per-channel along axis.

    Non-finite x, as ``torch.quantize_per_tensor``: +inf saturates to the top of the range (127 for
    int8, 255 for uint8), -inf to the bottom (-128, 0), and NaN gives the top too, whatever the
    zero point, per tensor and per channel alike (torch's ``quantize_per_channel`` gives 0 for NaN,
    and NumPy's or torch's cast of a NaN code is undefined: hal keeps the per-tensor rule).
    """


@quantize.checker
def _check_quantize(x, scale, zero_point, axis, dtype):
    c.float_dtype("quantize", "x", x)
    qtype = c.choice("quantize", "dtype", dtype, tuple(QRANGE))
    return check_qparams("quantize", x, scale, zero_point, axis, *QRANGE[qtype])


def _empty_quantize(a: Mapping[str, Any]) -> Any:
    return e.zeros(a["x"], a["x"].shape, a["dtype"])


@declare(dtypes=("int8", "uint8"), tolerances=QUANTIZED)
def dequantize(q: Tensor, scale: ScalarOrTensor, zero_point: ScalarOrTensor, axis: Optional[int] = None) -> Tensor:
    """ONNX DequantizeLinear: ``(q - zero_point) * scale`` in float32, returned in scale's dtype
    (float32 for a Python number)."""


@dequantize.checker
def _check_dequantize(q, scale, zero_point, axis):
    qtype = c.int_dtype("dequantize", "q", q, tuple(QRANGE))
    return check_qparams("dequantize", q, scale, zero_point, axis, *QRANGE[qtype])


def _empty_dequantize(a: Mapping[str, Any]) -> Any:
    """An empty result in scale's dtype (float32 for a number)."""
    scale = a["scale"]
    return e.zeros(a["q"], a["q"].shape, dtype_name(scale) if is_array(scale) else "float32")


def _check_fake(op: str, x: Any, scale: Any, zero_point: Any, quant_min: Any, quant_max: Any, axis: Any) -> dict[str, Any]:
    c.float_dtype(op, "x", x)
    qmin = c.integer(op, "quant_min", quant_min)
    qmax = c.integer(op, "quant_max", quant_max, low=qmin + 1)
    return {**check_qparams(op, x, scale, zero_point, axis, qmin, qmax), "quant_min": qmin, "quant_max": qmax}


@declare(dtypes=FLOAT_DTYPES, tolerances=QUANTIZED, backward="fake_quantize_backward", gradients="x")
def fake_quantize(
    x: Tensor,
    scale: ScalarOrTensor,
    zero_point: ScalarOrTensor,
    quant_min: int = -128,
    quant_max: int = 127,
    axis: Optional[int] = None,
) -> Tensor:
    """Quantise and dequantise in one op, as ``torch.fake_quantize_per_tensor_affine`` (axis None)
    or ``torch.fake_quantize_per_channel_affine``, bit for bit: with ``inv = 1 / scale`` in float32,
    ``(clamp(round_half_even(x * inv) + zero_point, quant_min, quant_max) - zero_point) * scale``,
    the product ``x * inv`` in float32 (float64 for float64 x) and the result rounded to float32,
    then to x's dtype (torch skips the float32 rounding per channel on float64 x; so do kernels).
    The clamp is torch's ``fmin(fmax(code, quant_min), quant_max)``: a NaN x gives
    ``(quant_min - zero_point) * scale`` and infinities saturate (torch's per-channel CPU kernel
    converts the code to int64 before clamping, undefined in C++ for non-finite codes: x86 gives
    quant_min for +inf there; hal saturates it as the per-tensor op does). Its gradient is
    straight-through inside the clamping range and zero outside (NaN and infinite x get zero).
    """


@fake_quantize.checker
def _check_fake_quantize(x, scale, zero_point, quant_min, quant_max, axis):
    return _check_fake("fake_quantize", x, scale, zero_point, quant_min, quant_max, axis)


def _empty_fake_quantize(a: Mapping[str, Any]) -> Any:
    return e.zeros_like(a["x"])


@declare(dtypes=FLOAT_DTYPES, tolerances=QUANTIZED, forward="fake_quantize")
def fake_quantize_backward(
    grad_out: Tensor,
    x: Tensor,
    scale: ScalarOrTensor,
    zero_point: ScalarOrTensor,
    quant_min: int = -128,
    quant_max: int = 127,
    axis: Optional[int] = None,
) -> Tensor:
    """Straight-through gradient of fake_quantize: grad_out where ``round(x * inv) + zero_point``
    lies in [quant_min, quant_max], else 0."""


@fake_quantize_backward.checker
def _check_fake_quantize_backward(grad_out, x, scale, zero_point, quant_min, quant_max, axis):
    canon = _check_fake("fake_quantize_backward", x, scale, zero_point, quant_min, quant_max, axis)
    c.same_dtype("fake_quantize_backward", "grad_out", grad_out, "x", x)
    c.shape_is("fake_quantize_backward", "grad_out", grad_out, c.shape_of(x), "(the shape of x)")
    return canon


def _empty_fake_quantize_backward(a: Mapping[str, Any]) -> Any:
    return e.zeros_like(a["x"])


OUT_DTYPES = ("float16", "bfloat16", "float32")


@declare(dtypes=("int8",), tolerances=REDUCTION, reduction=lambda a: int(a["x_q"].shape[-1]), compute_bound=True)
def int8_linear(
    x_q: Tensor,
    w_q: Tensor,
    x_scale: ScalarOrTensor,
    w_scale: ScalarOrTensor,
    bias: OptionalTensor = None,
    out_dtype: str = "float16",
) -> Tensor:
    """int8 GEMM with dequantising epilogue: ``(x_q @ w_q.T in int32) * x_scale * w_scale[n] + bias``,
    cast to out_dtype (float16, bfloat16, float32).

    x_q (..., K) int8, w_q (N, K) int8, x_scale one value, w_scale one value or (N,) (per output
    channel), scales positive and finite, bias (N,) of any float dtype. The int32 accumulation is
    exact.
    """


@int8_linear.checker
def _check_int8_linear(x_q, w_q, x_scale, w_scale, bias, out_dtype):
    op = "int8_linear"
    c.min_rank(op, "x_q", x_q, 1, "(..., K)")
    c.int_dtype(op, "x_q", x_q, ("int8",))
    c.rank(op, "w_q", w_q, (2,), "(N, K)")
    c.int_dtype(op, "w_q", w_q, ("int8",))
    if int(w_q.shape[1]) != int(x_q.shape[-1]):
        raise c.fail(op, "w_q", f"of shape (N, {int(x_q.shape[-1])}) to match x_q's K", w_q)
    n = int(w_q.shape[0])
    canon = {}
    for name, v, counts in (("x_scale", x_scale, (1,)), ("w_scale", w_scale, (1, n))):
        c.scalar_or_array(op, name, v, numel=counts)
        if not is_array(v):
            canon[name] = c.number(op, name, v, low=0.0, low_open=True)
    if bias is not None:
        c.rank(op, "bias", bias, (1,))
        c.shape_is(op, "bias", bias, (n,), "(N,)")
        c.float_dtype(op, "bias", bias)
    c.choice(op, "out_dtype", out_dtype, OUT_DTYPES)
    c.result_fits(op, "x_q", c.shape_of(x_q)[:-1] + (n,), 4)
    return canon


def _empty_int8_linear(a: Mapping[str, Any]) -> Any:
    """An empty result, or for K = 0 (an empty int32 sum) the bias in every row (zeros without one)."""
    x, n = a["x_q"], int(a["w_q"].shape[0])
    shape = c.shape_of(x)[:-1] + (n,)
    if a["bias"] is None or 0 in shape:
        return e.zeros(x, shape, a["out_dtype"])
    return e.broadcast_copy(e.cast(a["bias"], a["out_dtype"]), shape)


@quantize.fake
def _fake_quantize_op(a):
    return like(a["x"], dtype=torch_dtype(a["dtype"]))


@dequantize.fake
def _fake_dequantize(a):
    s = a["scale"]
    return like(a["q"], dtype=s.dtype if isinstance(s, torch.Tensor) else torch.float32)


@fake_quantize.fake
def _fake_fake_quantize(a):
    return like(a["x"])


@fake_quantize_backward.fake
def _fake_fake_quantize_backward(a):
    return like(a["x"])


@int8_linear.fake
def _fake_int8_linear(a):
    return like(a["x_q"], tuple(a["x_q"].shape[:-1]) + (a["w_q"].shape[0],), torch_dtype(a["out_dtype"]))



# values of host-resident parameter arrays, checked on every call (device arrays: see the module docstring)
@quantize.values
def _values_quantize(a):
    check_qparam_values("quantize", a["scale"], a["zero_point"], *QRANGE[a["dtype"]])


@dequantize.values
def _values_dequantize(a):
    check_qparam_values("dequantize", a["scale"], a["zero_point"], *QRANGE[dtype_name(a["q"])])


@fake_quantize.values
def _values_fake_quantize(a):
    check_qparam_values("fake_quantize", a["scale"], a["zero_point"], a["quant_min"], a["quant_max"])


@fake_quantize_backward.values
def _values_fake_quantize_backward(a):
    check_qparam_values("fake_quantize_backward", a["scale"], a["zero_point"], a["quant_min"], a["quant_max"])


@int8_linear.values
def _values_int8_linear(a):
    check_scale_values("int8_linear", "x_scale", a["x_scale"])
    check_scale_values("int8_linear", "w_scale", a["w_scale"])

# zero-size inputs: each op's empty rule (the dispatcher answers such calls with it, no kernel runs)
quantize.empty(_empty_quantize)
dequantize.empty(_empty_dequantize)
fake_quantize.empty(_empty_fake_quantize)
fake_quantize_backward.empty(_empty_fake_quantize_backward)
int8_linear.empty(_empty_int8_linear)


__all__ = ["quantize", "dequantize", "fake_quantize", "fake_quantize_backward", "int8_linear"]
