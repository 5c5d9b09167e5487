"""Cases of fp8_quantize, fp8_quantize_transpose, their given-scale variants that reduce the amax
(fp8_quantize_amax, fp8_quantize_transpose_amax), their variants given the amax
(fp8_quantize_from_amax, fp8_quantize_transpose_from_amax: x's own, above and below it, 0, NaN and
infinite), fp8_dequantize and fp8_scaled_mm, in every format.

Quantisation is specified step by step in float32 (ops/fp8.py), so its cases are ``exact``: bit
patterns and scales must equal the reference's. Its data mixes normal values with edge values
written at the start: values past the format's largest finite value (saturation), infinities,
NaN, and tiny values in the format's subnormal range; further cases hold every finite value of
the format (each must come back as its own bit pattern with scale 1) and every midpoint between
two neighbours (ties to the even pattern). The amax variants' amax is exact too: NaN in x makes it
NaN, an infinity infinite (the cast saturates either way). dequantize decodes every bit pattern, NaN and
infinities included. The scaled GEMM draws finite bit patterns and scales that bring its
results to unit scale, and is compared against a float32 result of the reference.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from hal.ops.fp8 import FORMATS, format_values, scale_shape

from . import Call, Draw, case

FORMAT_NAMES = tuple(FORMATS)


def _finite_positive(fmt: str) -> np.ndarray:
    """The format's finite values >= 0, ascending."""
    v = format_values(fmt)[:128]
    return v[np.isfinite(v)]


def _specials(fmt: str, scale: float) -> list[float]:
    """Edge values of x for a given scale: past the largest finite value, infinities, NaN, the
    smallest subnormal, half of it (a tie with zero) and a value just above that half."""
    f = FORMATS[fmt]
    tiny = float(_finite_positive(fmt)[1])
    return [v * scale for v in (1.5 * f.max_finite, -2 * f.max_finite, math.inf, -math.inf, math.nan, tiny, -tiny / 2, 0.75 * tiny, 0.0)]


def quantize_args(
    d: Draw,
    shape: tuple[int, ...],
    format: str = "e4m3fn",
    granularity: str = "tensor",
    given: Optional[float] = None,
    block_size: int = 128,
    std: float = 1.0,
    specials: bool = False,
    layout: str = "contiguous",
) -> Call:
    """Normal data of spread ``std``; ``given``: a fixed scale of that value (every group), else
    current scaling; ``specials``: the edge values first (needs a given scale: under current
    scaling a NaN or infinity makes its group's scale NaN or infinite, see the nan_row case)."""
    raw = std * d.rng.standard_normal(shape)
    scale: Any = None
    if given is not None:
        scale = d.tensor(np.full(scale_shape(shape, granularity, block_size), given), dtype="float32")
        if specials:
            edge = _specials(format, given)
            raw.reshape(-1)[: len(edge)] = edge[: raw.size]
    args = {"x": d.tensor(raw, layout=layout), "format": format, "granularity": granularity, "scale": scale, "block_size": block_size}
    return Call(args, result_dtypes=("uint8", "float32"), keep_dtype=("scale",), exact=True)


def every_value_args(d: Draw, format: str, midpoints: bool = False) -> Call:
    """Every finite value of the format, both signs, with scale 1 (the case dtype holds them all
    exactly); ``midpoints``: every midpoint of two neighbours instead (a tie: the even pattern wins)."""
    pos = _finite_positive(format)
    vals = (pos[:-1] + pos[1:]) / 2 if midpoints else pos
    raw = np.concatenate([vals, -vals])
    d.rng.shuffle(raw)
    scale = d.tensor(np.float32(1.0), dtype="float32")
    args = {"x": d.tensor(raw), "format": format, "granularity": "tensor", "scale": scale, "block_size": 128}
    return Call(args, result_dtypes=("uint8", "float32"), keep_dtype=("scale",), exact=True)


def _host_copy(x: Any) -> np.ndarray:
    """A float64 NumPy copy of a drawn tensor on any device (cases are built on the run's device)."""
    return x.detach().to("cpu").double().numpy().copy()


def _nan_row(d: Draw, format: str) -> Call:
    """Row-wise current scaling with a NaN in row 0 and an infinity in row 1: those rows' scales are
    NaN and infinite (amax propagates them), so row 0 is all NaN, row 1 NaN and zeros; others normal."""
    call = quantize_args(d, (4, 24), format, "row")
    raw = _host_copy(call.args["x"])
    raw[0, 3], raw[1, 5] = math.nan, -math.inf
    call.args["x"] = d.tensor(raw)
    return call


_FLOAT_CASE_DTYPES = ("float16", "bfloat16", "float32", "float64")

QUANTIZE = []
for _f in FORMAT_NAMES:
    _quick = _f in ("e4m3fn", "e4m3fnuz")
    QUANTIZE += [
        case(f"{_f}_tensor", quantize_args, quick=_quick, shape=(6, 40), format=_f),
        case(f"{_f}_row", quantize_args, quick=_quick, shape=(2, 5, 33), format=_f, granularity="row", std=3.0),
        case(f"{_f}_block16", quantize_args, shape=(37, 50), format=_f, granularity="block", block_size=16, std=0.01),
        case(f"{_f}_saturation_nan_subnormals", quantize_args, quick=_quick, shape=(5, 12), format=_f, given=0.01, specials=True, std=20.0),
        case(f"{_f}_every_value", every_value_args, quick=_quick, format=_f),
        case(f"{_f}_ties_to_even", every_value_args, format=_f, midpoints=True),
        case(f"{_f}_nan_row", _nan_row, format=_f),
    ]
QUANTIZE += [
    case("block128_ragged", quantize_args, shape=(130, 260), granularity="block", std=5.0),
    case("block_batched_given", quantize_args, shape=(3, 20, 9), format="e5m2", granularity="block", block_size=8, given=0.5, specials=True),
    case("row_given", quantize_args, shape=(7, 9), format="e4m3fnuz", granularity="row", given=0.004, specials=True),
    case("vector_row", quantize_args, shape=(17,), granularity="row"),
    case("noncontig", quantize_args, shape=(6, 9, 12), granularity="row", layout="noncontig"),
    case("empty_tensor", quantize_args, quick=True, shape=(0, 5)),
    case("empty_rows", quantize_args, shape=(0, 5), granularity="row"),
    case("empty_k_row", quantize_args, shape=(3, 0), granularity="row"),
    case("empty_block", quantize_args, shape=(0, 20), granularity="block", block_size=16),
]


def transpose_args(d: Draw, shape: tuple[int, ...], nan_column: bool = False, **kwargs: Any) -> Call:
    """quantize_args' data for fp8_quantize_transpose (four results: q, scale, q_t, scale_t);
    ``nan_column``: a NaN in column 1 and an infinity in column 2 of the first matrix (their
    column scales, scale_t under row granularity, are NaN and infinite)."""
    call = quantize_args(d, shape, **kwargs)
    if nan_column:
        raw = _host_copy(call.args["x"])
        raw[..., 0, 1], raw[..., 3, 2] = math.nan, math.inf
        call.args["x"] = d.tensor(raw)
    return Call(call.args, result_dtypes=("uint8", "float32", "uint8", "float32"), keep_dtype=("scale",), exact=True)


QUANTIZE_TRANSPOSE = []
for _f in FORMAT_NAMES:
    _quick = _f in ("e4m3fn", "e4m3fnuz")
    QUANTIZE_TRANSPOSE += [
        case(f"{_f}_tensor", transpose_args, quick=_quick, shape=(12, 40), format=_f),
        case(f"{_f}_row", transpose_args, quick=_quick, shape=(2, 9, 33), format=_f, granularity="row", std=3.0),
        case(f"{_f}_block16", transpose_args, shape=(37, 50), format=_f, granularity="block", block_size=16, std=0.01),
        case(f"{_f}_saturation_nan_subnormals", transpose_args, shape=(5, 12), format=_f, given=0.01, specials=True, std=20.0),
    ]
QUANTIZE_TRANSPOSE += [
    case("row_nan_column", transpose_args, shape=(6, 5), granularity="row", nan_column=True),
    case("block128_ragged", transpose_args, shape=(130, 260), granularity="block", std=5.0),
    case("block_batched_given", transpose_args, shape=(3, 20, 9), format="e5m2", granularity="block", block_size=8, given=0.5, specials=True),
    case("block_odd_size", transpose_args, shape=(2, 30, 41), format="e4m3fnuz", granularity="block", block_size=12),
    case("noncontig", transpose_args, shape=(6, 9, 12), granularity="row", layout="noncontig"),
    case("empty_tensor", transpose_args, quick=True, shape=(0, 5)),
    case("empty_k_row", transpose_args, shape=(3, 0), granularity="row"),
    case("empty_block_given", transpose_args, shape=(4, 0, 20), granularity="block", block_size=16, given=2.0),
]


def amax_args(d: Draw, shape: tuple[int, ...], format: str = "e4m3fn", headroom: float = 4.0, transpose: bool = False,
              specials: bool = False, std: float = 1.0, layout: str = "contiguous") -> Call:
    """quantize_args' data for fp8_quantize_amax (``transpose``: fp8_quantize_transpose_amax) with a
    given scale of ``headroom`` standard deviations over the format's largest finite value (values
    past it saturate); ``specials``: quantize_args' edge values first (NaN: amax NaN)."""
    given = headroom * std / FORMATS[format].max_finite
    call = quantize_args(d, shape, format, "tensor", given=given, std=std, specials=specials, layout=layout)
    args = {"x": call.args["x"], "scale": call.args["scale"], "format": format}
    results = ("uint8", "float32", "uint8", "float32") if transpose else ("uint8", "float32", "float32")
    return Call(args, result_dtypes=results, keep_dtype=("scale",), exact=True)


QUANTIZE_AMAX, QUANTIZE_TRANSPOSE_AMAX = [], []
for _f in FORMAT_NAMES:
    _quick = _f in ("e4m3fn", "e4m3fnuz")
    QUANTIZE_AMAX += [
        case(f"{_f}_normal", amax_args, quick=_quick, shape=(6, 40), format=_f),
        case(f"{_f}_saturation_inf_nan_subnormals", amax_args, quick=_quick, shape=(5, 12), format=_f, std=20.0, specials=True),
    ]
    QUANTIZE_TRANSPOSE_AMAX += [
        case(f"{_f}_normal", amax_args, quick=_quick, shape=(12, 40), format=_f, transpose=True),
        case(f"{_f}_saturation_inf_nan_subnormals", amax_args, shape=(5, 12), format=_f, std=20.0, specials=True, transpose=True),
    ]
QUANTIZE_AMAX += [
    case("saturating_scale", amax_args, shape=(9, 31), headroom=0.25, std=3.0),
    case("vector", amax_args, shape=(257,), format="e5m2"),
    case("scalar", amax_args, shape=(), format="e4m3fnuz"),
    case("batched_3d", amax_args, shape=(3, 17, 50), format="e5m2fnuz", std=0.01),
    case("noncontig", amax_args, shape=(6, 9, 12), layout="noncontig"),
    case("empty_rows", amax_args, quick=True, shape=(0, 5)),
]
QUANTIZE_TRANSPOSE_AMAX += [
    case("batched", amax_args, shape=(3, 20, 9), format="e5m2", transpose=True, std=5.0),
    case("batched_specials", amax_args, shape=(2, 7, 33), format="e4m3fnuz", transpose=True, specials=True),
    case("odd_shape", amax_args, shape=(37, 50), headroom=0.5, transpose=True),
    case("noncontig", amax_args, shape=(6, 9, 12), layout="noncontig", transpose=True),
    case("empty_rows", amax_args, quick=True, shape=(0, 5), transpose=True),
    case("empty_batch", amax_args, shape=(0, 4, 6), format="e5m2", transpose=True),
]


def from_amax_args(d: Draw, shape: tuple[int, ...], format: str = "e4m3fn", amax: str = "of_x", transpose: bool = False,
                   std: float = 1.0, specials: bool = False, layout: str = "contiguous") -> Call:
    """fp8_quantize_from_amax (``transpose``: fp8_quantize_transpose_from_amax) of normal data with
    the amax given: ``"of_x"`` x's own (then the codes and scale are fp8_quantize's current
    scaling's), ``"above"`` three times it (a scale with headroom), ``"below"`` a quarter of it
    (values past it saturate), ``"zero"`` (scale 1), ``"nan"`` / ``"inf"`` (the scale propagates
    them: NaN codes, or zeros); ``specials``: a NaN and infinities in x (its amax is NaN)."""
    raw = std * d.rng.standard_normal(shape)
    if specials and raw.size >= 3:
        raw.reshape(-1)[:3] = (math.inf, math.nan, -math.inf)
        d.rng.shuffle(raw.reshape(-1))
    x = d.tensor(raw, layout=layout)
    values = np.abs(_host_copy(x).astype(np.float32))
    of_x = float(np.max(values, initial=np.float32(0)))
    given = {"of_x": of_x, "above": 3.0 * of_x, "below": 0.25 * of_x, "zero": 0.0, "nan": math.nan, "inf": math.inf}[amax]
    args = {"x": x, "amax": d.tensor(np.float32(given), dtype="float32"), "format": format}
    results = ("uint8", "float32", "uint8") if transpose else ("uint8", "float32")
    return Call(args, result_dtypes=results, keep_dtype=("amax",), exact=True)


QUANTIZE_FROM_AMAX, QUANTIZE_TRANSPOSE_FROM_AMAX = [], []
for _f in FORMAT_NAMES:
    _quick = _f in ("e4m3fn", "e4m3fnuz")
    for _t, _cases in ((False, QUANTIZE_FROM_AMAX), (True, QUANTIZE_TRANSPOSE_FROM_AMAX)):
        _cases += [
            case(f"{_f}_amax_of_x", from_amax_args, quick=_quick, shape=(12, 40), format=_f, transpose=_t, std=30.0),
            case(f"{_f}_amax_below_saturates", from_amax_args, shape=(5, 24), format=_f, amax="below", transpose=_t),
        ]
for _t, _cases in ((False, QUANTIZE_FROM_AMAX), (True, QUANTIZE_TRANSPOSE_FROM_AMAX)):
    _cases += [
        case("amax_above", from_amax_args, shape=(7, 33), amax="above", transpose=_t),
        case("amax_zero", from_amax_args, shape=(6, 10), format="e5m2", amax="zero", transpose=_t, std=1e-3),
        case("amax_nan", from_amax_args, shape=(4, 9), amax="nan", transpose=_t),
        case("amax_inf", from_amax_args, shape=(4, 9), format="e5m2", amax="inf", transpose=_t),
        case("nan_inf_in_x", from_amax_args, shape=(5, 12), format="e4m3fnuz", transpose=_t, specials=True),
        case("batched_3d", from_amax_args, shape=(3, 17, 50), format="e5m2fnuz", transpose=_t, std=0.01),
        case("noncontig", from_amax_args, shape=(6, 9, 12), layout="noncontig", transpose=_t),
        case("empty_rows", from_amax_args, quick=True, shape=(0, 5), amax="above", transpose=_t),
    ]
QUANTIZE_FROM_AMAX += [
    case("vector", from_amax_args, shape=(257,), format="e5m2"),
    case("scalar", from_amax_args, shape=(), format="e4m3fnuz", std=3.0),
]
QUANTIZE_TRANSPOSE_FROM_AMAX += [case("empty_batch", from_amax_args, shape=(0, 4, 6), format="e5m2", transpose=True)]


def dequantize_args(
    d: Draw, shape: tuple[int, ...], format: str = "e4m3fn", granularity: str = "tensor", block_size: int = 128,
    out_dtype: str = "float32", number: bool = False, layout: str = "contiguous", finite: bool = False,
) -> Call:
    """Bit patterns drawn over all 256 (NaN and infinities included; ``finite``: finite ones only)
    and positive scales."""
    if finite:
        codes, _ = _codes(d, format, shape)
        q = d.tensor(codes, dtype="uint8", layout=layout)
    else:
        q = d.integers(*shape, low=0, high=255, dtype="uint8", layout=layout)
    if number:
        scale: Any = d.scalar(0.01, 2.0)
    else:
        scale = d.uniform(*scale_shape(shape, granularity, block_size), low=0.01, high=2.0, dtype="float32")
    args = {"q": q, "scale": scale, "format": format, "block_size": block_size, "out_dtype": out_dtype}
    return Call(args, result_dtypes=(out_dtype,), keep_dtype=("scale",), exact=True)


DEQUANTIZE = []
for _f in FORMAT_NAMES:
    DEQUANTIZE += [
        # quick cases hold finite values: torch's opcheck (tests/training) compares without equal_nan
        case(f"{_f}_tensor", dequantize_args, quick=True, shape=(16, 16), format=_f, finite=True),
        case(f"{_f}_every_pattern", dequantize_args, shape=(16, 16), format=_f),
        case(f"{_f}_row_bfloat16", dequantize_args, shape=(9, 20), format=_f, granularity="row", out_dtype="bfloat16"),
        case(f"{_f}_block_float16", dequantize_args, shape=(20, 35), format=_f, granularity="block", block_size=8, out_dtype="float16"),
    ]
DEQUANTIZE += [
    case("number_scale", dequantize_args, shape=(5, 7), number=True),
    case("noncontig", dequantize_args, shape=(6, 10, 8), granularity="row", layout="noncontig"),
    case("empty_rows", dequantize_args, quick=True, shape=(0, 8), granularity="row"),
    case("empty_k_block", dequantize_args, shape=(5, 0), granularity="block", block_size=4, out_dtype="bfloat16"),
]


def _codes(d: Draw, fmt: str, shape: tuple[int, ...]) -> tuple[Any, float]:
    """Random finite bit patterns of ``fmt`` (both signs) and the rms of their values."""
    pos = _finite_positive(fmt)
    mags = d.rng.integers(0, len(pos), shape)
    signs = d.rng.integers(0, 2, shape) * 0x80
    codes = (mags | signs).astype(np.int64)
    rms = float(np.sqrt(np.mean(pos**2)))
    return codes, rms


def scaled_mm_args(
    d: Draw, m: int, n: int, k: int, a_format: str = "e4m3fn", b_format: str = "e4m3fn",
    a_gran: str = "tensor", b_gran: str = "tensor", block_size: int = 128,
    out_dtype: str = "bfloat16", bias: Optional[str] = "float32", layout: str = "contiguous",
) -> Call:
    """Scales around ``1 / (rms * K^(1/4))`` on each side, so products sum to unit scale."""
    a, a_rms = _codes(d, a_format, (m, k))
    b, b_rms = _codes(d, b_format, (n, k))
    spread = max(1, k) ** 0.25
    a_scale = d.uniform(*scale_shape((m, k), a_gran, block_size), low=0.8, high=1.25, dtype="float32") / (a_rms * spread)
    b_scale = d.uniform(*scale_shape((n, k), b_gran, block_size), low=0.8, high=1.25, dtype="float32") / (b_rms * spread)
    args = {
        "a": d.tensor(a, dtype="uint8", layout=layout),
        "b": d.tensor(b, dtype="uint8"),
        "a_scale": a_scale,
        "b_scale": b_scale,
        "bias": d.normal(n, std=0.5, dtype=bias) if bias else None,
        "a_format": a_format,
        "b_format": b_format,
        "out_dtype": out_dtype,
        "block_size": block_size,
    }
    return Call(args, result_dtypes=(out_dtype,), keep_dtype=("a_scale", "b_scale"), reference_args={"out_dtype": "float32"})


SCALED_MM = []
for _out in ("float16", "bfloat16", "float32"):
    SCALED_MM += [
        case(f"tensor_scales_out_{_out}", scaled_mm_args, quick=True, m=24, n=40, k=64, out_dtype=_out),
        case(f"row_scales_out_{_out}", scaled_mm_args, m=33, n=17, k=48, a_gran="row", b_gran="row", out_dtype=_out),
    ]
SCALED_MM += [
    case("block_scales", scaled_mm_args, quick=True, m=40, n=24, k=72, a_gran="block", b_gran="block", block_size=16),
    case("block128", scaled_mm_args, m=130, n=64, k=256, a_gran="block", b_gran="block"),
    case("row_times_tensor", scaled_mm_args, m=12, n=20, k=32, a_gran="row"),
    case("gradient_e5m2_x_e4m3", scaled_mm_args, m=16, n=24, k=40, a_format="e5m2"),
    case("gradient_e5m2_x_e5m2", scaled_mm_args, m=16, n=24, k=40, a_format="e5m2", b_format="e5m2", a_gran="row"),
    case("fnuz_e4m3", scaled_mm_args, quick=True, m=20, n=12, k=64, a_format="e4m3fnuz", b_format="e4m3fnuz"),
    case("fnuz_e5m2_row", scaled_mm_args, m=20, n=12, k=64, a_format="e5m2fnuz", b_format="e4m3fnuz", a_gran="row", b_gran="row"),
    case("no_bias", scaled_mm_args, m=8, n=8, k=16, bias=None),
    case("bias_bfloat16", scaled_mm_args, m=8, n=8, k=16, bias="bfloat16"),
    case("long_k", scaled_mm_args, m=4, n=8, k=4096, a_gran="row", b_gran="row", out_dtype="float32"),
    case("noncontig_a", scaled_mm_args, m=6, n=10, k=40, layout="noncontig"),
    case("empty_m", scaled_mm_args, quick=True, m=0, n=8, k=16),
    case("empty_k", scaled_mm_args, m=4, n=8, k=0, out_dtype="float32"),
]

CASES = {
    "fp8_quantize": QUANTIZE,
    "fp8_quantize_transpose": QUANTIZE_TRANSPOSE,
    "fp8_quantize_amax": QUANTIZE_AMAX,
    "fp8_quantize_transpose_amax": QUANTIZE_TRANSPOSE_AMAX,
    "fp8_quantize_from_amax": QUANTIZE_FROM_AMAX,
    "fp8_quantize_transpose_from_amax": QUANTIZE_TRANSPOSE_FROM_AMAX,
    "fp8_dequantize": DEQUANTIZE,
    "fp8_scaled_mm": SCALED_MM,
}
