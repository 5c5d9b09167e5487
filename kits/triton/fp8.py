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
NaN propagating exactly, and reductions across programs are ``atomic_max`` on int32 (v1) or
partial words, one a program, reduced by the next kernel (v2): the per-tensor amax of current
scaling stays on the device, read by the cast kernel, which computes the scale there: no host
synchronisation, so it runs under CUDA graph capture.

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

**The GEMM** multiplies FP8 tiles with the tensor cores (``tl.dot`` of FP8 operands, float32
accumulation); block scales are applied per K step (``BLOCK_K`` divides the block size, so a step
lies in one scale block), tensor and row scales and the bias in the epilogue, then one rounding.
In the interpreter the tiles are decoded to float32 first (exact: every FP8 value is a float32).

NOTES: the casts' passes and bytes (issue 40)
---------------------------------------------
``benchmarks/fp8.py --only quant`` divides a device copy's time by the cast's, the copy moving the
bytes of one read of x and one write of the codes: 3n for ``fp8_quantize`` of n bfloat16 values,
4n for ``fp8_quantize_transpose`` (scales ignored). Figures for a bfloat16 8192 x 8192 (n = 2^26:
x 128 MiB, q 64 MiB) with the CUDA tables (``block_elems`` 4096, 8 warps); "ceiling" is 3n or 4n
over the DRAM bytes the kernels must move; the H200/H100 compute about 21 / 30 issue slots a
thread per element at copy speed for a 3-byte element (so a kernel needing ~25 is issue-bound).

v1 (``HAL_FP8_CAST=v1``; measured on the H200 at ce9d753):

============  ===========================================================  =======  ========  ========
call          launches and passes                                          DRAM     ceiling   measured
============  ===========================================================  =======  ========  ========
tensor        2 zero fills; amax (16384 programs of 1 x 4096, an atomic     5n       0.60      0.40
              each); cast (16384 programs, IEEE division per element)
row           1: a row a program (16 warps), amax in registers, cast       3n       1.00      0.58
block         1: a 128 x 128 block a program, amax then cast (32-row       3n       1.00      0.52
              strips, the second read from L2)
tensor, t     2 fills; amax; cast of 64 x 64 tiles, codes once, q and      6n       0.67      0.41
              the tile transposed through shared memory into q_t
row, t        2 fills (M and K words); amax (64 x 64 tiles, 2 atomics a    6n       0.67      0.20
              row and a column: 2M atomics); cast: two emulated encodes
              and two divisions per element (~70 instructions)
block, t      1 + ``s.mT.contiguous()`` (a copy launch)                    4n       1.00      0.49
============  ===========================================================  =======  ========  ========

Every v1 cast divided each element with ``div.rn.f32`` (MUFU.RCP, 4 FFMA, FCHK and a branch to a
slow path: ~10 instructions of the ~25-30 an element in the sm_90 code), so the kernels issued
near the H200's limit at about half the copy rate, whatever their bytes allowed.

v2 (the default): the division in four FMA-pipe instructions (``_quot``: q0 = x r_dn + x r_lo
with r_dn + r_lo = 1/s to 2^-47, the exact remainder x - q0 s, Markstein's correction with r =
RN(1/s); bit for bit the IEEE quotient for every positive normal s in [2^-64, 2^64] and |x/s| <
2^18, the reciprocals computed once a program; other scales take the IEEE division), and on NVIDIA
the conversion alone (``cvt.rn.satfinite`` saturates and keeps the sign; a NaN is rewritten only
where one can occur: not under a current scale that passed those checks, where |x| <= amax is
finite). About 9 instructions an element for the plain casts, 15 for the transposed per-tensor
one, 26 for transposed rows (two codes an element), counted in the sm_90 code (kits/triton/aot.py
compiles each). Passes:

============  ===========================================================  =======  ========  ==========
call          launches and passes                                          DRAM     ceiling   predicted
============  ===========================================================  =======  ========  ==========
tensor        amax: 4 programs a multiprocessor, persistent, 16 KB tiles,  5n       0.60      0.55-0.63
              one partial word each (no atomics, no fill); cast: the       (-L2)    (0.63)
              same programs, each reduces the partials and computes the
              scale on the device, tiles last-first (the tail of x the
              amax read last is still in L2)
row           1: a row a program in registers (16 warps for 8192), one     3n       1.00      0.85-0.95
              read, scale per row, the fast quotient
block         1: a 128 x 128 block a program in registers (16 warps),      3n       1.00      0.85-0.95
              one read
tensor, t     amax as above; cast: persistent over 64 x 64 tiles (tile     6n       0.67      0.58-0.67
              walk without divisions), codes once, q and q_t coalesced     (-L2)    (0.70)
row, t        row and column partial maxima of 128 x 1024 strips (512      6n       0.67      0.50-0.62
              programs, 2.3 MB of partials, no atomics); the scales
              (the s and st outputs) reduced from them; cast of 64 x 64
              tiles: q from the tile, q_t from the tile transposed in
              shared memory, each divided by one scale a tile row
block, t      1: 32-row strips of the block (the second pass from L1/L2),  4n       1.00      0.80-0.90
              the block's scale written to s and, transposed, to st
============  ===========================================================  =======  ========  ==========

Given scales (delayed scaling): one pass, 3n (4n transposed), no amax launch: per tensor the
same kernels without the amax pass (a power-of-two scale multiplies by its exact reciprocal;
any other nice scale takes the fast quotient of x clamped to +-2^17 s, which changes no code).

What the 0.85 target can mean: a cast of current scale that needs the amax of a whole tensor (or
of whole columns) before its first code must read x twice, so against the benchmark's copy of
one read and one write its ceiling is 0.60 (0.67 transposed) unless the amax is fused into the
kernel that produces x or the scale is delayed; 0.85 of the bytes actually moved is 0.51 (0.57)
in the benchmark's units, which v2 is predicted to reach. Row and block casts can reach 0.85 as
the benchmark counts.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_pow2
from .gemm import tile_rows_cols

#: the formats in ``FMT`` order
FORMAT_IDS = {"e4m3fn": 0, "e5m2": 1, "e4m3fnuz": 2, "e5m2fnuz": 3}
#: scale modes of the encode kernel
S_TENSOR, S_TENSOR_AMAX, S_ROW, S_ROW_AMAX, S_BLOCK = 0, 1, 2, 3, 4
#: amax modes: one word for the tensor, or a word per row and per column
A_TENSOR, A_ROWS_COLS = 0, 1
#: granularity codes of the GEMM's scales
G_TENSOR, G_ROW, G_BLOCK = 0, 1, 2


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
):
    """Codes of a (B, M, K) array (and of its transpose into (B, K, M) when TRANSPOSE), one tile per
    program, the scale given (tensor, row or block: s_ptr) or computed from amax words (tensor or
    rows + columns; the scales are written to s_ptr / st_ptr once)."""
    pid = tl.program_id(0)
    b, rows, cols, mask, offs = _tile3(pid, M, K, n_tm, n_tk, BLOCK_R, BLOCK_C)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
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


# --- v2 casts: one read of x where the granularity allows it, the division in four FMA-pipe ----
# instructions (see NOTES in the module docstring) -------------------------------------------------


@triton.jit
def _nice(s):
    """Whether the scale s (any shape) is a positive normal float32 in [2^-64, 2^64] (False for
    0, negatives, subnormals, infinities and NaN): where ``_quot`` is exact (NOTES)."""
    return (s >= 5.421010862427522e-20) & (s <= 1.8446744073709552e19)


@triton.jit
def _recips(s):
    """(r, r_dn, r_lo) of a nice s: r = RN(1/s) (the IEEE division); r_dn = r, or r one ulp
    smaller where r > 1/s, so that the remainder e = 1 - s r_dn (exact in one FMA: r_dn is
    within an ulp of 1/s) is >= 0; r_lo = e r_dn >= 0, and r_dn + r_lo = 1/s to about 2^-47."""
    one = tl.zeros_like(s) + 1.0
    r = tl.math.div_rn(one, s)
    r_dn = tl.where(tl.fma(-s, r, one) < 0.0, (r.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), r)
    return r, r_dn, tl.fma(-s, r_dn, one) * r_dn


@triton.jit
def _quot(x, s, r, r_dn, r_lo):
    """``x / s`` rounded to nearest even, bit for bit the IEEE division, for a nice scale s (its
    ``_recips``) and |x / s| < 2^18, in four FMA-pipe instructions: q0 = RN(x r_dn + x r_lo)
    is within an ulp of x / s (faithful), the remainder x - q0 s is exact in one FMA, and
    q0 + remainder * r is RN(x / s) (Markstein's theorem: r within half an ulp of 1/s, q0
    faithful). r_lo >= 0 and the remainder formed negated (q0 s - x) keep x = -0 at -0."""
    q0 = tl.fma(x, r_dn, x * r_lo)
    nres = tl.fma(q0, s, -x)
    return tl.fma(-nres, r, q0)


@triton.jit
def _codes(v, x, FMT: tl.constexpr, HW: tl.constexpr, NAN_OF: tl.constexpr):
    """uint8 codes of the quotients v = x / s. NAN_OF: 0 v is finite and x has no NaN (current
    scaling with a nice scale), 1 NaN codes where v is NaN, 2 where x is NaN (v of a clamped x).
    On NVIDIA (HW, OCP formats) the conversion alone: ``cvt.rn.satfinite`` rounds to nearest
    even, saturates (infinities included) and keeps the sign, -0 included; only a NaN is
    rewritten as the canonical NaN."""
    NAN_BITS: tl.constexpr = 0x7F if FMT < 2 else 0x80
    if HW and FMT < 2:
        if FMT == 0:
            code = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            code = v.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        if NAN_OF == 1:
            code = tl.where(v != v, NAN_BITS, code).to(tl.uint8)
    else:
        code = _encode(v, FMT, HW)
    if NAN_OF == 2:
        code = tl.where(x != x, NAN_BITS, code).to(tl.uint8)
    return code


@triton.jit
def _prep(s, POW2: tl.constexpr):
    """What the codes of x / s need of the scales s (one, or one a row), computed once per
    program: (kind, r, r_dn, r_lo). kind 0: s is nice, the four-instruction quotient with
    ``_recips``; 1 (POW2, one given scale): a normal power of two, r its exact reciprocal; 2:
    the IEEE division (s 0, negative, subnormal, below 2^-64 or above 2^64, infinite or NaN)."""
    nice = _nice(s)
    r, r_dn, r_lo = _recips(tl.where(nice, s, 1.0))
    kind = tl.where(nice, 0, 2)
    if POW2:
        sb = s.to(tl.int32, bitcast=True)
        e = (sb >> 23) & 0xFF
        pow2 = ((sb & 0x7FFFFF) == 0) & (e >= 1) & (e <= 253)
        r = tl.where(pow2, (((254 - e) << 23) | ((sb >> 31) << 31)).to(tl.float32, bitcast=True), r)
        kind = tl.where(pow2, 1, kind)
    return kind, r, r_dn, r_lo


@triton.jit
def _codes_of(x, s, kind, r, r_dn, r_lo, FMT: tl.constexpr, HW: tl.constexpr, GIVEN: tl.constexpr, POW2: tl.constexpr):
    """Codes of float32 ``x / s`` (s, r, r_dn, r_lo from ``_prep``, scalars or (R, 1) columns;
    kind one scalar for the whole tile). Current scaling (|x| <= amax = s * max_finite, so the
    quotients are at most max_finite and finite where s is nice): the fast quotient. A given
    scale: the fast quotient of x clamped to +-2^17 s (a quotient past 2^17 saturates either
    way, infinities included; NaN codes from x), x times the exact reciprocal of a power of
    two, or the division."""
    if kind == 0:
        if GIVEN:
            c = s * 131072.0
            code = _codes(_quot(tl.minimum(tl.maximum(x, -c), c), s, r, r_dn, r_lo), x, FMT, HW, 2)
        else:
            code = _codes(_quot(x, s, r, r_dn, r_lo), x, FMT, HW, 0)
    else:
        if POW2:
            if kind == 1:
                code = _codes(x * r, x, FMT, HW, 1)
            else:
                code = _codes(tl.math.div_rn(x, s + tl.zeros_like(x)), x, FMT, HW, 1)
        else:
            code = _codes(tl.math.div_rn(x, s + tl.zeros_like(x)), x, FMT, HW, 1)
    return code


@triton.jit
def _codes_rows(x, s, FMT: tl.constexpr, HW: tl.constexpr, GIVEN: tl.constexpr):
    """Codes of float32 ``x / s[:, None]`` for an (R, C) tile and one scale a row: the fast
    quotient where every row's scale is nice, else the division for the whole tile."""
    kind, r, r_dn, r_lo = _prep(s, False)
    return _codes_of(x, s[:, None], tl.max(kind, axis=0), r[:, None], r_dn[:, None], r_lo[:, None], FMT, HW, GIVEN, False)


@triton.jit(do_not_specialize=["n_tiles"])
def fp8_v2_amax_kernel(x_ptr, part_ptr, N, n_tiles, BLOCK: tl.constexpr):
    """Per-tensor amax, stage one: each of the persistent programs reduces tiles pid, pid + G, ...
    of the flat x (|x| as float32 bits, NaN above all) in registers and writes one partial word
    (no atomics, no zeroed buffer)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(pid, n_tiles, tl.num_programs(0)):
        idx = tl.cast(i, tl.int64) * BLOCK + offs
        acc = tl.maximum(acc, _abs_bits(tl.load(x_ptr + idx, mask=idx < N, other=0.0)))
    tl.store(part_ptr + pid, tl.max(acc, axis=0))


@triton.jit
def _tensor_scale(s_in_ptr, part_ptr, n_part, FMT: tl.constexpr, GIVEN: tl.constexpr, PART: tl.constexpr):
    """The tensor's float32 scale: given, or from the partial amax words (stage two, in every
    program: n_part words from L2)."""
    if GIVEN:
        s = tl.load(s_in_ptr).to(tl.float32)
    else:
        p = tl.arange(0, PART)
        s = _scale_of(tl.max(tl.load(part_ptr + p, mask=p < n_part, other=0), axis=0), FMT)
    return s


@triton.jit(do_not_specialize=["n_tiles", "n_part"])
def fp8_v2_tensor_kernel(x_ptr, q_ptr, s_in_ptr, s_ptr, st_ptr, part_ptr, N, n_tiles, n_part, FMT: tl.constexpr,
                         HW: tl.constexpr, GIVEN: tl.constexpr, WRITE_ST: tl.constexpr, PART: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Per-tensor cast of the flat x, persistent: the scale (given, or from the amax partials)
    once per program, written by program 0; tiles visited last-first, so that the tail of x the
    amax pass read last is still in L2 when this pass starts."""
    pid = tl.program_id(0)
    s = _tensor_scale(s_in_ptr, part_ptr, n_part, FMT, GIVEN, PART)
    if pid == 0:
        tl.store(s_ptr, s)
        if WRITE_ST:
            tl.store(st_ptr, s)
    kind, r, r_dn, r_lo = _prep(s, GIVEN)
    offs = tl.arange(0, BLOCK)
    for i in range(pid, n_tiles, tl.num_programs(0)):
        idx = tl.cast(n_tiles - 1 - i, tl.int64) * BLOCK + offs
        mask = idx < N
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + idx, _codes_of(x, s, kind, r, r_dn, r_lo, FMT, HW, GIVEN, GIVEN), mask=mask)


@triton.jit
def _origin(t, M, K, n_tm, n_tk, BATCHED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tile t of a (B, M, K) array in (B, n_tm, n_tk) order: the offsets (int64) of its first
    element in x (and q) and in the transpose (B, K, M), and how many of its rows and columns
    lie inside (elements within a tile are int32 offsets from there: no 64-bit address per
    element held in registers). BATCHED False: B is 1 (one integer division fewer)."""
    if BATCHED:
        per = n_tm * n_tk
        bmk = tl.cast(t // per, tl.int64) * M * K
        u = t % per
    else:
        bmk = tl.cast(0, tl.int64)
        u = t
    tm = u // n_tk
    r0 = tm * BLOCK_R
    c0 = (u - tm * n_tk) * BLOCK_C
    return bmk + tl.cast(r0, tl.int64) * K + c0, bmk + tl.cast(c0, tl.int64) * M + r0, M - r0, K - c0


@triton.jit(do_not_specialize=["n_tiles", "n_part", "n_tm", "n_tk"])
def fp8_v2_tensor_t_kernel(x_ptr, q_ptr, qt_ptr, s_in_ptr, s_ptr, st_ptr, part_ptr, M, K, n_tm, n_tk, n_tiles, n_part,
                           FMT: tl.constexpr, HW: tl.constexpr, GIVEN: tl.constexpr, PART: tl.constexpr,
                           BATCHED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per-tensor cast of a (B, M, K) array and of its transpose, persistent, tiles last-first:
    one read of each tile, its codes computed once (q and q_t share the scale) and written twice,
    row-major into q and through a tile transpose (shared memory) into q_t, both coalesced."""
    pid = tl.program_id(0)
    s = _tensor_scale(s_in_ptr, part_ptr, n_part, FMT, GIVEN, PART)
    if pid == 0:
        tl.store(s_ptr, s)
        tl.store(st_ptr, s)
    kind, r, r_dn, r_lo = _prep(s, GIVEN)
    ar = tl.arange(0, BLOCK_R)
    ac = tl.arange(0, BLOCK_C)
    off = ar[:, None] * K + ac[None, :]
    off_t = ac[:, None] * M + ar[None, :]
    # visit tiles n_tiles - 1 - pid, ... - G, ...: (row of tiles g over all batches, column of
    # tiles tk) stepped back by (G // n_tk, G % n_tk) with a borrow: no division in the loop
    n_prog = tl.num_programs(0)
    t = n_tiles - 1 - pid
    g = t // n_tk
    tk = t - g * n_tk
    dg = n_prog // n_tk
    dk = n_prog - dg * n_tk
    for i in range(pid, n_tiles, n_prog):
        if BATCHED:
            b = g // n_tm
            r0 = (g - b * n_tm) * BLOCK_R
            bmk = tl.cast(b, tl.int64) * M * K
        else:
            r0 = g * BLOCK_R
            bmk = tl.cast(0, tl.int64)
        c0 = tk * BLOCK_C
        o = bmk + tl.cast(r0, tl.int64) * K + c0
        o_t = bmk + tl.cast(c0, tl.int64) * M + r0
        nr = M - r0
        nc = K - c0
        tk = tk - dk
        g = g - dg
        borrow = (tk < 0).to(tl.int32)
        tk = tk + borrow * n_tk
        g = g - borrow
        mask = (ar < nr)[:, None] & (ac < nc)[None, :]
        x = tl.load(x_ptr + o + off, mask=mask, other=0.0).to(tl.float32)
        code = _codes_of(x, s, kind, r, r_dn, r_lo, FMT, HW, GIVEN, GIVEN)
        tl.store(q_ptr + o + off, code, mask=mask)
        tl.store(qt_ptr + o_t + off_t, tl.trans(code), mask=(ac < nc)[:, None] & (ar < nr)[None, :])


@triton.jit(do_not_specialize=["R"])
def fp8_v2_rows_kernel(x_ptr, q_ptr, s_in_ptr, s_ptr, R, K, FMT: tl.constexpr, HW: tl.constexpr, GIVEN: tl.constexpr,
                       ONE_TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row-wise cast of an (R, K) array, BLOCK_R rows a program: the scales given, or each row's
    amax reduced in registers (one read of x when the row fits the tile, else two, the second
    from L2), then the codes and the scales written."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    base = rows.to(tl.int64)[:, None] * K
    cols = tl.arange(0, BLOCK_C)
    if ONE_TILE:
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if GIVEN:
            s = tl.load(s_in_ptr + rows, mask=row_ok, other=1.0).to(tl.float32)
        else:
            s = _scale_of(tl.max(tl.where(mask, _abs_bits(x), 0), axis=1), FMT)
        tl.store(q_ptr + base + cols[None, :], _codes_rows(x, s, FMT, HW, GIVEN), mask=mask)
    else:
        if GIVEN:
            s = tl.load(s_in_ptr + rows, mask=row_ok, other=1.0).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK_R], tl.int32)
            for k0 in range(0, K, BLOCK_C):
                mask = row_ok[:, None] & ((k0 + cols) < K)[None, :]
                x = tl.load(x_ptr + base + (k0 + cols)[None, :], mask=mask, other=0.0)
                amax = tl.maximum(amax, tl.max(tl.where(mask, _abs_bits(x), 0), axis=1))
            s = _scale_of(amax, FMT)
        kind, r, r_dn, r_lo = _prep(s, False)
        kind = tl.max(kind, axis=0)
        for k0 in range(0, K, BLOCK_C):
            mask = row_ok[:, None] & ((k0 + cols) < K)[None, :]
            x = tl.load(x_ptr + base + (k0 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            code = _codes_of(x, s[:, None], kind, r[:, None], r_dn[:, None], r_lo[:, None], FMT, HW, GIVEN, False)
            tl.store(q_ptr + base + (k0 + cols)[None, :], code, mask=mask)
    tl.store(s_ptr + rows, s, mask=row_ok)


@triton.jit(do_not_specialize=["n_rs", "n_cs"])
def fp8_v2_amax_rc_kernel(x_ptr, rpart_ptr, cpart_ptr, M, K, n_rs, n_cs, ROWS: tl.constexpr, SUB_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    """Row and column amax of a (B, M, K) array, stage one: program (b, i, j) reduces rows
    [i ROWS, (i + 1) ROWS) x columns [j BLOCK_C, (j + 1) BLOCK_C), SUB_R rows at a time, and
    writes the rows' maxima over its columns (rpart, (B, n_cs, M)) and its columns' maxima over
    its rows (cpart, (B, n_rs, K)): no atomics, every word written once."""
    pid = tl.program_id(0)
    per = n_rs * n_cs
    b = pid // per
    t = pid % per
    i = t // n_cs
    j = t % n_cs
    cols = j * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < K
    sub = tl.arange(0, SUB_R)
    base = b.to(tl.int64) * M * K
    cmax = tl.zeros([BLOCK_C], tl.int32)
    for r0 in range(0, ROWS, SUB_R):
        rows = i * ROWS + r0 + sub
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        bits = tl.where(mask, _abs_bits(tl.load(x_ptr + base + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)), 0)
        cmax = tl.maximum(cmax, tl.max(bits, axis=0))
        tl.store(rpart_ptr + (b.to(tl.int64) * n_cs + j) * M + rows, tl.max(bits, axis=1), mask=row_ok)
    tl.store(cpart_ptr + (b.to(tl.int64) * n_rs + i) * K + cols, cmax, mask=col_ok)


@triton.jit(do_not_specialize=["n_rs", "n_cs", "n_rprog", "NBM", "NBK"])
def fp8_v2_scales_rc_kernel(rpart_ptr, cpart_ptr, s_ptr, st_ptr, M, K, NBM, NBK, n_rs, n_cs, n_rprog, FMT: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Row and column amax, stage two: the first n_rprog programs reduce the n_cs partial words of
    BLOCK rows each into the row scales (s, B*M words), the others the n_rs words of BLOCK columns
    into the column scales (st, B*K words)."""
    pid = tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    if pid < n_rprog:
        g = pid * BLOCK + idx
        ok = g < NBM
        src = rpart_ptr + (g // M).to(tl.int64) * n_cs * M + g % M
        amax = tl.zeros([BLOCK], tl.int32)
        for j in range(0, n_cs):
            amax = tl.maximum(amax, tl.load(src + j * M, mask=ok, other=0))
        tl.store(s_ptr + g, _scale_of(amax, FMT), mask=ok)
    else:
        g = (pid - n_rprog) * BLOCK + idx
        ok = g < NBK
        src = cpart_ptr + (g // K).to(tl.int64) * n_rs * K + g % K
        amax = tl.zeros([BLOCK], tl.int32)
        for i in range(0, n_rs):
            amax = tl.maximum(amax, tl.load(src + i * K, mask=ok, other=0))
        tl.store(st_ptr + g, _scale_of(amax, FMT), mask=ok)


@triton.jit(do_not_specialize=["n_tm", "n_tk"])
def fp8_v2_rows_t_kernel(x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, M, K, n_tm, n_tk, FMT: tl.constexpr, HW: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row-wise codes of a (B, M, K) array and of its transpose from one read of each tile, the
    row scales s and column scales st already computed: q from the tile divided by its rows'
    scales, q_t from the transposed tile (shared memory) divided by its rows' (x's columns')
    scales, each stored row-major, coalesced; every divisor is one per row of the tile it divides."""
    t = tl.program_id(0)
    o, o_t, nr, nc = _origin(t, M, K, n_tm, n_tk, True, BLOCK_R, BLOCK_C)
    per = n_tm * n_tk
    b = t // per
    r0 = ((t % per) // n_tk) * BLOCK_R
    c0 = (t % n_tk) * BLOCK_C
    ar = tl.arange(0, BLOCK_R)
    ac = tl.arange(0, BLOCK_C)
    row_ok = ar < nr
    col_ok = ac < nc
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + o + ar[:, None] * K + ac[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + b.to(tl.int64) * M + r0 + ar, mask=row_ok, other=1.0)
    st = tl.load(st_ptr + b.to(tl.int64) * K + c0 + ac, mask=col_ok, other=1.0)
    tl.store(q_ptr + o + ar[:, None] * K + ac[None, :], _codes_rows(x, s, FMT, HW, False), mask=mask)
    tl.store(qt_ptr + o_t + ac[:, None] * M + ar[None, :], _codes_rows(tl.trans(x), st, FMT, HW, False),
             mask=col_ok[:, None] & row_ok[None, :])


@triton.jit(do_not_specialize=["mb", "kb"])
def fp8_v2_blocks_kernel(x_ptr, q_ptr, qt_ptr, s_in_ptr, s_ptr, st_ptr, M, K, mb, kb, bs, FMT: tl.constexpr,
                         HW: tl.constexpr, GIVEN: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK_S: tl.constexpr,
                         SUB_R: tl.constexpr):
    """Block-wise cast of a (B, M, K) array, one bs x bs block a program (BLOCK_S its next power of
    two). SUB_R == BLOCK_S: the whole block in registers, one read (its amax, one scalar scale,
    its codes; the transpose through shared memory into q_t); else SUB_R rows at a time, two
    passes for a current scale (the second from L1/L2). Writes the block's scale to s and,
    transposed, to st."""
    pid = tl.program_id(0)
    b = pid // (mb * kb)
    t = pid % (mb * kb)
    bi = t // kb
    bj = t % kb
    bmk = b.to(tl.int64) * M * K
    o = bmk + (bi * bs).to(tl.int64) * K + bj * bs
    o_t = bmk + (bj * bs).to(tl.int64) * M + bi * bs
    nr = tl.minimum(bs, M - bi * bs)
    ac = tl.arange(0, BLOCK_S)
    col_ok = ac < tl.minimum(bs, K - bj * bs)
    sub = tl.arange(0, SUB_R)
    if GIVEN:
        s = tl.load(s_in_ptr + pid).to(tl.float32)
    if SUB_R == BLOCK_S:
        mask = (sub < nr)[:, None] & col_ok[None, :]
        off = sub[:, None] * K + ac[None, :]
        x = tl.load(x_ptr + o + off, mask=mask, other=0.0).to(tl.float32)
        if not GIVEN:
            s = _scale_of(tl.max(tl.max(tl.where(mask, _abs_bits(x), 0), axis=1), axis=0), FMT)
        kind, r, r_dn, r_lo = _prep(s, GIVEN)
        code = _codes_of(x, s, kind, r, r_dn, r_lo, FMT, HW, GIVEN, GIVEN)
        tl.store(q_ptr + o + off, code, mask=mask)
        if TRANSPOSE:
            tl.store(qt_ptr + o_t + ac[:, None] * M + sub[None, :], tl.trans(code), mask=col_ok[:, None] & (sub < nr)[None, :])
    else:
        if not GIVEN:
            amax = tl.zeros([SUB_R], tl.int32)
            for i in range(0, bs, SUB_R):
                mask = (i + sub < nr)[:, None] & col_ok[None, :]
                x = tl.load(x_ptr + o + (i + sub)[:, None] * K + ac[None, :], mask=mask, other=0.0)
                amax = tl.maximum(amax, tl.max(tl.where(mask, _abs_bits(x), 0), axis=1))
            s = _scale_of(tl.max(amax, axis=0), FMT)
        kind, r, r_dn, r_lo = _prep(s, GIVEN)
        for i in range(0, bs, SUB_R):
            mask = (i + sub < nr)[:, None] & col_ok[None, :]
            off = (i + sub)[:, None] * K + ac[None, :]
            x = tl.load(x_ptr + o + off, mask=mask, other=0.0).to(tl.float32)
            code = _codes_of(x, s, kind, r, r_dn, r_lo, FMT, HW, GIVEN, GIVEN)
            tl.store(q_ptr + o + off, code, mask=mask)
            if TRANSPOSE:
                tl.store(qt_ptr + o_t + ac[:, None] * M + (i + sub)[None, :], tl.trans(code),
                         mask=col_ok[:, None] & (i + sub < nr)[None, :])
    tl.store(s_ptr + pid, s)
    if TRANSPOSE:
        tl.store(st_ptr + b.to(tl.int64) * mb * kb + bj * mb + bi, s)


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
        block_c = max(16, min(next_pow2(max(k, 1)), 64))
        return max(16, block_elems // block_c), block_c
    block_c = max(16, min(next_pow2(max(k, 1)), block_elems))
    return max(1, block_elems // block_c), block_c


#: scale modes of fp8_encode_kernel whose divisor varies along a tile's columns (given blocks; the
#: column scales of the transposed row-wise codes). On the H200 (Triton 3.6, sm_90) the hardware cast
#: gave wrong codes in these modes only (a quarter to an eighth of them, with the right signs), while
#: the emulated cast passed bit for bit on the same kernel and tile; the PTX Triton 3.6 emits reads
#: right, so the cause is unknown. These modes encode with the emulated cast on every device.
_EMULATED_MODES = (S_ROW_AMAX, S_BLOCK)


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


def _encode_launch(x3, q, qt, s, st, amax, amaxt, m, k, nb, mode, fmt, transpose, hw, block_elems, num_warps, kb=1, bs=1):
    hw = hw and mode not in _EMULATED_MODES
    block_r, block_c = _tile_shape(k, block_elems, transpose)
    n_tm, n_tk = cdiv(m, block_r), cdiv(k, block_c)
    launch(fp8_encode_kernel, (nb * n_tm * n_tk,), x3, q, qt, s, st, amax, amaxt, m, k, n_tm, n_tk, kb, bs,
           FMT=FORMAT_IDS[fmt], SCALE=mode, TRANSPOSE=transpose, HW=hw, BLOCK_R=block_r, BLOCK_C=block_c,
           num_warps=num_warps, fp_fusion=False)


def _amax(x3, m, k, nb, mode, block_elems, num_warps):
    """amax words (int32 bits of float32, 0 to start): one, or per row and per column."""
    dev = x3.device
    if mode == A_TENSOR:
        amax, amaxt = torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    else:
        amax, amaxt = torch.zeros(nb * m, dtype=torch.int32, device=dev), torch.zeros(nb * k, dtype=torch.int32, device=dev)
    block_r, block_c = _tile_shape(k, block_elems, transpose=mode == A_ROWS_COLS)  # square tiles: few atomics per element
    n_tm, n_tk = cdiv(m, block_r), cdiv(k, block_c)
    launch(fp8_amax_kernel, (nb * n_tm * n_tk,), x3, amax, amaxt, m, k, n_tm, n_tk, MODE=mode, BLOCK_R=block_r, BLOCK_C=block_c,
           num_warps=num_warps)
    return amax, amaxt


def quantize(x: torch.Tensor, fmt: str, granularity: str, scale: Optional[torch.Tensor], block_size: int, transpose: bool,
             hw: bool, block_elems: int, num_warps: int, programs: Optional[int] = None) -> tuple:
    """fp8_quantize (``transpose=False``: (q, scale)) or fp8_quantize_transpose ((q, scale, q_t,
    scale_t)). ``hw`` picks the hardware cast (GPUs) or the emulated one (the interpreter);
    ``programs`` the persistent programs of the v2 per-tensor kernels (default 4 a multiprocessor).
    The kernels are :func:`cast_version`'s (``HAL_FP8_CAST``, v2 unless set)."""
    if _CAST[0] == "v2":
        got = _quantize_v2(x, fmt, granularity, scale, block_size, transpose, hw, block_elems, num_warps, programs)
        if got is not None:
            return got
    return _quantize_v1(x, fmt, granularity, scale, block_size, transpose, hw, block_elems, num_warps)


def _quantize_v1(x: torch.Tensor, fmt: str, granularity: str, scale: Optional[torch.Tensor], block_size: int, transpose: bool,
                 hw: bool, block_elems: int, num_warps: int) -> tuple:
    """quantize() with the v1 kernels (issue 40's baseline)."""
    x3, nb, m, k = _batched(x)
    dev = x.device
    q = torch.empty(x3.shape, dtype=torch.uint8, device=dev)
    qt = torch.empty(x3.shape[:-2] + (k, m), dtype=torch.uint8, device=dev) if transpose else q
    fid = FORMAT_IDS[fmt]
    if granularity == "block":
        mb, kb = cdiv(m, block_size), cdiv(k, block_size)
        if scale is not None:
            s = scale.float().contiguous().clone()
            _encode_launch(x3, q, qt, s, s, s, s, m, k, nb, S_BLOCK, fmt, transpose, hw, block_elems, num_warps, kb=kb, bs=block_size)
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
        amax, amaxt = _amax(x3, m, k, nb, A_ROWS_COLS, block_elems, num_warps)
        _encode_launch(x3, q, qt, s, st, amax, amaxt, m, k, nb, S_ROW_AMAX, fmt, True, hw, block_elems, num_warps)
        return q, s, qt, st
    # tensor
    if scale is not None:
        s = scale.float().reshape(()).clone()
        st = s.clone() if transpose else s
        _encode_launch(x3, q, qt, s, st, s, s, m, k, nb, S_TENSOR, fmt, transpose, hw, block_elems, num_warps)
    else:
        s = torch.empty((), dtype=torch.float32, device=dev)
        st = torch.empty((), dtype=torch.float32, device=dev) if transpose else s
        amax, _ = _amax(x3, m, k, nb, A_TENSOR, block_elems, num_warps)
        _encode_launch(x3, q, qt, s, st, amax, amax, m, k, nb, S_TENSOR_AMAX, fmt, transpose, hw, block_elems, num_warps)
    q = q.view(x.shape)
    return (q, s, qt, st) if transpose else (q, s)


# --- v2 host functions ----------------------------------------------------------------------------

#: the cast kernels quantize() runs: "v2" (one read of x where the granularity allows, the
#: division in four FMA-pipe instructions, persistent two-stage tensor amax) or "v1" (the kernels
#: before issue 40, kept for A/B runs). ``HAL_FP8_CAST`` picks it once, at import; benchmarks
#: switch it with :func:`set_cast_version` to compare both in one process.
CAST_VERSIONS = ("v1", "v2")
_CAST = [os.environ.get("HAL_FP8_CAST", "v2").strip().lower() or "v2"]
if _CAST[0] not in CAST_VERSIONS:
    raise ValueError(f"HAL_FP8_CAST={_CAST[0]!r}: use one of {', '.join(CAST_VERSIONS)}")


def cast_version() -> str:
    """The FP8 cast kernels quantize() runs now ("v1" or "v2")."""
    return _CAST[0]


def set_cast_version(version: str) -> str:
    """Run the ``version`` cast kernels from now on ("v1" or "v2"); returns the previous one."""
    if version not in CAST_VERSIONS:
        raise ValueError(f"unknown FP8 cast version {version!r}: use one of {', '.join(CAST_VERSIONS)}")
    old, _CAST[0] = _CAST[0], version
    return old


#: granularities whose v2 kernels encode with the emulated cast even on a GPU (none: every v2
#: kernel divides by one scale a program or one a tile row, the layouts in which the hardware
#: cast passed on the H200, see _EMULATED_MODES; a GPU run of tests/cuda/device/test_fp8_kernels.py
#: decides, and listing a granularity here is the switch should one fail)
_EMULATED_V2: tuple[str, ...] = ()

#: longest rows / largest square blocks a v2 program keeps whole in registers on a GPU
_ONE_TILE_BLOCK = 16384


def _default_programs(x: torch.Tensor) -> int:
    """Persistent programs where the caller did not say: 4 a multiprocessor (3 off a GPU)."""
    if x.device.type != "cuda":
        return 3
    return 4 * int(torch.cuda.get_device_properties(x.device).multi_processor_count)


def _stream_block(block_elems: int) -> int:
    """Elements a v2 streaming program handles per iteration: twice the elementwise tile (8192 on
    a GPU for large tensors: 16 KB of bfloat16 read, 32 elements a thread with 8 warps)."""
    return 2 * block_elems


def _transposed_tile(m: int, k: int, block_elems: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the v2 tiles stored transposed: 64 x 64 on a GPU for large tensors
    (128-byte runs of bfloat16 x, 64-byte runs of q and q_t; larger tiles held more registers
    than they saved instructions in the sm_90 code: 128 x 64 took 109 registers a thread with 8
    warps against 63), at least 16 x 16."""
    block_c = max(16, min(next_pow2(max(k, 1)), 64))
    return max(16, min(next_pow2(max(m, 1)), block_elems // block_c)), block_c


def _tensor_amax_v2(x3: torch.Tensor, n: int, block: int, programs: int, num_warps: int) -> tuple[torch.Tensor, int]:
    """Stage one of the per-tensor amax: (partial words, their count)."""
    n_tiles = cdiv(n, block)
    p = max(1, min(n_tiles, programs))
    part = torch.empty(p, dtype=torch.int32, device=x3.device)
    launch(fp8_v2_amax_kernel, (p,), x3, part, n, n_tiles, BLOCK=block, num_warps=num_warps)
    return part, p


def _quantize_v2(x: torch.Tensor, fmt: str, granularity: str, scale: Optional[torch.Tensor], block_size: int,
                 transpose: bool, hw: bool, block_elems: int, num_warps: int, programs: Optional[int]) -> Optional[tuple]:
    """quantize() with the v2 kernels; None where they do not apply (empty x, a transpose of
    fewer than two dimensions, a given row scale with the transpose, a matrix so large that a
    tile's int32 element offsets could overflow): v1 runs those."""
    if x.numel() == 0 or (transpose and (x.dim() < 2 or (granularity == "row" and scale is not None))):
        return None
    x3, nb, m, k = _batched(x)
    if (transpose or granularity == "block") and max(m, k) * max(1024, next_pow2(block_size)) >= 2**31:
        return None
    dev = x.device
    fid = FORMAT_IDS[fmt]
    given = scale is not None
    programs = programs or _default_programs(x)
    q = torch.empty(x3.shape, dtype=torch.uint8, device=dev)
    qt = torch.empty(x3.shape[:-2] + (k, m), dtype=torch.uint8, device=dev) if transpose else q
    s_in = scale.contiguous() if given else q
    common = dict(FMT=fid, HW=hw and granularity not in _EMULATED_V2, fp_fusion=False)
    if granularity == "tensor":
        n = x3.numel()
        block = _stream_block(block_elems)
        s = torch.empty((), dtype=torch.float32, device=dev)
        st = torch.empty((), dtype=torch.float32, device=dev) if transpose else s
        part, n_part = (q, 1) if given else _tensor_amax_v2(x3, n, block, programs, num_warps)
        if transpose:
            block_r, block_c = _transposed_tile(m, k, block_elems)
            n_tm, n_tk = cdiv(m, block_r), cdiv(k, block_c)
            n_tiles = nb * n_tm * n_tk
            launch(fp8_v2_tensor_t_kernel, (max(1, min(n_tiles, programs)),), x3, q, qt, s_in, s, st, part, m, k, n_tm, n_tk, n_tiles,
                   n_part, GIVEN=given, PART=next_pow2(n_part), BATCHED=nb > 1, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps, **common)
            return q.view(x.shape), s, qt, st
        n_tiles = cdiv(n, block)
        launch(fp8_v2_tensor_kernel, (max(1, min(n_tiles, programs)),), x3, q, s_in, s, s, part, n, n_tiles, n_part, GIVEN=given,
               WRITE_ST=False, PART=next_pow2(n_part), BLOCK=block, num_warps=num_warps, **common)
        return q.view(x.shape), s
    if granularity == "row":
        s = torch.empty(x3.shape[:-1] + (1,), dtype=torch.float32, device=dev)
        if not transpose:
            rows = x3.numel() // k
            block_r, block_c, warps = _row_tile(k, block_elems, num_warps)
            launch(fp8_v2_rows_kernel, (cdiv(rows, block_r),), x3, q, s_in, s, rows, k, GIVEN=given, ONE_TILE=k <= block_c,
                   BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps, **common)
            return q, s
        st = torch.empty(x3.shape[:-2] + (k, 1), dtype=torch.float32, device=dev)
        # stage one: partial row and column maxima of (ROWS x BLOCK_C) strips
        col_strip = max(16, min(next_pow2(k), block_elems // 4))
        sub_r = max(1, min(next_pow2(m), _stream_block(block_elems) // col_strip))
        strip_rows = sub_r * (16 if block_elems >= 1024 else 1)
        n_rs, n_cs = cdiv(m, strip_rows), cdiv(k, col_strip)
        rpart = torch.empty((nb, n_cs, m), dtype=torch.int32, device=dev)
        cpart = torch.empty((nb, n_rs, k), dtype=torch.int32, device=dev)
        launch(fp8_v2_amax_rc_kernel, (nb * n_rs * n_cs,), x3, rpart, cpart, m, k, n_rs, n_cs, ROWS=strip_rows, SUB_R=sub_r,
               BLOCK_C=col_strip, num_warps=num_warps)
        # stage two: the scales themselves (the outputs s and st)
        red = max(16, block_elems // 4)
        n_rprog = cdiv(nb * m, red)
        launch(fp8_v2_scales_rc_kernel, (n_rprog + cdiv(nb * k, red),), rpart, cpart, s, st, m, k, nb * m, nb * k, n_rs, n_cs,
               n_rprog, FMT=fid, BLOCK=red, num_warps=4)
        block_r, block_c = _transposed_tile(m, k, block_elems)
        n_tm, n_tk = cdiv(m, block_r), cdiv(k, block_c)
        # 4 warps: two codes an element; 8 warps held 90 registers a thread (2 programs a
        # multiprocessor), 4 hold 113 with twice the elements (4 programs)
        launch(fp8_v2_rows_t_kernel, (nb * n_tm * n_tk,), x3, q, qt, s, st, m, k, n_tm, n_tk, BLOCK_R=block_r, BLOCK_C=block_c,
               num_warps=max(1, min(num_warps, block_r * block_c // 1024)), **common)
        return q, s, qt, st
    # blocks
    mb, kb = cdiv(m, block_size), cdiv(k, block_size)
    s = torch.empty(x3.shape[:-2] + (mb, kb), dtype=torch.float32, device=dev)
    st = torch.empty(x3.shape[:-2] + (kb, mb), dtype=torch.float32, device=dev) if transpose else s
    block_s = max(16, next_pow2(block_size))
    # current scales: the whole block in registers where it fits (16 warps for 128 x 128: 58
    # registers a thread in the sm_90 code, 2 programs a multiprocessor); the transposed store's
    # tile of codes in shared memory took 77 there (1 program), so transposed blocks go 32 rows at
    # a time with 8 warps (77 registers, 3 programs), the second pass over the block from L1/L2.
    # Given scales need no amax: row strips, one pass (72 registers for the whole block).
    limit = _ONE_TILE_BLOCK if block_elems >= 1024 else 4 * block_elems
    if block_s * block_s <= limit and not ((transpose or given) and block_s * block_s > block_elems):
        sub_r, warps = block_s, max(num_warps, min(16, block_s * block_s // 1024))
    else:
        sub_r, warps = max(16 if transpose else 1, min(block_s, block_elems // block_s)), num_warps
    launch(fp8_v2_blocks_kernel, (nb * mb * kb,), x3, q, qt, s_in, s, st, m, k, mb, kb, block_size, GIVEN=given, TRANSPOSE=transpose,
           BLOCK_S=block_s, SUB_R=sub_r, num_warps=warps, **common)
    return (q, s, qt, st) if transpose else (q, s)


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


__all__ = ["quantize", "dequantize", "scaled_mm", "FORMAT_IDS", "cast_version", "set_cast_version", "CAST_VERSIONS"]
