"""Cases of quantize, dequantize, fake_quantize(+backward) and int8_linear.

Per-tensor and per-channel parameters (positive, negative and first axes), int8 and uint8, scales
as Python numbers and as 0-d or 1-d tensors, saturation, and rounding ties: x = (k + 1/2) * scale
with a power-of-two scale makes x / scale exact in float32, so round-half-to-even must hold bit for
bit (those cases are ``exact``). dequantize returns the dtype of its scale (float32 for a number).
int8_linear is compared in each out_dtype, against a float32 reference (its widest out_dtype).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from hal.ops.quant import QRANGE

from . import Call, Draw, Table, backward_call, case, from_table


def per_channel(d: Draw, n: int, qdtype: str, zp_dtype: str = "int32") -> tuple[Any, Any]:
    """Per-channel float32 scales and zero points around the middle of ``qdtype``'s range."""
    qmin, qmax = QRANGE[qdtype]
    mid = (qmin + qmax + 1) // 2
    return d.uniform(n, low=0.01, high=0.05, dtype="float32"), d.integers(n, low=mid - 10, high=mid + 10, dtype=zp_dtype)


def _values(d: Draw, shape: tuple[int, ...], std: float, ties: bool) -> Any:
    """Normal data of spread ``std``, or rounding ties: (k + 1/2) * 2^-3, exact in every float dtype
    and exactly k + 1/2 steps of a 2^-3 scale in float32."""
    if ties:
        return (d.rng.integers(-100, 100, shape) + 0.5) * 0.125
    return std * d.rng.standard_normal(shape)


def quantize_args(
    d: Draw,
    shape: tuple[int, ...],
    qdtype: str = "int8",
    axis: Optional[int] = None,
    scale: Any = 0.02,
    zp: Any = 0,
    std: float = 1.0,
    layout: str = "contiguous",
    ties: bool = False,
    zp_dtype: str = "int32",
) -> Call:
    raw = _values(d, shape, std, ties)
    if axis is not None:
        scale, zp = per_channel(d, shape[axis], qdtype, zp_dtype)
    args = {"x": d.tensor(raw, layout=layout), "scale": scale, "zero_point": zp, "axis": axis, "dtype": qdtype}
    return Call(args, result_dtypes=(qdtype,), exact=ties)


def _quantize_0d(d: Draw) -> Call:
    call = quantize_args(d, (5, 9))
    call.args["scale"] = d.tensor(0.03, dtype="float32")
    call.args["zero_point"] = d.tensor(-3, dtype="int32")
    return call


QUANTIZE = [
    case("per_tensor_int8", quantize_args, quick=True, shape=(4, 33)),
    case("per_tensor_uint8", quantize_args, quick=True, shape=(4, 33), qdtype="uint8", zp=128),
    case("per_channel_axis1", quantize_args, quick=True, shape=(3, 8, 5), axis=1),
    case("per_channel_axis0_uint8", quantize_args, shape=(6, 10), axis=0, qdtype="uint8", zp_dtype="uint8"),
    case("per_channel_negative_axis", quantize_args, shape=(4, 3, 7), axis=-1),
    case("ties_half_even", quantize_args, shape=(8, 25), scale=0.125, ties=True),
    case("saturation", quantize_args, shape=(10, 20), scale=0.01, zp=5, std=10.0),
    case("scale_0d_tensors", _quantize_0d),
    case("noncontig", quantize_args, shape=(6, 9, 12), layout="noncontig"),
    case("odd_shape", quantize_args, shape=(7, 11, 3), zp=-7),
    case("empty_x", quantize_args, quick=True, shape=(0, 5)),
    case("empty_x_per_channel", quantize_args, shape=(0, 4), axis=1),
    case("empty_channels", quantize_args, shape=(3, 0), axis=1, qdtype="uint8"),
]


def dequantize_args(
    d: Draw,
    shape: tuple[int, ...],
    axis: Optional[int] = None,
    scale_dtype: Optional[str] = None,
    layout: str = "contiguous",
) -> Call:
    """q drawn over the whole range of the case dtype (int8 or uint8); scale a number (result
    float32) or a 0-d tensor of ``scale_dtype`` (result of that dtype)."""
    qmin, qmax = QRANGE[d.dtype]
    q = d.integers(*shape, low=qmin, high=qmax, dtype=d.dtype, layout=layout)
    mid = (qmin + qmax + 1) // 2
    if axis is not None:
        scale, zp = per_channel(d, shape[axis], d.dtype)
        out = "float32"
    else:
        zp = mid + 3
        scale = d.tensor(0.05, dtype=scale_dtype) if scale_dtype else 0.05
        out = scale_dtype or "float32"
    return Call({"q": q, "scale": scale, "zero_point": zp, "axis": axis}, result_dtypes=(out,), exact=out == "float32")


DEQUANTIZE = [
    case("per_tensor", dequantize_args, quick=True, shape=(4, 33)),
    case("per_channel_axis0", dequantize_args, quick=True, shape=(8, 12), axis=0),
    case("per_channel_axis_last", dequantize_args, shape=(3, 5, 6), axis=-1),
    case("scale_float16", dequantize_args, shape=(6, 7), scale_dtype="float16"),
    case("scale_bfloat16", dequantize_args, shape=(6, 7), scale_dtype="bfloat16"),
    case("scale_float64", dequantize_args, shape=(6, 7), scale_dtype="float64"),
    case("noncontig", dequantize_args, shape=(5, 8, 10), layout="noncontig"),
    case("odd_shape", dequantize_args, shape=(7, 11, 3)),
    case("empty_q", dequantize_args, quick=True, shape=(0, 6)),
    case("empty_q_scale_float16", dequantize_args, shape=(4, 0), scale_dtype="float16"),
    case("empty_channels", dequantize_args, shape=(2, 0), axis=1),
]


def fake_args(
    d: Draw,
    shape: tuple[int, ...],
    qmin: int = -128,
    qmax: int = 127,
    axis: Optional[int] = None,
    scale: float = 0.05,
    zp: int = 0,
    std: float = 1.0,
    layout: str = "contiguous",
    ties: bool = False,
    specials: tuple[float, ...] = (),
) -> Call:
    """``specials``: values written at the start of x (NaN becomes quant_min's value, as torch)."""
    raw = _values(d, shape, std, ties)
    raw.reshape(-1)[: len(specials)] = specials
    if axis is not None:
        n = shape[axis]
        scale_v: Any = d.uniform(n, low=0.01, high=0.05, dtype="float32")
        zp_v: Any = d.integers(n, low=qmin // 2, high=qmax // 2, dtype="int32")
    else:
        scale_v, zp_v = scale, zp
    args = {"x": d.tensor(raw, layout=layout), "scale": scale_v, "zero_point": zp_v, "quant_min": qmin, "quant_max": qmax, "axis": axis}
    return Call(args, exact=ties)


def _fake_backward(d: Draw, **kw: Any) -> Call:
    fwd = fake_args(d, **kw)
    return backward_call("fake_quantize_backward", d, fwd, tuple(fwd.args["x"].shape))


FAKE_CASES: Table = {
    "per_tensor": (dict(shape=(4, 33)), True, True),
    "uint8_range": (dict(shape=(4, 33), qmin=0, qmax=255, zp=128), False, True),
    "four_bit": (dict(shape=(5, 20), qmin=-8, qmax=7, scale=0.2, zp=-1), False, True),
    "per_channel_axis1": (dict(shape=(2, 6, 5), axis=1), True, True),
    "ties_half_even": (dict(shape=(8, 25), scale=0.125, ties=True), False, False),
    "saturation": (dict(shape=(10, 20), scale=0.01, std=10.0), False, True),
    "noncontig": (dict(shape=(6, 9, 12), layout="noncontig"), False, True),
    "odd_shape": (dict(shape=(7, 11, 3), zp=3), False, False),
    # torch clamps with fmin/fmax: NaN gives quant_min, infinities saturate (per tensor; torch's
    # per-channel kernel is undefined for infinities, so only NaN is drawn there)
    "nan_inf_per_tensor": (dict(shape=(4, 9), zp=2, specials=(float("nan"), float("inf"), -float("inf"), float("nan"))), True, True),
    "nan_per_channel": (dict(shape=(3, 6), axis=1, specials=(float("nan"), 0.5, float("nan"))), False, True),
    "empty_x": (dict(shape=(0, 7)), True, True),
    "empty_channels": (dict(shape=(4, 0), axis=1), False, True),
}
FAKE = from_table(FAKE_CASES, fake_args)
FAKE_BACKWARD = from_table(FAKE_CASES, _fake_backward, backward=True)


def int8_linear_args(
    d: Draw,
    x: tuple[int, ...],
    n: int,
    out_dtype: str = "float16",
    bias: Optional[str] = "float32",
    per_channel: bool = True,
    x_scale_tensor: bool = False,
    layout: str = "contiguous",
) -> Call:
    """Scales chosen so results are of unit scale: int8 data has std ~73, a K-term dot product
    std ~73^2 sqrt(K)."""
    k = x[-1]
    unit = 1.0 / (73.0**2 * math.sqrt(max(1, k)))
    x_scale = math.sqrt(unit) * d.scalar(0.8, 1.25)
    args = {
        "x_q": d.integers(*x, low=-127, high=127, dtype="int8", layout=layout),
        "w_q": d.integers(n, k, low=-127, high=127, dtype="int8"),
        "x_scale": d.tensor(x_scale, dtype="float32") if x_scale_tensor else x_scale,
        "w_scale": d.uniform(n, low=0.8, high=1.25, dtype="float32") * math.sqrt(unit) if per_channel else math.sqrt(unit),
        "bias": d.normal(n, std=0.5, dtype=bias) if bias else None,
        "out_dtype": out_dtype,
    }
    return Call(args, result_dtypes=(out_dtype,), reference_args={"out_dtype": "float32"})


INT8_LINEAR = []
for _out in ("float16", "bfloat16", "float32"):
    INT8_LINEAR += [
        case(f"transformer_out_{_out}", int8_linear_args, x=(2, 16, 256), n=128, out_dtype=_out),
        case(f"small_out_{_out}", int8_linear_args, quick=True, x=(4, 48), n=24, out_dtype=_out),
    ]
INT8_LINEAR += [
    case("vector_input", int8_linear_args, x=(37,), n=11),
    case("odd_prime", int8_linear_args, x=(3, 7, 13), n=11),
    case("no_bias_per_tensor", int8_linear_args, x=(5, 32), n=16, bias=None, per_channel=False),
    case("float16_bias_0d_x_scale", int8_linear_args, x=(5, 32), n=16, bias="float16", x_scale_tensor=True),
    case("long_k", int8_linear_args, x=(4, 4096), n=8),
    case("noncontig_x", int8_linear_args, x=(6, 10, 40), n=12, layout="noncontig"),
    # zero-size dimensions: no rows, no output features, K = 0 (the bias in every row)
    case("empty_rows", int8_linear_args, quick=True, x=(0, 16), n=8),
    case("empty_batch_3d", int8_linear_args, x=(2, 0, 16), n=8, out_dtype="float32"),
    case("empty_out_features", int8_linear_args, x=(3, 16), n=0),
    case("empty_k", int8_linear_args, x=(4, 0), n=8, out_dtype="bfloat16"),
    case("empty_k_no_bias", int8_linear_args, x=(4, 0), n=8, bias=None, per_channel=False),
]

CASES = {
    "quantize": QUANTIZE,
    "dequantize": DEQUANTIZE,
    "fake_quantize": FAKE,
    "fake_quantize_backward": FAKE_BACKWARD,
    "int8_linear": INT8_LINEAR,
}
