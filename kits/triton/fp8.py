"""FP8 kernels: quantisation with the amax reduction fused in (per tensor, row or block, optionally
writing the transposed codes in the same pass), dequantisation, and the scaled GEMM.

Values travel as uint8 bit patterns of a format (ops/fp8.py); ``FMT`` numbers the formats:
0 e4m3fn, 1 e5m2 (NVIDIA's ``tl.float8e4nv`` / ``tl.float8e5``), 2 e4m3fnuz, 3 e5m2fnuz (AMD's
``tl.float8e4b8`` / ``tl.float8e5b16``). The arithmetic follows ops/fp8.py step by step in float32:
``amax`` is the largest ``|x|`` (NaN wins), the current scale ``amax / max_finite`` (1 where amax
is 0), the codes ``encode(x / scale)``, every division IEEE (``tl.math.div_rn``; Triton's ``/`` is
an approximate division on NVIDIA).

**amax as integers.** The float32 bits of ``|x|`` order like the values, and a NaN's bits lie
above every other (infinity included); so the maximum of ``bits(x) & 0x7FFFFFFF`` is the amax with
NaN propagating exactly, and reductions across programs are ``atomic_max`` on int32 (the per-tensor
amax of current scaling: one float32 word on the device, read by the cast kernel, which computes
the scale there: no host synchronisation, so it runs under CUDA graph capture). Delayed scaling's
cast (a given scale, :func:`quantize_amax`) reduces the same way inside the encode kernel
(``AMAX``): each program maxes its tile's word into one zeroed int32, so x is read once. Where the
amax of x was reduced by the op that wrote x (``rms_norm_amax``, ``swiglu_amax``: the same bits),
:func:`quantize_from_amax` hands that word to the cast kernel in place of :func:`_amax`'s.

**Encoding.** On a GPU (``HW=True``) the cast is the hardware's round-to-nearest-even conversion
(``cvt.rn.satfinite.e4m3x2.f32`` on sm_89+, ``v_cvt_pk_fp8_f32`` / ``v_cvt_pk_bf8_f32`` on gfx942)
after an explicit clamp to +-max_finite (saturation, infinities included); the canonical NaN and,
for fnuz, the positive zero are written explicitly (except in the encode kernel's modes listed in
``_EMULATED_MODES``, where the hardware cast gave wrong codes on the H200: those always emulate).
The Triton interpreter's FP8 casts are not exact (Triton 3.9's ``_convert_float`` rounds half up on
the cut-off bit alone and drops the carry out of the mantissa, so 126.74 becomes 104 instead of
112 in e4m3fn; it decodes NaN and infinite codes as numbers), so the interpreter runs
``HW=False``: the same rounding done in float32 with the add-and-subtract trick (adding
``1.5 * 2^(q + 23)`` rounds to a multiple of ``2^q`` to nearest even) and the bits assembled with
integer arithmetic. GPU tests run both. Decoding is always done
with integer arithmetic (exact, and a streaming kernel has the instructions to spare).

**Transposed launches.** The casts that also write q_t (per tensor, given or current scales, the
fused amax; row-wise current scaling with its amax pass; given block scales) take their tile from
``pick``, the kit's autotuned choice among the vendor plugin's :class:`Fp8TransposeConfig`
candidates (the first is the ``block_elems`` tile these casts always used, which runs wherever
nothing is tuned). The block-wise current cast (``fp8_blocks_kernel``) keeps its one launch.

**The GEMM** multiplies FP8 tiles with the tensor cores (``tl.dot`` of FP8 operands, float32
accumulation); block scales are applied per K step (``BLOCK_K`` divides the block size, so a step
lies in one scale block), tensor and row scales and the bias in the epilogue, then one rounding.
In the interpreter the tiles are decoded to float32 first (exact: every FP8 value is a float32).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_pow2
from .config import Fp8TransposeConfig, fp8_transpose_tile
from .gemm import tile_rows_cols

#: the formats in ``FMT`` order
FORMAT_IDS = {"e4m3fn": 0, "e5m2": 1, "e4m3fnuz": 2, "e5m2fnuz": 3}
#: scale modes of the encode kernel
S_TENSOR, S_TENSOR_AMAX, S_ROW, S_ROW_AMAX, S_BLOCK = 0, 1, 2, 3, 4
#: amax modes: one word for the tensor, or a word per row and per column
A_TENSOR, A_ROWS_COLS = 0, 1
#: granularity codes of the GEMM's scales
G_TENSOR, G_ROW, G_BLOCK = 0, 1, 2
#: the transposed casts' modes as their autotune keys name them
_MODE_NAMES = {S_TENSOR: "tensor", S_TENSOR_AMAX: "tensor_amax", S_ROW_AMAX: "rows_cols", S_BLOCK: "blocks"}

#: how a transposed cast chooses its launch: ``pick(key, run, nbytes)`` returns one of the vendor
#: plugin's candidates for problem ``key`` (the kit: :func:`hal_triton.autotune.choose`, which may
#: first time ``run(candidate)``, the whole cast on the call's own inputs, moving ``nbytes``)
Pick = Callable[[str, Callable[[Fp8TransposeConfig], Any], int], Fp8TransposeConfig]


# --- encode / decode ----------------------------------------------------------------------------
# Per-format constants are compile-time expressions of FMT: mantissa bits 3 (e4m3*) or 2 (e5m2*),
# exponent bias 7, 15, 8, 16, the largest finite value, the smallest subnormal 2^(1 - bias - M).


@triton.jit
def _encode_sw(v, FMT: tl.constexpr):
    """uint8 codes of float32 ``v`` by float32 and integer arithmetic (any device, the interpreter)."""
    M: tl.constexpr = 3 if FMT % 2 == 0 else 2
    BIAS: tl.constexpr = 7 if FMT == 0 else (15 if FMT == 1 else (8 if FMT == 2 else 16))
    EMIN: tl.constexpr = 1 - BIAS
    MAXF: tl.constexpr = 448.0 if FMT == 0 else (240.0 if FMT == 2 else 57344.0)
    INV_SUB: tl.constexpr = 512.0 if FMT == 0 else (65536.0 if FMT == 1 else (1024.0 if FMT == 2 else 131072.0))
    a = tl.minimum(tl.abs(v), MAXF)
    a = tl.where(v != v, 0.0, a)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    quantum = tl.maximum(e, EMIN) - M  # the spacing of the format's values around a: 2^quantum
    magic = ((quantum + 23 + 127) << 23 | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^(quantum + 23)
    r = (a + magic) - magic  # a rounded to a multiple of 2^quantum, ties to even
    rb = r.to(tl.int32, bitcast=True)
    re = ((rb >> 23) & 0xFF) - 127
    normal = ((re + BIAS) << M) | ((rb >> (23 - M)) & ((1 << M) - 1))
    subnormal = (r * INV_SUB).to(tl.int32)  # r in units of the smallest subnormal: exact
    code = tl.where(re >= EMIN, normal, subnormal)
    return _finish(code, v, FMT)


@triton.jit
def _encode_hw(v, FMT: tl.constexpr):
    """uint8 codes of float32 ``v`` by the hardware's round-to-nearest-even conversion."""
    MAXF: tl.constexpr = 448.0 if FMT == 0 else (240.0 if FMT == 2 else 57344.0)
    c = tl.minimum(tl.maximum(v, -MAXF), MAXF)
    if FMT == 0:
        q = c.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    elif FMT == 1:
        q = c.to(tl.float8e5, fp_downcast_rounding="rtne")
    elif FMT == 2:
        q = c.to(tl.float8e4b8, fp_downcast_rounding="rtne")
    else:
        q = c.to(tl.float8e5b16, fp_downcast_rounding="rtne")
    code = q.to(tl.uint8, bitcast=True).to(tl.int32) & 0x7F  # the magnitude; the sign is v's
    return _finish(code, v, FMT)


@triton.jit
def _finish(code, v, FMT: tl.constexpr):
    """A magnitude code with v's sign (no negative zero in fnuz), NaN as the canonical NaN."""
    negative = (v.to(tl.int32, bitcast=True) >> 31) != 0
    if FMT >= 2:
        negative = negative & (code != 0)
        nan_bits = 0x80
    else:
        nan_bits = 0x7F
    code = tl.where(negative, code | 0x80, code)
    return tl.where(v != v, nan_bits, code).to(tl.uint8)


@triton.jit
def _encode(v, FMT: tl.constexpr, HW: tl.constexpr):
    if HW:
        return _encode_hw(v, FMT)
    else:
        return _encode_sw(v, FMT)


@triton.jit
def _decode(q, FMT: tl.constexpr):
    """float32 values of uint8 codes ``q`` (exact; NaN and infinite codes as such)."""
    M: tl.constexpr = 3 if FMT % 2 == 0 else 2
    BIAS: tl.constexpr = 7 if FMT == 0 else (15 if FMT == 1 else (8 if FMT == 2 else 16))
    SUB: tl.constexpr = 0.001953125 if FMT == 0 else (2.0**-16 if FMT == 1 else (0.0009765625 if FMT == 2 else 2.0**-17))
    E_ONES: tl.constexpr = (1 << (7 - M)) - 1
    b = q.to(tl.int32) & 0xFF
    e = (b >> M) & E_ONES
    f = b & ((1 << M) - 1)
    sign = (b >> 7) << 31
    normal = (sign | ((e - BIAS + 127) << 23) | (f << (23 - M))).to(tl.float32, bitcast=True)
    subnormal = f.to(tl.float32) * SUB
    val = tl.where(e == 0, tl.where(sign != 0, -subnormal, subnormal), normal)
    if FMT == 0:
        val = tl.where((b & 0x7F) == 0x7F, float("nan"), val)
    elif FMT == 1:
        val = tl.where(e == E_ONES, tl.where(f == 0, tl.where(sign != 0, float("-inf"), float("inf")), float("nan")), val)
    else:
        val = tl.where(b == 0x80, float("nan"), val)
    return val


@triton.jit
def _rounded(v, DT: tl.constexpr):
    """float32 ``v`` rounded to nearest even in ``DT``. bfloat16 is rounded on the bits first (the
    Triton interpreter truncates float32 -> bfloat16; compiled code then converts exactly)."""
    if DT == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return tl.where(v != v, v, b.to(tl.float32, bitcast=True)).to(tl.bfloat16)
    else:
        return v.to(DT)


@triton.jit
def _scale_of(amax_bits, FMT: tl.constexpr):
    """The current scale of an amax given as float32 bits: amax / max_finite, 1 where amax is 0."""
    MAXF: tl.constexpr = 448.0 if FMT == 0 else (240.0 if FMT == 2 else 57344.0)
    amax = amax_bits.to(tl.float32, bitcast=True)
    return tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, tl.zeros_like(amax) + MAXF))


@triton.jit
def _div_scalar(x, s):
    """``x / s`` for one float32 scale ``s``: where s is a normal power of two, 1/s is exact, so
    ``x * (1/s)`` is the same correctly rounded quotient (overflow, underflow and signed zeros
    included) at the cost of a multiplication; otherwise the IEEE division."""
    sb = s.to(tl.int32, bitcast=True)
    e = (sb >> 23) & 0xFF
    if ((sb & 0x7FFFFF) == 0) & (e >= 1) & (e <= 253):
        v = x * ((((254 - e) << 23) | ((sb >> 31) << 31)).to(tl.float32, bitcast=True))
    else:
        v = tl.math.div_rn(x, s + tl.zeros_like(x))
    return v


@triton.jit
def _abs_bits(x):
    """float32 bits of |x| as int32 (ordered like the values, NaN above all)."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _tile3(pid, M, K, n_tm, n_tk, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tile ``pid`` of a (B, M, K) array: batch, rows, columns, mask, element offsets."""
    per = n_tm * n_tk
    b = pid // per
    t = pid % per
    rows = (t // n_tk) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (t % n_tk) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    offs = b.to(tl.int64) * M * K + rows.to(tl.int64)[:, None] * K + cols[None, :]
    return b, rows, cols, mask, offs


# --- kernels -----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_tm", "n_tk"])
def fp8_amax_kernel(x_ptr, amax_ptr, amaxt_ptr, M, K, n_tm, n_tk, MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """amax bits of a (B, M, K) array, by atomic max: of everything (MODE 0, one word), or per row
    (amax_ptr, B*M words) and per column (amaxt_ptr, B*K words) (MODE 1). Words start at 0."""
    b, rows, cols, mask, offs = _tile3(tl.program_id(0), M, K, n_tm, n_tk, BLOCK_R, BLOCK_C)
    bits = tl.where(mask, _abs_bits(tl.load(x_ptr + offs, mask=mask, other=0.0)), 0)
    if MODE == 0:
        tl.atomic_max(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))
    else:
        tl.atomic_max(amax_ptr + b.to(tl.int64) * M + rows, tl.max(bits, axis=1), mask=rows < M)
        tl.atomic_max(amaxt_ptr + b.to(tl.int64) * K + cols, tl.max(bits, axis=0), mask=cols < K)


@triton.jit(do_not_specialize=["n_tm", "n_tk", "kb"])
def fp8_encode_kernel(
    x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, amax_ptr, amaxt_ptr, M, K, n_tm, n_tk, kb, bs,
    FMT: tl.constexpr, SCALE: tl.constexpr, TRANSPOSE: tl.constexpr, HW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    AMAX: tl.constexpr,
):
    """Codes of a (B, M, K) array (and of its transpose into (B, K, M) when TRANSPOSE), one tile per
    program, the scale given (tensor, row or block: s_ptr) or computed from amax words (tensor or
    rows + columns; the scales are written to s_ptr / st_ptr once). AMAX (given scales: the amax
    words are not read): the tile's largest |x| bits atomically maxed into the int32 word at
    amax_ptr (0 to start), the amax of delayed scaling from the cast's own read of x."""
    pid = tl.program_id(0)
    b, rows, cols, mask, offs = _tile3(pid, M, K, n_tm, n_tk, BLOCK_R, BLOCK_C)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.where(mask, _abs_bits(x), 0), axis=1), axis=0))
    row_ok = rows < M
    col_ok = cols < K
    if SCALE == 0:
        s = tl.load(s_ptr)
        st = s
    elif SCALE == 1:
        s = _scale_of(tl.load(amax_ptr), FMT)
        st = s
        if pid == 0:
            tl.store(s_ptr, s)
            if TRANSPOSE:
                tl.store(st_ptr, s)
    elif SCALE == 2:
        s = tl.load(s_ptr + b.to(tl.int64) * M + rows, mask=row_ok, other=1.0)[:, None]
        st = s
    elif SCALE == 3:
        srow = _scale_of(tl.load(amax_ptr + b.to(tl.int64) * M + rows, mask=row_ok, other=0), FMT)
        scol = _scale_of(tl.load(amaxt_ptr + b.to(tl.int64) * K + cols, mask=col_ok, other=0), FMT)
        t = pid % (n_tm * n_tk)
        if t % n_tk == 0:
            tl.store(s_ptr + b.to(tl.int64) * M + rows, srow, mask=row_ok)
        if t // n_tk == 0:
            tl.store(st_ptr + b.to(tl.int64) * K + cols, scol, mask=col_ok)
        s = srow[:, None]
        st = scol[None, :]
    else:
        mb = (M + bs - 1) // bs
        sidx = b.to(tl.int64) * mb * kb + (rows // bs)[:, None] * kb + (cols // bs)[None, :]
        s = tl.load(s_ptr + sidx, mask=mask, other=1.0)
        st = s
    if SCALE == 0:
        v = _div_scalar(x, s)
    else:
        v = tl.math.div_rn(x, s + tl.zeros_like(x))
    q = _encode(v, FMT, HW)
    tl.store(q_ptr + offs, q, mask=mask)
    if TRANSPOSE:
        if SCALE == 3:
            q = _encode(tl.math.div_rn(x, st + tl.zeros_like(x)), FMT, HW)
        offs_t = b.to(tl.int64) * M * K + cols.to(tl.int64)[:, None] * M + rows[None, :]
        tl.store(qt_ptr + offs_t, tl.trans(q), mask=tl.trans(mask))


@triton.jit(do_not_specialize=["R"])
def fp8_rows_kernel(x_ptr, q_ptr, s_ptr, R, K, FMT: tl.constexpr, HW: tl.constexpr, ONE_TILE: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row-wise current scaling in one launch: each program owns BLOCK_R rows of an (R, K) array,
    reduces their |x| and writes their codes and scales (one read of x when a row fits a tile)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    base = rows.to(tl.int64)[:, None] * K
    cols = tl.arange(0, BLOCK_C)
    if ONE_TILE:
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = _scale_of(tl.max(tl.where(mask, _abs_bits(x), 0), axis=1), FMT)
        tl.store(q_ptr + base + cols[None, :], _encode(tl.math.div_rn(x, s[:, None] + tl.zeros_like(x)), FMT, HW), mask=mask)
    else:
        amax = tl.zeros([BLOCK_R], tl.int32)
        for k0 in range(0, K, BLOCK_C):
            mask = row_ok[:, None] & ((k0 + cols) < K)[None, :]
            x = tl.load(x_ptr + base + (k0 + cols)[None, :], mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.where(mask, _abs_bits(x), 0), axis=1))
        s = _scale_of(amax, FMT)
        for k0 in range(0, K, BLOCK_C):
            mask = row_ok[:, None] & ((k0 + cols) < K)[None, :]
            x = tl.load(x_ptr + base + (k0 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + base + (k0 + cols)[None, :], _encode(tl.math.div_rn(x, s[:, None] + tl.zeros_like(x)), FMT, HW), mask=mask)
    tl.store(s_ptr + rows, s, mask=row_ok)


@triton.jit(do_not_specialize=["mb", "kb"])
def fp8_blocks_kernel(x_ptr, q_ptr, qt_ptr, s_ptr, M, K, mb, kb, bs, FMT: tl.constexpr, HW: tl.constexpr,
                      TRANSPOSE: tl.constexpr, BLOCK_S: tl.constexpr, SUB_R: tl.constexpr):
    """Block-wise current scaling in one launch: each program owns one bs x bs tile of a (B, M, K)
    array (BLOCK_S = next power of two of bs columns, SUB_R rows at a time), reduces it, then writes
    its codes (and their transpose into (B, K, M)) and its scale."""
    pid = tl.program_id(0)
    b = pid // (mb * kb)
    t = pid % (mb * kb)
    r0 = (t // kb) * bs
    c0 = (t % kb) * bs
    sub = tl.arange(0, SUB_R)
    cols = c0 + tl.arange(0, BLOCK_S)
    col_ok = (cols < K) & (tl.arange(0, BLOCK_S) < bs)
    base = b.to(tl.int64) * M * K
    amax = tl.zeros([SUB_R], tl.int32)
    for i in range(0, bs, SUB_R):
        rows = r0 + i + sub
        mask = ((rows < M) & (i + sub < bs))[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + base + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.where(mask, _abs_bits(x), 0), axis=1))
    s = _scale_of(tl.max(amax, axis=0), FMT)
    for i in range(0, bs, SUB_R):
        rows = r0 + i + sub
        mask = ((rows < M) & (i + sub < bs))[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + base + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = _encode(tl.math.div_rn(x, s + tl.zeros_like(x)), FMT, HW)
        tl.store(q_ptr + base + rows.to(tl.int64)[:, None] * K + cols[None, :], q, mask=mask)
        if TRANSPOSE:
            tl.store(qt_ptr + base + cols.to(tl.int64)[:, None] * M + rows[None, :], tl.trans(q), mask=tl.trans(mask))
    tl.store(s_ptr + pid, s)


@triton.jit(do_not_specialize=["n_tm", "n_tk", "kb"])
def fp8_decode_kernel(q_ptr, out_ptr, s_ptr, s_val, M, K, n_tm, n_tk, kb, bs, FMT: tl.constexpr, SCALE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``decode(q) * scale`` of a (B, M, K) array of codes, rounded to out's dtype. SCALE: -1 a
    number (s_val), 0 one float32 on the device, 2 per row, 4 per block (as fp8_encode_kernel)."""
    b, rows, cols, mask, offs = _tile3(tl.program_id(0), M, K, n_tm, n_tk, BLOCK_R, BLOCK_C)
    v = _decode(tl.load(q_ptr + offs, mask=mask, other=0), FMT)
    if SCALE == -1:
        s = s_val
    elif SCALE == 0:
        s = tl.load(s_ptr)
    elif SCALE == 2:
        s = tl.load(s_ptr + b.to(tl.int64) * M + rows, mask=rows < M, other=1.0)[:, None]
    else:
        mb = (M + bs - 1) // bs
        s = tl.load(s_ptr + b.to(tl.int64) * mb * kb + (rows // bs)[:, None] * kb + (cols // bs)[None, :], mask=mask, other=1.0)
    tl.store(out_ptr + offs, _rounded(v * s, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_tile(t, FMT: tl.constexpr, DECODE: tl.constexpr):
    """A uint8 tile as the GEMM's operand: the FP8 type (tensor cores), or float32 (interpreter)."""
    if DECODE:
        return _decode(t, FMT)
    elif FMT == 0:
        return t.to(tl.float8e4nv, bitcast=True)
    elif FMT == 1:
        return t.to(tl.float8e5, bitcast=True)
    elif FMT == 2:
        return t.to(tl.float8e4b8, bitcast=True)
    else:
        return t.to(tl.float8e5b16, bitcast=True)


@triton.jit(do_not_specialize=["M", "kb"])
def fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, sam, sbn, scm, kb, bs,
    A_FMT: tl.constexpr, B_FMT: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr, HAS_BIAS: tl.constexpr, DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C = (A * sa) @ (B * sb).T + bias for A (M, K), B (N, K) uint8 codes (unit stride along K),
    float32 accumulation; block scales (SA/SB == 2, shape (ceil(rows / bs), kb)) per K step, tensor
    (0) and row (1) scales in the epilogue."""
    rm, rn = tile_rows_cols(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * sam
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * sbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_rows + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_cols + (k0 + rk)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        a = _fp8_tile(a, A_FMT, DECODE)
        b = _fp8_tile(b, B_FMT, DECODE)
        if SA == 2 or SB == 2:
            part = tl.dot(a, b, out_dtype=tl.float32)
            kblk = k0 // bs
            if SA == 2:
                part = part * tl.load(sa_ptr + (rm // bs) * kb + kblk, mask=m_ok, other=1.0)[:, None]
            if SB == 2:
                part = part * tl.load(sb_ptr + (rn // bs) * kb + kblk, mask=n_ok, other=1.0)[None, :]
            acc += part
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    if SA == 0:
        acc = acc * tl.load(sa_ptr)
    elif SA == 1:
        acc = acc * tl.load(sa_ptr + rm, mask=m_ok, other=1.0)[:, None]
    if SB == 0:
        acc = acc * tl.load(sb_ptr)
    elif SB == 1:
        acc = acc * tl.load(sb_ptr + rn, mask=n_ok, other=1.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + rm.to(tl.int64)[:, None] * scm + rn[None, :]
    tl.store(c, _rounded(acc, c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --- host functions ---------------------------------------------------------------------------


def _batched(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x contiguous as (B, M, K): the last two dimensions, or (1, 1, n) for fewer than two."""
    x = x.contiguous()
    if x.dim() >= 2:
        m, k = int(x.shape[-2]), int(x.shape[-1])
        return x, x.numel() // max(1, m * k) if m * k else 0, m, k
    return x, 1, 1, x.numel()


def _tile_shape(k: int, block_elems: int, transpose: bool = False) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of about ``block_elems`` elements for rows of length k: long rows of
    whole lines, or for a transposed store square-ish tiles (at most 64 columns, at least 16 rows),
    whose columns become rows of q_t."""
    if transpose:
        return fp8_transpose_tile(k, block_elems)
    block_c = max(16, min(next_pow2(max(k, 1)), block_elems))
    return max(1, block_elems // block_c), block_c


#: scale modes of fp8_encode_kernel whose divisor varies along a tile's columns (given blocks; the
#: column scales of the transposed row-wise codes). On the H200 (Triton 3.6, sm_90) the hardware cast
#: gave wrong codes in these modes only (a quarter to an eighth of them, with the right signs), while
#: the emulated cast passed bit for bit on the same kernel and tile; the PTX Triton 3.6 emits reads
#: right, so the cause is unknown. These modes encode with the emulated cast on every device.
_EMULATED_MODES = (S_ROW_AMAX, S_BLOCK)
#: On an H100 (Triton 3.6, 66d0b65) the hardware cast also wrote wrong magnitudes (right signs) in
#: 13-40% of the codes of per-tensor transposed casts of batched arrays ((3, 20, 9), (6, 9, 12)),
#: while the 2-D ones passed: transposed launches over more than one matrix encode with the emulated
#: cast as well (hal.fp8.Linear's casts are 2-D: its hot path keeps the hardware cast).
#: tests/cuda/device/test_fp8_small_tiles.py probes both casts over such shapes (setting this False).
_EMULATE_BATCHED_TRANSPOSE = True
#: On an H100 (Triton 3.6, 7fc0fa7) the dispatched transposed per-tensor casts failed
#: test_fp8_small_tiles.py (given, current and fused-amax scales alike; the plain casts passed) on a
#: shape its log did not name before a time limit cut it; every failing launch seen so far had rows
#: shorter than the 64 columns of the widest transposed tile (K 9 and 12: 16-column tiles), and
#: conformance's wider transposed cases pass. Transposed launches of rows shorter than this encode
#: with the emulated cast (tiny arrays: the cost is nothing; the LLM shapes keep the hardware cast).
_EMULATE_TRANSPOSE_BELOW_K = 64


#: the longest row fp8_rows_kernel keeps whole in registers (one read of x instead of two)
_ONE_TILE_ROW = 16384


def _row_tile(k: int, block_elems: int, num_warps: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) of fp8_rows_kernel: rows up to ``_ONE_TILE_ROW`` long in one
    tile (x read once; the warps grow to keep about 16 elements a thread, at most 16 warps), longer
    ones in ``block_elems`` chunks (two passes, the second from L2)."""
    if k <= block_elems or k > _ONE_TILE_ROW:
        return (*_tile_shape(k, block_elems), num_warps)
    block_c = next_pow2(k)
    return 1, block_c, max(num_warps, min(16, block_c // 512))


def _launch_tile(k: int, block_elems: int, num_warps: int, transpose: bool,
                 tile: Optional[Fp8TransposeConfig]) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) of a tiled cast: ``tile``'s where one was chosen, else the
    ``block_elems`` tile (:func:`_tile_shape`) over ``num_warps``."""
    if tile is not None:
        return tile.block_r, tile.block_c, tile.num_warps
    return (*_tile_shape(k, block_elems, transpose), num_warps)


def _hw_cast(hw: bool, mode: int, transpose: bool, nb: int, k: int) -> bool:
    """Whether a launch of fp8_encode_kernel encodes with the hardware cast: asked for, and not one
    of the launches kept on the emulated cast (``_EMULATED_MODES``, ``_EMULATE_BATCHED_TRANSPOSE``,
    ``_EMULATE_TRANSPOSE_BELOW_K``)."""
    if not hw or mode in _EMULATED_MODES:
        return False
    return not (transpose and ((_EMULATE_BATCHED_TRANSPOSE and nb > 1) or k < _EMULATE_TRANSPOSE_BELOW_K))


def _transpose_key(x3: torch.Tensor, nb: int, m: int, k: int, fmt: str, mode: int, hw: bool, reduce_amax: bool = False) -> str:
    """The autotune key of a transposed cast: what changes its best tile (the kernel's mode, the
    format and which cast encodes, the input dtype, K exact, M and the batch bucketed)."""
    what = _MODE_NAMES[mode] + ("+amax" if reduce_amax else "")
    return f"fp8_quantize_transpose/{what}/{fmt}/{'hw' if hw else 'sw'}/{x3.dtype}/b{next_pow2(nb)}/m{next_pow2(m)}/k{k}"


def _cast_bytes(x3: torch.Tensor, reads: int = 1) -> int:
    """The bytes a transposed cast moves: x read ``reads`` times, q and q_t written (scales ignored)."""
    return (reads * x3.element_size() + 2) * x3.numel()


def _picked(pick: Optional[Pick], key: str, nbytes: int, run: Callable[[Optional[Fp8TransposeConfig]], None]) -> None:
    """``run(tile)`` with the tile ``pick`` chooses for problem ``key`` (None, the ``block_elems``
    launch, where nothing picks). The chooser may call ``run`` once per candidate first, so every
    ``run`` repeats the whole cast: it rewrites q, q_t and the scales, and each amax word it maxes
    into either starts from a zeroed word allocated inside ``run`` or takes the atomic max of the
    same |x| bits again (idempotent)."""
    run(pick(key, run, nbytes) if pick is not None else None)


def _encode_launch(x3, q, qt, s, st, amax, amaxt, m, k, nb, mode, fmt, transpose, hw, block_elems, num_warps, kb=1, bs=1,
                   reduce_amax=False, pick: Optional[Pick] = None, tile: Optional[Fp8TransposeConfig] = None) -> None:
    """fp8_encode_kernel over x3 (B = nb matrices of m x k): with ``tile``, or for a transposed
    launch the tile ``pick`` chooses, else the ``block_elems`` tile over ``num_warps``."""
    hw = _hw_cast(hw, mode, transpose, nb, k)

    def run(t: Optional[Fp8TransposeConfig]) -> None:
        block_r, block_c, warps = _launch_tile(k, block_elems, num_warps, transpose, t)
        n_tm, n_tk = cdiv(m, block_r), cdiv(k, block_c)
        launch(fp8_encode_kernel, (nb * n_tm * n_tk,), x3, q, qt, s, st, amax, amaxt, m, k, n_tm, n_tk, kb, bs,
               FMT=FORMAT_IDS[fmt], SCALE=mode, TRANSPOSE=transpose, HW=hw, BLOCK_R=block_r, BLOCK_C=block_c, AMAX=reduce_amax,
               num_warps=warps, fp_fusion=False)

    if transpose and tile is None:
        _picked(pick, _transpose_key(x3, nb, m, k, fmt, mode, hw, reduce_amax), _cast_bytes(x3), run)
    else:
        run(tile)


def _amax(x3, m, k, nb, mode, block_elems, num_warps, tile: Optional[Fp8TransposeConfig] = None):
    """amax words (int32 bits of float32, 0 to start): one, or per row and per column (on square
    tiles, ``tile`` where the transposed cast after it chose one: few atomics per element)."""
    dev = x3.device
    if mode == A_TENSOR:
        amax, amaxt = torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    else:
        amax, amaxt = torch.zeros(nb * m, dtype=torch.int32, device=dev), torch.zeros(nb * k, dtype=torch.int32, device=dev)
    block_r, block_c, warps = _launch_tile(k, block_elems, num_warps, mode == A_ROWS_COLS, tile)
    n_tm, n_tk = cdiv(m, block_r), cdiv(k, block_c)
    launch(fp8_amax_kernel, (nb * n_tm * n_tk,), x3, amax, amaxt, m, k, n_tm, n_tk, MODE=mode, BLOCK_R=block_r, BLOCK_C=block_c,
           num_warps=warps)
    return amax, amaxt


def _rows_cols_transposed(x3, q, qt, s, st, m, k, nb, fmt, hw, block_elems, num_warps, pick: Optional[Pick]) -> None:
    """Row-wise current scaling of x and x.mT: the amax pass (a word per row and per column) and the
    encode, both on the tile ``pick`` chooses for the two together (x read twice)."""
    def run(tile: Optional[Fp8TransposeConfig]) -> None:
        amax, amaxt = _amax(x3, m, k, nb, A_ROWS_COLS, block_elems, num_warps, tile)  # fresh zeroed words each run
        _encode_launch(x3, q, qt, s, st, amax, amaxt, m, k, nb, S_ROW_AMAX, fmt, True, hw, block_elems, num_warps, tile=tile)

    key = _transpose_key(x3, nb, m, k, fmt, S_ROW_AMAX, _hw_cast(hw, S_ROW_AMAX, True, nb, k))
    _picked(pick, key, _cast_bytes(x3, reads=2), run)


def quantize(x: torch.Tensor, fmt: str, granularity: str, scale: Optional[torch.Tensor], block_size: int, transpose: bool,
             hw: bool, block_elems: int, num_warps: int, pick: Optional[Pick] = None) -> tuple:
    """fp8_quantize (``transpose=False``: (q, scale)) or fp8_quantize_transpose ((q, scale, q_t,
    scale_t)). ``hw`` picks the hardware cast (GPUs) or the emulated one (the interpreter);
    ``pick`` the transposed launch (:data:`Pick`; without it the ``block_elems`` tile)."""
    x3, nb, m, k = _batched(x)
    dev = x.device
    q = torch.empty(x3.shape, dtype=torch.uint8, device=dev)
    qt = torch.empty(x3.shape[:-2] + (k, m), dtype=torch.uint8, device=dev) if transpose else q
    fid = FORMAT_IDS[fmt]
    if granularity == "block":
        mb, kb = cdiv(m, block_size), cdiv(k, block_size)
        if scale is not None:
            s = scale.float().contiguous().clone()
            _encode_launch(x3, q, qt, s, s, s, s, m, k, nb, S_BLOCK, fmt, transpose, hw, block_elems, num_warps, kb=kb, bs=block_size,
                           pick=pick)
        else:
            s = torch.empty(x3.shape[:-2] + (mb, kb), dtype=torch.float32, device=dev)
            block_s = next_pow2(block_size)
            sub_r = max(1, min(next_pow2(block_size), block_elems // block_s))
            sub_r = max(sub_r, 16) if transpose else sub_r
            launch(fp8_blocks_kernel, (nb * mb * kb,), x3, q, qt, s, m, k, mb, kb, block_size, FMT=fid, HW=hw, TRANSPOSE=transpose,
                   BLOCK_S=max(block_s, 16) if transpose else block_s, SUB_R=sub_r, num_warps=num_warps, fp_fusion=False)
        return (q, s, qt, s.mT.contiguous()) if transpose else (q, s)
    if granularity == "row":
        rows = x3.numel() // max(1, k)
        if scale is not None and transpose:
            raise ValueError("row-wise given scales of x do not apply to x.mT (fp8_quantize_transpose refuses them)")
        if scale is not None:
            s = scale.float().contiguous().clone()
            _encode_launch(x3, q, qt, s, s, s, s, rows, k, 1, S_ROW, fmt, False, hw, block_elems, num_warps)
            return q, s
        s = torch.empty(x3.shape[:-1] + (1,), dtype=torch.float32, device=dev)
        if not transpose:
            block_r, block_c, warps = _row_tile(k, block_elems, num_warps)
            launch(fp8_rows_kernel, (cdiv(rows, block_r),), x3, q, s, rows, k, FMT=fid, HW=hw, ONE_TILE=k <= block_c,
                   BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps, fp_fusion=False)
            return q, s
        st = torch.empty(x3.shape[:-2] + (k, 1), dtype=torch.float32, device=dev)
        _rows_cols_transposed(x3, q, qt, s, st, m, k, nb, fmt, hw, block_elems, num_warps, pick)
        return q, s, qt, st
    # tensor
    if scale is not None:
        s = scale.float().reshape(()).clone()
        st = s.clone() if transpose else s
        _encode_launch(x3, q, qt, s, st, s, s, m, k, nb, S_TENSOR, fmt, transpose, hw, block_elems, num_warps, pick=pick)
    else:
        s = torch.empty((), dtype=torch.float32, device=dev)
        st = torch.empty((), dtype=torch.float32, device=dev) if transpose else s
        amax, _ = _amax(x3, m, k, nb, A_TENSOR, block_elems, num_warps)
        _encode_launch(x3, q, qt, s, st, amax, amax, m, k, nb, S_TENSOR_AMAX, fmt, transpose, hw, block_elems, num_warps, pick=pick)
    q = q.view(x.shape)
    return (q, s, qt, st) if transpose else (q, s)


def quantize_amax(x: torch.Tensor, fmt: str, scale: torch.Tensor, transpose: bool, hw: bool, block_elems: int,
                  num_warps: int, pick: Optional[Pick] = None) -> tuple:
    """fp8_quantize_amax ((q, scale, amax)) or fp8_quantize_transpose_amax ((q, scale, q_t, amax)):
    the given-scale per-tensor cast, each program also reducing its tile's |x| into one int32 word
    (the float32 bits of the amax: zeroed here, read back as float32 by a view), so x is read once.
    Timing transposed launches on these inputs (``pick``) maxes the same bits into the word again."""
    x3, nb, m, k = _batched(x)
    dev = x.device
    q = torch.empty(x3.shape, dtype=torch.uint8, device=dev)
    qt = torch.empty(x3.shape[:-2] + (k, m), dtype=torch.uint8, device=dev) if transpose else q
    s = scale.float().reshape(()).clone()
    word = torch.zeros(1, dtype=torch.int32, device=dev)
    _encode_launch(x3, q, qt, s, s, word, word, m, k, nb, S_TENSOR, fmt, transpose, hw, block_elems, num_warps, reduce_amax=True,
                   pick=pick)
    amax = word.view(torch.float32).reshape(())
    q = q.view(x.shape)
    return (q, s, qt, amax) if transpose else (q, s, amax)


def quantize_from_amax(x: torch.Tensor, fmt: str, amax: torch.Tensor, transpose: bool, hw: bool, block_elems: int,
                       num_warps: int, pick: Optional[Pick] = None) -> tuple:
    """fp8_quantize_from_amax ((q, scale)) or fp8_quantize_transpose_from_amax ((q, scale, q_t)):
    current scaling's cast (``S_TENSOR_AMAX``) with the amax word given instead of reduced here: the
    encode kernel computes the scale from its float32 bits as after :func:`_amax` (the same
    ``_scale_of``), so the codes and scale are fp8_quantize's bit for bit, from one pass over x."""
    x3, nb, m, k = _batched(x)
    dev = x.device
    q = torch.empty(x3.shape, dtype=torch.uint8, device=dev)
    qt = torch.empty(x3.shape[:-2] + (k, m), dtype=torch.uint8, device=dev) if transpose else q
    s = torch.empty((), dtype=torch.float32, device=dev)
    word = amax.float().reshape(1).contiguous().view(torch.int32)
    if x3.numel():
        _encode_launch(x3, q, qt, s, s, word, word, m, k, nb, S_TENSOR_AMAX, fmt, transpose, hw, block_elems, num_warps, pick=pick)
    else:  # no program to write the scale
        s.copy_(_scale_word(word, fmt))
    q = q.view(x.shape)
    return (q, s, qt) if transpose else (q, s)


def _scale_word(word: torch.Tensor, fmt: str) -> torch.Tensor:
    from hal.ops.fp8 import current_scale_of

    return current_scale_of(word.view(torch.float32).reshape(()), fmt)


def dequantize(q: torch.Tensor, scale, fmt: str, block_size: int, out_dtype: torch.dtype, block_elems: int, num_warps: int) -> torch.Tensor:
    """fp8_dequantize: ``decode(q) * scale`` rounded to ``out_dtype`` (scale a number or float32 scales)."""
    q3, nb, m, k = _batched(q)
    out = torch.empty(q3.shape, dtype=out_dtype, device=q.device)
    kb = 1
    if not isinstance(scale, torch.Tensor):
        mode, s, s_val = -1, q3, float(scale)
    elif scale.dim() == 0:
        mode, s, s_val = S_TENSOR, scale.contiguous(), 1.0
    elif tuple(scale.shape[-1:]) == (1,) and (q.dim() < 2 or int(scale.shape[-2]) == m):
        mode, s, s_val = S_ROW, scale.contiguous(), 1.0
        m, nb = q3.numel() // max(1, k), 1
    else:
        mode, s, s_val, kb = S_BLOCK, scale.contiguous(), 1.0, cdiv(k, block_size)
    block_r, block_c = _tile_shape(k, block_elems)
    n_tm, n_tk = cdiv(m, block_r), cdiv(k, block_c)
    launch(fp8_decode_kernel, (nb * n_tm * n_tk,), q3, out, s, s_val, m, k, n_tm, n_tk, kb, block_size, FMT=FORMAT_IDS[fmt],
           SCALE=mode, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps)
    return out.view(q.shape)


def _granularity(scale: torch.Tensor, rows: int) -> int:
    if scale.dim() == 0:
        return G_TENSOR
    if tuple(scale.shape) == (rows, 1):
        return G_ROW
    return G_BLOCK


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, bias: Optional[torch.Tensor],
              a_format: str, b_format: str, out_dtype: torch.dtype, block_size: int, cfg, decode: bool) -> torch.Tensor:
    """fp8_scaled_mm as one Triton GEMM with ``cfg`` (a GemmConfig); ``decode`` decodes tiles to
    float32 (the interpreter) instead of multiplying FP8 on the tensor cores."""
    m, k = a.shape
    n = b.shape[0]
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    sa, sb = _granularity(a_scale, m), _granularity(b_scale, n)
    block_k = cfg.block_k
    if G_BLOCK in (sa, sb):
        block_k = min(block_k, block_size)
    a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    launch(fp8_gemm_kernel, grid, a, b, out, a_scale, b_scale, bias if bias is not None else out, m, n, k, a.stride(0), b.stride(0),
           out.stride(0), cdiv(k, block_size), block_size, A_FMT=FORMAT_IDS[a_format], B_FMT=FORMAT_IDS[b_format], SA=sa, SB=sb,
           HAS_BIAS=bias is not None, DECODE=decode, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages, options=cfg.options)
    return out


__all__ = ["quantize", "quantize_amax", "quantize_from_amax", "dequantize", "scaled_mm", "FORMAT_IDS"]
