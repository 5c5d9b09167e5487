"""Rotary embedding of a 4-d (B, H, T, D) float32 or float64 array in one pass, any strides: each
pair turned by its angle, ``(x1 c - x2 s, x2 c + x1 s)``, in the array's own precision, with the
products and the sum rounded as torch's separate ops round them (no fused multiply-add: numba
compiles without fast-math), so the results are those of the torch kernel's float32 ops.

cos and sin are 4-d too, each dimension x's or 1 (broadcast by indexing). ``negate`` rotates by the
opposite angle (the backward: sin's sign flipped, exactly). Pairs: the halves ``(x[i], x[i + D/2])``,
or with ``interleaved`` the neighbours ``(x[2i], x[2i + 1])``.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _rotate_row(xr, o, c, s, cd, sd, half, negate, interleaved):
    """One row's pairs of ``xr`` turned into ``o`` by the angles of the rows ``c`` and ``s`` (``cd``,
    ``sd``: whether each has a value per pair, else one broadcast)."""
    for i in range(half):
        cv = c[i if cd else 0]
        sv = s[i if sd else 0]
        if negate:
            sv = -sv
        if interleaved:
            j, k = 2 * i, 2 * i + 1
        else:
            j, k = i, i + half
        x1 = xr[j]
        x2 = xr[k]
        o[j] = x1 * cv - x2 * sv
        o[k] = x2 * cv + x1 * sv


@njit(cache=True)
def rotate(x, cos, sin, negate, interleaved, out):
    b_n, h_n, t_n, d = x.shape
    half = d // 2
    cb, ch, ct, cd = cos.shape[0] > 1, cos.shape[1] > 1, cos.shape[2] > 1, cos.shape[3] > 1
    sb, sh, st, sd = sin.shape[0] > 1, sin.shape[1] > 1, sin.shape[2] > 1, sin.shape[3] > 1
    for b in range(b_n):
        for h in range(h_n):
            for t in range(t_n):
                c = cos[b if cb else 0, h if ch else 0, t if ct else 0]
                s = sin[b if sb else 0, h if sh else 0, t if st else 0]
                _rotate_row(x[b, h, t], out[b, h, t], c, s, cd, sd, half, negate, interleaved)


@njit(cache=True)
def rotate_bf16(x, cos, sin, negate, interleaved, out):
    """:func:`rotate` of bfloat16 data given as its int16 bit patterns (x and out): each row widened to
    float32 exactly, rotated in float32 as :func:`rotate`, rounded to bfloat16 to nearest even (as
    torch's conversion; NaN as torch's canonical NaN). cos and sin are float32."""
    b_n, h_n, t_n, d = x.shape
    half = d // 2
    bits_in = np.empty(d, np.uint32)
    row = bits_in.view(np.float32)
    bits_out = np.empty(d, np.uint32)
    res = bits_out.view(np.float32)
    low16, shift, one = np.uint32(0xFFFF), np.uint32(16), np.uint32(1)
    abs_mask, inf_bits, nan_bf16, half_ulp = np.uint32(0x7FFFFFFF), np.uint32(0x7F800000), np.uint32(0x7FC0), np.uint32(0x7FFF)
    cb, ch, ct, cd = cos.shape[0] > 1, cos.shape[1] > 1, cos.shape[2] > 1, cos.shape[3] > 1
    sb, sh, st, sd = sin.shape[0] > 1, sin.shape[1] > 1, sin.shape[2] > 1, sin.shape[3] > 1
    for b in range(b_n):
        for h in range(h_n):
            for t in range(t_n):
                c = cos[b if cb else 0, h if ch else 0, t if ct else 0]
                s = sin[b if sb else 0, h if sh else 0, t if st else 0]
                xr = x[b, h, t]
                o = out[b, h, t]
                for j in range(d):
                    bits_in[j] = (np.uint32(np.int32(xr[j])) & low16) << shift
                _rotate_row(row, res, c, s, cd, sd, half, negate, interleaved)
                for j in range(d):
                    v = bits_out[j]
                    if (v & abs_mask) > inf_bits:
                        r = nan_bf16
                    else:
                        r = (v + half_ulp + ((v >> shift) & one)) >> shift
                    w = np.int32(r)
                    o[j] = np.int16(w - 65536 if w >= 32768 else w)
