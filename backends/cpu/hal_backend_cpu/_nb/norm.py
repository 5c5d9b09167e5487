"""RMS norm over rows, forward and backward, each in one read of x (and grad_out).

Sums run in float64 whatever the data (a row of float32 squares summed in float32 drifts with the
row length; these kernels are bound by memory, not by the wider accumulator).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_FLAGS = {"contract", "reassoc"}  # reassociation lets LLVM vectorise the row sums


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def rms_forward(x, weight, has_weight, eps, out):
    rows, n = x.shape
    for r in prange(rows):
        ss = 0.0
        for j in range(n):
            v = np.float64(x[r, j])
            ss += v * v
        inv = 1.0 / np.sqrt(ss / n + eps)
        for j in range(n):
            y = np.float64(x[r, j]) * inv
            out[r, j] = y * weight[j] if has_weight else y


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def rms_backward(g, x, weight, has_weight, eps, gx, gw_partial):
    """grad_x per row; grad_weight summed per block of rows into ``gw_partial[block]``."""
    rows, n = x.shape
    blocks = gw_partial.shape[0]
    per = (rows + blocks - 1) // blocks
    for blk in prange(blocks):
        acc = gw_partial[blk]
        acc[:] = 0.0
        for r in range(blk * per, min(rows, (blk + 1) * per)):
            ss = 0.0
            for j in range(n):
                v = np.float64(x[r, j])
                ss += v * v
            inv = 1.0 / np.sqrt(ss / n + eps)
            dot = 0.0
            for j in range(n):
                xhat = np.float64(x[r, j]) * inv
                gj = np.float64(g[r, j])
                h = gj * weight[j] if has_weight else gj
                dot += h * xhat
                acc[j] += gj * xhat
            dot /= n
            for j in range(n):
                xhat = np.float64(x[r, j]) * inv
                gj = np.float64(g[r, j])
                h = gj * weight[j] if has_weight else gj
                gx[r, j] = inv * (h - xhat * dot)
