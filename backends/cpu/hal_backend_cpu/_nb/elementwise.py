"""scale_shift_act in one pass for act none / relu: read x, write (relu of) x * scale + shift.

x (C-contiguous) is seen as (P, C, I): scale and shift are per channel c (C = 1 for numbers).
``affine_segments`` walks (p, c) segments of I elements in chunks (long segments: NCHW channels,
numbers); ``affine_rows`` walks rows of L = C * I elements with per-element parameter vectors
(short segments: a transformer row's per-feature bias). ReLU keeps NaN (as torch's does).
"""

from __future__ import annotations

from numba import njit, prange

CHUNK = 8192
_FLAGS = {"contract"}  # fused multiply-add allowed; no reassociation, NaN and inf kept


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def affine_segments(x, scale, shift, out, relu):
    p_, c_, i_ = x.shape
    chunks = (i_ + CHUNK - 1) // CHUNK
    zero = x.dtype.type(0)
    for item in prange(p_ * c_ * chunks):
        seg = item // chunks
        start = (item % chunks) * CHUNK
        stop = min(start + CHUNK, i_)
        p = seg // c_
        c = seg % c_
        s = scale[c]
        b = shift[c]
        if relu:
            for i in range(start, stop):
                z = x[p, c, i] * s + b
                out[p, c, i] = zero if z <= zero else z
        else:
            for i in range(start, stop):
                out[p, c, i] = x[p, c, i] * s + b


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def affine_rows(x, scale, shift, out, relu):
    rows, n = x.shape
    zero = x.dtype.type(0)
    for r in prange(rows):
        xr = x[r]
        orow = out[r]
        if relu:
            for j in range(n):
                z = xr[j] * scale[j] + shift[j]
                orow[j] = zero if z <= zero else z
        else:
            for j in range(n):
                orow[j] = xr[j] * scale[j] + shift[j]
