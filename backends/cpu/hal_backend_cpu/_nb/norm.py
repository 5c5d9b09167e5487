"""RMS norm over rows, forward and backward, each in one read of x (and grad_out).

Sums run in float64 whatever the data (a row of float32 squares summed in float32 drifts with the
row length; these kernels are bound by memory, not by the wider accumulator).

Up to :data:`SERIAL_ELEMENTS` the rows run on the calling thread alone: numba's parallel loop
(OpenMP) costs a fork and a barrier a call, several microseconds where the rows take a few, and on
a loaded machine far more: the caller spins at the barrier while a worker waits for a core (on the
project's 2-core VM under other sessions' load, a 16-layer Llama step with these kernels on its
(32, 64) rows went from about 30 to 250 ms of host time, 2026-12-07).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_FLAGS = {"contract", "reassoc"}  # reassociation lets LLVM vectorise the row sums


#: elements of x up to which a call runs serially (see the module docstring). Thread time a call
#: on the project's 2-core VM, idle (2026-12-07), serial against parallel: (32, 64) float32 forward
#: 0.9 / 1.8 us, backward 3.2 / 2.6; (256, 256) forward 14.7 / 9.4, backward 29.3 / 18.3.
SERIAL_ELEMENTS = 1 << 14


@njit(cache=True, fastmath=_FLAGS)
def _forward_row(x, r, weight, has_weight, eps, out):
    n = x.shape[1]
    ss = 0.0
    for j in range(n):
        v = np.float64(x[r, j])
        ss += v * v
    inv = 1.0 / np.sqrt(ss / n + eps)
    for j in range(n):
        y = np.float64(x[r, j]) * inv
        out[r, j] = y * weight[j] if has_weight else y


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def _forward_parallel(x, weight, has_weight, eps, out):
    for r in prange(x.shape[0]):
        _forward_row(x, r, weight, has_weight, eps, out)


@njit(cache=True, fastmath=_FLAGS)
def _forward_serial(x, weight, has_weight, eps, out):
    for r in range(x.shape[0]):
        _forward_row(x, r, weight, has_weight, eps, out)


def rms_forward(x, weight, has_weight, eps, out):
    """out = x / rms(x) (* weight) over the rows of the 2-d x."""
    run = _forward_serial if x.size <= SERIAL_ELEMENTS else _forward_parallel
    run(x, weight, has_weight, eps, out)


@njit(cache=True, fastmath=_FLAGS)
def _backward_block(g, x, weight, has_weight, eps, gx, gw_partial, blk):
    rows, n = x.shape
    blocks = gw_partial.shape[0]
    per = (rows + blocks - 1) // blocks
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


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def _backward_parallel(g, x, weight, has_weight, eps, gx, gw_partial):
    for blk in prange(gw_partial.shape[0]):
        _backward_block(g, x, weight, has_weight, eps, gx, gw_partial, blk)


@njit(cache=True, fastmath=_FLAGS)
def _backward_serial(g, x, weight, has_weight, eps, gx, gw_partial):
    for blk in range(gw_partial.shape[0]):
        _backward_block(g, x, weight, has_weight, eps, gx, gw_partial, blk)


def rms_backward(g, x, weight, has_weight, eps, gx, gw_partial):
    """grad_x per row; grad_weight summed per block of rows into ``gw_partial[block]``."""
    run = _backward_serial if x.size <= SERIAL_ELEMENTS else _backward_parallel
    run(g, x, weight, has_weight, eps, gx, gw_partial)
