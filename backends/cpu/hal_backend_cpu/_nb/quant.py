"""quantize and dequantize per tensor in one pass over memory (torch's tensor math makes four or
five passes with a temporary each).

quantize: ``q = rint(float32(x) / scale) + zero_point`` in float32 (rounding half to even),
saturated to [lo, hi]; NaN gives hi (as torch.quantize_per_tensor; ops/quant.py). dequantize:
``(q - zero_point) * scale`` in float32. Plain parallel loops over the flat arrays: LLVM vectorises
them (a loop over chunks inside the parallel one measured six times slower: it did not).

Rounding to the nearest integer, ties to even, is ``(v + magic) - magic``: two vectorisable
additions where ``np.rint`` is a libm call per element; ``magic`` and the magnitudes it rounds come
from the caller (``hal_backend_cpu.quant.ROUNDING``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def quantize_flat(x, scale, zero_point, lo, hi, magic, out):
    """Values of |x / scale| past the magnitudes ``magic`` rounds come out large with their sign,
    which the saturation maps to lo or hi as it would the exact rint."""
    n = x.size
    s, z, m = np.float32(scale), np.float32(zero_point), np.float32(magic)
    flo, fhi = np.float32(lo), np.float32(hi)
    for i in prange(n):
        q = ((np.float32(x[i]) / s + m) - m) + z
        q = flo if q < flo else q
        q = fhi if q > fhi else q
        out[i] = fhi if q != q else q


@njit(parallel=True, cache=True)
def dequantize_flat(q, scale, zero_point, out):
    n = q.size
    s, z = np.float32(scale), np.float32(zero_point)
    for i in prange(n):
        out[i] = (np.float32(q[i]) - z) * s  # q - z is exact: small integers


@njit(parallel=True, cache=True)
def fake_quantize_grad_flat(g, x, inv, magic, z, qmin, qmax, out):
    """grad where ``rint(x * inv) + z`` lies in [qmin, qmax], else 0 (NaN and infinite codes are
    outside); the product in x's dtype, rounded with ``magic`` of x's dtype."""
    zero = g.dtype.type(0)
    for i in prange(x.size):
        c = ((x[i] * inv + magic) - magic) + z
        out[i] = g[i] if (c >= qmin and c <= qmax) else zero
