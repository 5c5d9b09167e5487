"""Softmax of a small C-contiguous array along one dimension, in one call: the array seen as
(outer, n, inner) with the softmax over n, each line's maximum, exponentials and their sum.

For a NumPy caller's small arrays (see ``hal_backend_cpu.attention``): torch's kernel costs about
1.2 us more there for the two conversions around it than this whole call. Not vectorised (numba
calls libm's exp per element), so it is only chosen below a few hundred elements.

NaN and infinities as torch's softmax: a line holding NaN is NaN; +inf makes its line NaN where
inf - inf appears (every element, the sum being NaN); a line of -inf alone is NaN (-inf - -inf).
The sum runs in float64 (float32 lines are short here; it costs nothing and rounds once).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _lines(x, out):
    outer, n, inner = x.shape
    for o in range(outer):
        for i in range(inner):
            m = x[o, 0, i]
            for j in range(1, n):
                v = x[o, j, i]
                if v != v:  # NaN: the line is NaN (the comparisons below would skip it)
                    m = v
                    break
                if v > m:
                    m = v
            s = 0.0
            for j in range(n):
                e = np.exp(x[o, j, i] - m)
                out[o, j, i] = e
                s += e
            inv = 1.0 / s
            for j in range(n):
                out[o, j, i] = out[o, j, i] * inv


@njit(cache=True)
def softmax(x, dim):
    """A new C-contiguous array: the softmax of ``x`` (C-contiguous, ndim >= 1) along ``dim`` >= 0."""
    shape = x.shape
    outer = 1
    inner = 1
    for k in range(len(shape)):
        if k < dim:
            outer *= shape[k]
        elif k > dim:
            inner *= shape[k]
    out = np.empty_like(x)
    _lines(x.reshape((outer, shape[dim], inner)), out.reshape((outer, shape[dim], inner)))
    return out
