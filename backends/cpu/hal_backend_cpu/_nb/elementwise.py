"""scale_shift_act in one pass: read x, write act(x * scale + shift), nothing in between.

x (C-contiguous) is seen as (P, C, I): scale and shift are per channel c (C = 1 for numbers).
``affine_segments`` walks (p, c) segments of I elements in chunks (long segments: NCHW channels,
numbers); ``affine_rows`` walks rows of L = C * I elements with per-element parameter vectors
(short segments: a transformer row's per-feature bias).
"""

from __future__ import annotations

from numba import njit, prange

from .fastmath import act

CHUNK = 8192
_FLAGS = {"contract"}  # fused multiply-add allowed; no reassociation, NaN and inf kept


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def affine_segments(x, scale, shift, out, code):
    p_, c_, i_ = x.shape
    chunks = (i_ + CHUNK - 1) // CHUNK
    for item in prange(p_ * c_ * chunks):
        seg = item // chunks
        start = (item % chunks) * CHUNK
        stop = min(start + CHUNK, i_)
        p = seg // c_
        c = seg % c_
        s = scale[c]
        b = shift[c]
        for i in range(start, stop):
            out[p, c, i] = act(x[p, c, i] * s + b, code)


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def affine_rows(x, scale, shift, out, code):
    rows, n = x.shape
    for r in prange(rows):
        for j in range(n):
            out[r, j] = act(x[r, j] * scale[j] + shift[j], code)
