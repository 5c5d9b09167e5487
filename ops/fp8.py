"""FP8: quantisation with the amax reduction fused in (or the amax given, reduced by the op that
produced x), dequantisation, and the scaled GEMM.

Formats (``format=``): the OCP formats of Hopper and Blackwell, ``"e4m3fn"`` (largest finite value
448, no infinities, NaN = S.1111.111) and ``"e5m2"`` (57344, IEEE-like infinities and NaNs), and
the ``fnuz`` formats of AMD's MI300 (gfx942), ``"e4m3fnuz"`` (240) and ``"e5m2fnuz"`` (57344): no
infinities, no negative zero, a single NaN (bit pattern 0x80). :data:`FORMATS` holds each format's
parameters; :func:`format_values` lists every value of a format, decoded from its bit patterns.

**Representation.** 8-bit values travel as ``uint8`` arrays holding the format's bit patterns, on
every backend and in NumPy (which has no FP8 dtype of its own): the op's ``format`` argument says
how to read them. A torch user views them as torch's FP8 dtype without a copy,
``q.view(torch.float8_e4m3fn)`` (:data:`TORCH_DTYPE_NAMES`), and back with ``.view(torch.uint8)``.

**Scales** are float32 and dequantising: ``x ~= decode(q) * scale``. Granularities:

- ``"tensor"``: one scale, a 0-d array;
- ``"row"``: one scale per row of the last dimension, shape ``(..., 1)``;
- ``"block"``: one scale per ``block_size x block_size`` tile of the last two dimensions, shape
  ``(..., ceil(M / block_size), ceil(K / block_size))`` (128 by default, as DeepSeek-V3's recipe).

**Arithmetic**, specified in float32 so that every kernel reproduces the reference bit for bit:
``amax = max |float32(x)|`` over the group (NaN propagates, as ``torch.amax``), the current
scale ``float32(amax) / float32(max_finite)`` (1 where amax is 0), and
``q = encode(float32(x) / scale)`` where encode rounds to nearest, ties to even, and saturates:
values beyond the largest finite value, infinities included, become ``+-max_finite``. A NaN
becomes the format's canonical NaN: 0x7F for the OCP formats, 0x80 for the fnuz ones.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import numpy as np
import torch

from hal.arrays import FLOAT_DTYPES, dtype_name, is_array
from hal.registry import Tolerance, declare
from hal.types import OptionalTensor, ScalarOrTensor, Tensor

from . import _checks as c
from . import _empty as e
from ._fake import like
from ._tolerances import REDUCTION
from .quant import check_scale_values

#: where this family's ops stand among hal's (hal.ops: the order of API.md and docs/ops.md)
ORDER = 80


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """One 8-bit float format: 1 sign bit, ``exponent_bits``, ``mantissa_bits``, and its rules."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    #: the largest finite value, where quantisation saturates
    max_finite: float
    #: the fnuz rules (AMD): no negative zero, no infinities, the single NaN 0x80.
    fnuz: bool
    #: infinities exist (e5m2 only); e4m3fn spends only S.1111.111 on NaN.
    has_inf: bool

    @property
    def nan_bits(self) -> int:
        """The canonical NaN a quantisation writes: 0x7F (OCP, positive sign) or 0x80 (fnuz)."""
        return 0x80 if self.fnuz else 0x7F


FORMATS: dict[str, Fp8Format] = {
    "e4m3fn": Fp8Format("e4m3fn", 4, 3, 7, 448.0, fnuz=False, has_inf=False),  # 2^8 * 1.75
    "e5m2": Fp8Format("e5m2", 5, 2, 15, 57344.0, fnuz=False, has_inf=True),  # 2^15 * 1.75
    "e4m3fnuz": Fp8Format("e4m3fnuz", 4, 3, 8, 240.0, fnuz=True, has_inf=False),  # 2^7 * 1.875
    "e5m2fnuz": Fp8Format("e5m2fnuz", 5, 2, 16, 57344.0, fnuz=True, has_inf=False),  # 2^15 * 1.75
}

#: torch's dtype of each format (view a uint8 result as it: ``q.view(getattr(torch, name))``).
TORCH_DTYPE_NAMES = {f: f"float8_{f}" for f in FORMATS}

GRANULARITIES = ("tensor", "row", "block")
OUT_DTYPES = ("float16", "bfloat16", "float32")

_VALUES: dict[str, np.ndarray] = {}


def format_values(fmt: str) -> np.ndarray:
    """The 256 values of a format as float64, indexed by bit pattern (NaN and infinities included).

    Decoded from the definition (sign, biased exponent, mantissa; exponent field 0 is subnormal),
    not from any library, so tests can hold other implementations against it."""
    if fmt not in _VALUES:
        f = FORMATS[fmt]
        out = np.empty(256, dtype=np.float64)
        top = (1 << f.exponent_bits) - 1
        for bits in range(256):
            sign = -1.0 if bits & 0x80 else 1.0
            e = (bits >> f.mantissa_bits) & top
            m = bits & ((1 << f.mantissa_bits) - 1)
            if e == 0:
                v = m * 2.0 ** (1 - f.bias - f.mantissa_bits)
            else:
                v = (1 + m / (1 << f.mantissa_bits)) * 2.0 ** (e - f.bias)
            out[bits] = sign * v
            if f.fnuz and bits == 0x80:
                out[bits] = math.nan
            elif not f.fnuz and f.has_inf and e == top:
                out[bits] = sign * math.inf if m == 0 else math.nan
            elif not f.fnuz and not f.has_inf and e == top and m == (1 << f.mantissa_bits) - 1:
                out[bits] = math.nan
        out.setflags(write=False)
        _VALUES[fmt] = out
    return _VALUES[fmt]


def scale_shape(shape: tuple[int, ...], granularity: str, block_size: int) -> Optional[tuple[int, ...]]:
    """The shape of the scales of an array of ``shape`` quantised at ``granularity``; None where the
    granularity needs more dimensions than the array has (rows: one, blocks: two)."""
    if granularity == "tensor":
        return ()
    if len(shape) < (1 if granularity == "row" else 2):
        return None
    if granularity == "row":
        return shape[:-1] + (1,)
    m, k = shape[-2], shape[-1]
    return shape[:-2] + (-(-m // block_size), -(-k // block_size))


def granularity_of(op: str, name: str, scale: Any, shape: tuple[int, ...], block_size: int) -> str:
    """Which granularity a scale array's shape means for an operand of ``shape`` (2-D operands):
    where two granularities give the same shape, they also mean the same grouping."""
    got = c.shape_of(scale) if is_array(scale) else ()
    for g in GRANULARITIES:
        if got == scale_shape(shape, g, block_size):
            return g
    want = ", ".join(f"{scale_shape(shape, g, block_size)} ({g})" for g in GRANULARITIES if scale_shape(shape, g, block_size) is not None)
    raise c.fail(op, name, f"a float32 scale of shape {want}", scale)


def _check_scale_array(op: str, name: str, scale: Any, want: tuple[int, ...]) -> None:
    if not is_array(scale) or dtype_name(scale) != "float32":
        raise c.fail(op, name, "a float32 array of scales (see ops/fp8.py for the granularities)", scale)
    c.shape_is(op, name, scale, want, f"{want}")


#: quantisation is specified in float32 step by step, so kernels match the reference bit for bit;
#: one bit-pattern step (one unit in the last place of the format) where a rounding tie could fall
#: differently, and the float32 scales to the last bit.
QUANTIZE_TOLERANCE = {t: Tolerance(1.0, 0.0) for t in (*FLOAT_DTYPES, "uint8")}

#: dequantisation is one float32 product of an exact 8-bit value and a float32 scale: exact in
#: float32; a half-precision result is one more rounding of it.
DEQUANTIZE_TOLERANCE = {
    "float32": Tolerance(0.0, 2.0**-24),
    "float16": Tolerance(2.0**-24, 2.0**-11),
    "bfloat16": Tolerance(2.0**-133, 2.0**-8),
    "uint8": Tolerance(0.0, 2.0**-24),
}


@declare(dtypes=FLOAT_DTYPES, tolerances=QUANTIZE_TOLERANCE)
def fp8_quantize(
    x: Tensor,
    format: str = "e4m3fn",
    granularity: str = "tensor",
    scale: OptionalTensor = None,
    block_size: int = 128,
) -> tuple[Tensor, Tensor]:
    """Quantise x to an FP8 format, returning ``(q, scale)``: q the uint8 bit patterns of
    ``encode(float32(x) / scale)`` (rounded to nearest even, saturated to the format's largest
    finite value, NaN as the canonical NaN), scale the float32 dequantising scales.

    Without ``scale`` (current scaling) the scales come from the amax of each group, fused into
    the same pass: ``amax / max_finite`` (1 for an all-zero group). With ``scale`` (delayed or
    fixed scaling) those scales are used as given and returned. granularity: ``"tensor"`` (scale
    0-d), ``"row"`` (``(..., 1)``) or ``"block"`` (``block_size`` square tiles of the last two
    dimensions). format: e4m3fn, e5m2, e4m3fnuz, e5m2fnuz. See ops/fp8.py for the formats.
    """


@fp8_quantize.checker
def _check_fp8_quantize(x, format, granularity, scale, block_size):
    op = "fp8_quantize"
    c.float_dtype(op, "x", x)
    c.choice(op, "format", format, tuple(FORMATS))
    c.choice(op, "granularity", granularity, GRANULARITIES)
    bs = c.integer(op, "block_size", block_size, low=1)
    if granularity == "row":
        c.min_rank(op, "x", x, 1, "(..., K) for row-wise scales")
    if granularity == "block":
        c.min_rank(op, "x", x, 2, "(..., M, K) for block-wise scales")
    if scale is not None:
        _check_scale_array(op, "scale", scale, scale_shape(c.shape_of(x), granularity, bs))
    return {"block_size": bs}


@declare(dtypes=FLOAT_DTYPES, tolerances=QUANTIZE_TOLERANCE)
def fp8_quantize_transpose(
    x: Tensor,
    format: str = "e4m3fn",
    granularity: str = "tensor",
    scale: OptionalTensor = None,
    block_size: int = 128,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Quantise x (at least 2-D) and its transpose in one pass, returning ``(q, scale, q_t,
    scale_t)``: ``(q, scale) == fp8_quantize(x, ...)`` and ``(q_t, scale_t) == fp8_quantize(x.mT,
    ...)`` bit for bit, q_t contiguous of shape ``(..., K, M)``. A GEMM's backward needs both
    layouts of an operand (``dgrad`` reads W, ``wgrad`` reads X.T), so the transposed copy comes
    from the same read of x.

    granularity ``"tensor"``: scale_t equals scale; ``"block"``: scale_t is ``scale.mT``;
    ``"row"``: scale_t holds the scales of x's columns (column amax / max_finite), shape
    ``(..., K, 1)`` (current scaling only: one row-wise scale cannot serve both layouts, so
    ``scale`` must be None).
    """


@fp8_quantize_transpose.checker
def _check_fp8_quantize_transpose(x, format, granularity, scale, block_size):
    op = "fp8_quantize_transpose"
    c.float_dtype(op, "x", x)
    c.choice(op, "format", format, tuple(FORMATS))
    c.choice(op, "granularity", granularity, GRANULARITIES)
    bs = c.integer(op, "block_size", block_size, low=1)
    c.min_rank(op, "x", x, 2, "(..., M, K): the transpose swaps the last two dimensions")
    if scale is not None:
        if granularity == "row":
            raise c.fail(op, "scale", "None with granularity 'row' (row-wise scales of x do not apply to x.mT: "
                         "use current scaling, or granularity 'tensor' or 'block')", scale)
        _check_scale_array(op, "scale", scale, scale_shape(c.shape_of(x), granularity, bs))
    return {"block_size": bs}


def _check_cast_input(op: str, x: Any, format: Any, transpose: bool) -> None:
    """x and format of a per-tensor cast with a given scale or amax (the ``*_amax`` and
    ``*_from_amax`` ops): a float array, a known format, and at least 2-D where the transpose is written."""
    c.float_dtype(op, "x", x)
    c.choice(op, "format", format, tuple(FORMATS))
    if transpose:
        c.min_rank(op, "x", x, 2, "(..., M, K): the transpose swaps the last two dimensions")


@declare(dtypes=FLOAT_DTYPES, tolerances=QUANTIZE_TOLERANCE)
def fp8_quantize_amax(x: Tensor, scale: Tensor, format: str = "e4m3fn") -> tuple[Tensor, Tensor, Tensor]:
    """Quantise x with a given per-tensor scale and reduce its amax in the same pass, returning
    ``(q, scale, amax)``: ``(q, scale) == fp8_quantize(x, format, "tensor", scale)`` bit for bit
    (scale a 0-d float32 array, returned as a copy), and ``amax = max |float32(x)|`` as a 0-d
    float32 (NaN propagates, as ``torch.amax``; 0 for an empty x).

    Delayed scaling (Transformer Engine's recipe) casts with the scale of earlier calls and records
    this call's amax for the next ones: with the amax from the cast's own read of x, x is read once
    instead of twice (cast, then a separate reduction). The scale comes back as fp8_quantize's does,
    so the caller holds this call's value while the scale it passed in is updated in place.
    """


@fp8_quantize_amax.checker
def _check_fp8_quantize_amax(x, scale, format):
    op = "fp8_quantize_amax"
    _check_cast_input(op, x, format, transpose=False)
    _check_scale_array(op, "scale", scale, ())


@declare(dtypes=FLOAT_DTYPES, tolerances=QUANTIZE_TOLERANCE)
def fp8_quantize_transpose_amax(x: Tensor, scale: Tensor, format: str = "e4m3fn") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp8_quantize_amax of x (at least 2-D) writing its transpose too, returning ``(q, scale, q_t,
    amax)``: q, scale and q_t as ``fp8_quantize_transpose(x, format, "tensor", scale)``'s q, scale
    and q_t bit for bit (q_t contiguous, shape ``(..., K, M)``; the transpose's scale is the same
    scale), amax as fp8_quantize_amax's, all from one read of x.
    """


@fp8_quantize_transpose_amax.checker
def _check_fp8_quantize_transpose_amax(x, scale, format):
    op = "fp8_quantize_transpose_amax"
    _check_cast_input(op, x, format, transpose=True)
    _check_scale_array(op, "scale", scale, ())


def _check_amax_array(op: str, amax: Any) -> None:
    if not is_array(amax) or dtype_name(amax) != "float32":
        raise c.fail(op, "amax", "a 0-d float32 array (the amax of x, max |float32(x)|)", amax)
    c.shape_is(op, "amax", amax, (), "() (one amax for the tensor)")


@declare(dtypes=FLOAT_DTYPES, tolerances=QUANTIZE_TOLERANCE)
def fp8_quantize_from_amax(x: Tensor, amax: Tensor, format: str = "e4m3fn") -> tuple[Tensor, Tensor]:
    """Quantise x with one current scale computed from a given amax, returning ``(q, scale)``:
    ``scale = float32(amax) / float32(max_finite)`` (1 where amax is 0; NaN and infinities
    propagate), ``q = encode(float32(x) / scale)``. amax is a 0-d float32 array; given ``amax = max
    |float32(x)|``, (q, scale) equal ``fp8_quantize(x, format, "tensor")`` bit for bit.

    Current scaling when the amax of x is known before the cast: reduced by the op that produced x
    as it wrote it (``rms_norm_amax``, ``swiglu_amax``), so the cast does not read x twice (amax,
    then encode) and runs as one pass over x, the scale computed where the codes are.
    """


@fp8_quantize_from_amax.checker
def _check_fp8_quantize_from_amax(x, amax, format):
    op = "fp8_quantize_from_amax"
    _check_cast_input(op, x, format, transpose=False)
    _check_amax_array(op, amax)


@declare(dtypes=FLOAT_DTYPES, tolerances=QUANTIZE_TOLERANCE)
def fp8_quantize_transpose_from_amax(x: Tensor, amax: Tensor, format: str = "e4m3fn") -> tuple[Tensor, Tensor, Tensor]:
    """fp8_quantize_from_amax of x (at least 2-D) writing its transpose too, returning ``(q, scale,
    q_t)``: q and scale as fp8_quantize_from_amax's, q_t contiguous of shape ``(..., K, M)`` the codes
    of ``x.mT`` with the same scale (``fp8_quantize_transpose(x, format, "tensor")``'s q, scale and
    q_t bit for bit when ``amax = max |float32(x)|``), from one read of x.
    """


@fp8_quantize_transpose_from_amax.checker
def _check_fp8_quantize_transpose_from_amax(x, amax, format):
    op = "fp8_quantize_transpose_from_amax"
    _check_cast_input(op, x, format, transpose=True)
    _check_amax_array(op, amax)


@declare(dtypes=("uint8",), tolerances=DEQUANTIZE_TOLERANCE)
def fp8_dequantize(
    q: Tensor,
    scale: ScalarOrTensor,
    format: str = "e4m3fn",
    block_size: int = 128,
    out_dtype: str = "float32",
) -> Tensor:
    """``decode(q) * scale`` in float32, rounded to out_dtype (float16, bfloat16, float32).

    q holds uint8 bit patterns of ``format``; scale is a Python number or float32 scales of any
    granularity of fp8_quantize (told apart by their shape). NaN and infinite codes decode as such.
    """


@fp8_dequantize.checker
def _check_fp8_dequantize(q, scale, format, block_size, out_dtype):
    op = "fp8_dequantize"
    c.int_dtype(op, "q", q, ("uint8",))
    c.choice(op, "format", format, tuple(FORMATS))
    c.choice(op, "out_dtype", out_dtype, OUT_DTYPES)
    bs = c.integer(op, "block_size", block_size, low=1)
    if is_array(scale):
        if dtype_name(scale) != "float32":
            raise c.fail(op, "scale", "a Python number or float32 scales", scale)
        granularity_of(op, "scale", scale, c.shape_of(q), bs)
        return {"block_size": bs}
    return {"block_size": bs, "scale": c.number(op, "scale", scale, low=0.0, low_open=True)}


def _scaled_mm_k(a: Mapping[str, Any]) -> int:
    return int(a["a"].shape[-1])


#: Hopper's FP8 tensor-core MMA (wgmma) does not accumulate in full float32: DeepSeek-V3's report
#: (arXiv 2412.19437, section 3.3.2) measured about 14 significant bits on H800, and cuBLASLt (fast
#: accumulation off) and Triton's wgmma loop both keep the running sum in that accumulator. A sum of K
#: products whose result is of unit size then carries a random walk of roundings of relative size
#: ~2^-14 on partial sums of about the result's size: ~2^-14 * sqrt(K / 2) absolute for an O(1)
#: result (the conformance and device tests scale their operands so that results are O(1)).
#: Measured on the H200 (commit 2fba452, float32 out, O(1) results): K 48 max 8.8e-4, K 64 1.6e-3,
#: K 384 1.9e-3, K 512 1.3e-3..4.5e-3, K 1024 2.1e-3, K 4096 3.0e-3 (Triton and cuBLASLt alike).
#: 2^-10 * sqrt(K) (16x the one-sigma walk: the max over thousands of outputs is a few sigma) holds
#: them with a 5x..20x margin, while a scale applied twice or a transposed operand is off by O(1),
#: 50x past it. rtol 2^-13: one unit of the 14-bit sum on large results.
FP8_MMA_ATOL = 2.0**-10
FP8_MMA_RTOL = 2.0**-13


def _fp8_mma(t: str) -> Tolerance:
    """REDUCTION's preset for result dtype ``t`` widened by Hopper's FP8 accumulation error."""
    base = REDUCTION[t]
    return Tolerance(base.atol + FP8_MMA_ATOL, max(base.rtol, FP8_MMA_RTOL), per_sqrt_k=True)


#: the scaled GEMM: its inputs are exact, so its error is the accumulation over K (at the hardware's
#: FP8 accumulation precision, above) and the one rounding of the result.
SCALED_MM_TOLERANCE = {"uint8": _fp8_mma("float32"), **{t: _fp8_mma(t) for t in OUT_DTYPES}}


@declare(dtypes=("uint8",), tolerances=SCALED_MM_TOLERANCE, reduction=_scaled_mm_k, compute_bound=True)
def fp8_scaled_mm(
    a: Tensor,
    b: Tensor,
    a_scale: Tensor,
    b_scale: Tensor,
    bias: OptionalTensor = None,
    a_format: str = "e4m3fn",
    b_format: str = "e4m3fn",
    out_dtype: str = "bfloat16",
    block_size: int = 128,
) -> Tensor:
    """``(decode(a) * a_scale) @ (decode(b) * b_scale).T + bias``, summed in float32 or wider,
    rounded once to out_dtype (float16, bfloat16, float32). GPU tensor cores may keep the running
    sum in less than float32 (Hopper's FP8 MMA: about 14 bits), so the declared tolerance allows
    ``2^-10 * sqrt(K)`` on results of unit size beyond the rounding of out_dtype.

    a (M, K) and b (N, K) are uint8 bit patterns (b in the layout of a linear weight, as
    ``torch._scaled_mm(a, b.t(), ...)`` takes it); e4m3 x e4m3 for the forward pass, e5m2 for
    gradients (a_format and b_format independently). Each scale is float32 of any granularity of
    fp8_quantize, told apart by its shape: 0-d (tensor), (M, 1) / (N, 1) (row), or
    (ceil(M / block_size), ceil(K / block_size)) (block). bias (N,) of a float dtype.
    """


@fp8_scaled_mm.checker
def _check_fp8_scaled_mm(a, b, a_scale, b_scale, bias, a_format, b_format, out_dtype, block_size):
    op = "fp8_scaled_mm"
    c.rank(op, "a", a, (2,), "(M, K)")
    c.int_dtype(op, "a", a, ("uint8",))
    c.rank(op, "b", b, (2,), "(N, K)")
    c.int_dtype(op, "b", b, ("uint8",))
    if int(b.shape[1]) != int(a.shape[1]):
        raise c.fail(op, "b", f"of shape (N, {int(a.shape[1])}) to match a's K", b)
    c.choice(op, "a_format", a_format, tuple(FORMATS))
    c.choice(op, "b_format", b_format, tuple(FORMATS))
    c.choice(op, "out_dtype", out_dtype, OUT_DTYPES)
    bs = c.integer(op, "block_size", block_size, low=1)
    for name, s, operand in (("a_scale", a_scale, a), ("b_scale", b_scale, b)):
        if not is_array(s) or dtype_name(s) != "float32":
            raise c.fail(op, name, "float32 scales (0-d, one per row, or one per block)", s)
        granularity_of(op, name, s, c.shape_of(operand), bs)
    n = int(b.shape[0])
    if bias is not None:
        c.rank(op, "bias", bias, (1,))
        c.shape_is(op, "bias", bias, (n,), "(N,)")
        c.float_dtype(op, "bias", bias)
    c.result_fits(op, "a", (int(a.shape[0]), n), 4)
    return {"block_size": bs}


def _empty_fp8_quantize(a: Mapping[str, Any]) -> Any:
    """No values: empty bit patterns; the scales as given, or 1 for every group (amax of nothing is 0)."""
    x = a["x"]
    q = e.zeros(x, c.shape_of(x), "uint8")
    if a["scale"] is not None:
        return q, e.cast(a["scale"], "float32")
    return q, e.full(x, scale_shape(c.shape_of(x), a["granularity"], a["block_size"]), 1.0, "float32")


def _transposed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[:-2] + (shape[-1], shape[-2])


def _empty_fp8_quantize_transpose(a: Mapping[str, Any]) -> Any:
    """fp8_quantize's empty results for x and for x.mT."""
    x = a["x"]
    shape = c.shape_of(x)
    q, scale = _empty_fp8_quantize(a)
    q_t = e.zeros(x, _transposed_shape(shape), "uint8")
    if a["granularity"] == "tensor":
        return q, scale, q_t, e.cast(scale, "float32")
    if a["scale"] is not None:  # given block scales: those of x.mT are their transpose
        t = scale.mT if isinstance(scale, torch.Tensor) else np.swapaxes(scale, -1, -2)
        return q, scale, q_t, e.broadcast_copy(t, _transposed_shape(c.shape_of(scale)))
    return q, scale, q_t, e.full(x, scale_shape(_transposed_shape(shape), a["granularity"], a["block_size"]), 1.0, "float32")


def _empty_fp8_quantize_amax(a: Mapping[str, Any]) -> Any:
    """Empty bit patterns, the scale as given, amax 0 (the max of nothing, as torch's amax of an
    empty tensor would be with an initial 0)."""
    x = a["x"]
    return e.zeros(x, c.shape_of(x), "uint8"), e.cast(a["scale"], "float32"), e.zeros(x, (), "float32")


def _empty_fp8_quantize_transpose_amax(a: Mapping[str, Any]) -> Any:
    """fp8_quantize_amax's empty results, and empty transposed bit patterns."""
    x = a["x"]
    q, scale, amax = _empty_fp8_quantize_amax(a)
    return q, scale, e.zeros(x, _transposed_shape(c.shape_of(x)), "uint8"), amax


def current_scale_of(amax: Any, fmt: str) -> Any:
    """``float32(amax) / float32(max_finite)``, 1 where amax is 0, of a NumPy or torch array (as
    the empty rules compute it: on the inputs' kind of array)."""
    top = FORMATS[fmt].max_finite
    if isinstance(amax, torch.Tensor):
        a = amax.float()
        s = a / torch.full((), top, dtype=torch.float32, device=a.device)
        return torch.where(a == 0, torch.ones_like(s), s)
    a = np.asarray(amax, dtype=np.float32)
    with np.errstate(all="ignore"):
        s = (a / np.float32(top)).astype(np.float32)
    return np.where(a == 0, np.float32(1), s).astype(np.float32)


def _empty_fp8_quantize_from_amax(a: Mapping[str, Any]) -> Any:
    """Empty bit patterns, and the scale of the given amax (an empty x casts nothing with it)."""
    x = a["x"]
    return e.zeros(x, c.shape_of(x), "uint8"), current_scale_of(a["amax"], a["format"])


def _empty_fp8_quantize_transpose_from_amax(a: Mapping[str, Any]) -> Any:
    """fp8_quantize_from_amax's empty results, and empty transposed bit patterns."""
    x = a["x"]
    q, scale = _empty_fp8_quantize_from_amax(a)
    return q, scale, e.zeros(x, _transposed_shape(c.shape_of(x)), "uint8")


def _empty_fp8_dequantize(a: Mapping[str, Any]) -> Any:
    return e.zeros(a["q"], c.shape_of(a["q"]), a["out_dtype"])


def _empty_fp8_scaled_mm(a: Mapping[str, Any]) -> Any:
    """An empty result, or for K = 0 (a sum over nothing) the bias in every row (zeros without one)."""
    shape = (int(a["a"].shape[0]), int(a["b"].shape[0]))
    if a["bias"] is None or 0 in shape:
        return e.zeros(a["a"], shape, a["out_dtype"])
    return e.broadcast_copy(e.cast(a["bias"], a["out_dtype"]), shape)


# values of host-resident scale arrays, checked on every call: positive and finite (a 0, negative,
# NaN or infinite scale quantises nothing). Device arrays are not read (see ops/quant.py).
def _scale_values(op: str, *names: str) -> Any:
    """The values check of ``op``: each named scale argument, where given."""

    def check(a: Mapping[str, Any]) -> None:
        for name in names:
            if a[name] is not None:
                check_scale_values(op, name, a[name])

    return check


for _op, _names in ((fp8_quantize, ("scale",)), (fp8_quantize_transpose, ("scale",)), (fp8_quantize_amax, ("scale",)),
                    (fp8_quantize_transpose_amax, ("scale",)), (fp8_dequantize, ("scale",)), (fp8_scaled_mm, ("a_scale", "b_scale"))):
    _op.values(_scale_values(_op.__name__, *_names))
del _op, _names


# zero-size inputs: each op's empty rule (the dispatcher answers such calls with it, no kernel runs)
fp8_quantize.empty(_empty_fp8_quantize)
fp8_quantize_transpose.empty(_empty_fp8_quantize_transpose)
fp8_quantize_amax.empty(_empty_fp8_quantize_amax)
fp8_quantize_transpose_amax.empty(_empty_fp8_quantize_transpose_amax)
fp8_quantize_from_amax.empty(_empty_fp8_quantize_from_amax)
fp8_quantize_transpose_from_amax.empty(_empty_fp8_quantize_transpose_from_amax)
fp8_dequantize.empty(_empty_fp8_dequantize)
fp8_scaled_mm.empty(_empty_fp8_scaled_mm)


@fp8_quantize.fake
def _fake_fp8_quantize(a):
    x = a["x"]
    shape = scale_shape(tuple(x.shape), a["granularity"], a["block_size"])
    return like(x, dtype=torch.uint8), like(x, shape, torch.float32)


@fp8_quantize_transpose.fake
def _fake_fp8_quantize_transpose(a):
    x = a["x"]
    shape, t_shape = tuple(x.shape), _transposed_shape(tuple(x.shape))
    g, bs = a["granularity"], a["block_size"]
    return (like(x, dtype=torch.uint8), like(x, scale_shape(shape, g, bs), torch.float32),
            like(x, t_shape, torch.uint8), like(x, scale_shape(t_shape, g, bs), torch.float32))


@fp8_quantize_amax.fake
def _fake_fp8_quantize_amax(a):
    x = a["x"]
    return like(x, dtype=torch.uint8), like(x, (), torch.float32), like(x, (), torch.float32)


@fp8_quantize_transpose_amax.fake
def _fake_fp8_quantize_transpose_amax(a):
    x = a["x"]
    return (like(x, dtype=torch.uint8), like(x, (), torch.float32), like(x, _transposed_shape(tuple(x.shape)), torch.uint8),
            like(x, (), torch.float32))


@fp8_quantize_from_amax.fake
def _fake_fp8_quantize_from_amax(a):
    x = a["x"]
    return like(x, dtype=torch.uint8), like(x, (), torch.float32)


@fp8_quantize_transpose_from_amax.fake
def _fake_fp8_quantize_transpose_from_amax(a):
    x = a["x"]
    return like(x, dtype=torch.uint8), like(x, (), torch.float32), like(x, _transposed_shape(tuple(x.shape)), torch.uint8)


@fp8_dequantize.fake
def _fake_fp8_dequantize(a):
    return like(a["q"], dtype=getattr(torch, a["out_dtype"]))


@fp8_scaled_mm.fake
def _fake_fp8_scaled_mm(a):
    return like(a["a"], (a["a"].shape[0], a["b"].shape[0]), getattr(torch, a["out_dtype"]))


__all__ = ["fp8_quantize", "fp8_quantize_transpose", "fp8_quantize_amax", "fp8_quantize_transpose_amax", "fp8_quantize_from_amax",
           "fp8_quantize_transpose_from_amax", "fp8_dequantize", "fp8_scaled_mm", "FORMATS", "format_values", "scale_shape",
           "granularity_of", "current_scale_of"]
