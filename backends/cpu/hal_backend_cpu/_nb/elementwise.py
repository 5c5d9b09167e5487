"""scale_shift_act in one pass for act none / relu: read x, write (relu of) x * scale + shift.

``affine_rows`` walks the rows of x (C-contiguous, (rows, L)) with per-element parameter vectors of
length L: a transformer row's feature-wise scale and bias, where this pass beats torch's kernels.
ReLU keeps NaN (as torch's does).
"""

from __future__ import annotations

from numba import njit, prange

_FLAGS = {"contract"}  # fused multiply-add allowed; no reassociation, NaN and inf kept


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
