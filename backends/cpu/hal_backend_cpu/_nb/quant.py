"""quantize and dequantize per tensor in one pass over memory (torch's tensor math makes four or
five passes with a temporary each).

quantize: ``q = rint(float32(x) / scale) + zero_point`` in float32 (rounding half to even),
saturated to [lo, hi]; NaN gives 0 (as the reference and torch's cast give). dequantize:
``(q - zero_point) * scale`` in float32. Plain parallel loops over the flat arrays: LLVM vectorises
them (a loop over chunks inside the parallel one measured six times slower: it did not).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


#: 1.5 * 2**23: (v + MAGIC) - MAGIC rounds a float32 v with |v| < 2**22 to the nearest integer, ties
#: to even, in two vectorisable additions (np.rint is a libm call per element). Larger |v| come out
#: large with their sign, which the saturation maps to lo or hi as it would the exact rint.
MAGIC = np.float32(12582912.0)


@njit(parallel=True, cache=True)
def quantize_flat(x, scale, zero_point, lo, hi, out):
    n = x.size
    s, z = np.float32(scale), np.float32(zero_point)
    flo, fhi, zero = np.float32(lo), np.float32(hi), np.float32(0)
    for i in prange(n):
        q = ((np.float32(x[i]) / s + MAGIC) - MAGIC) + z
        q = flo if q < flo else q
        q = fhi if q > fhi else q
        out[i] = zero if q != q else q


@njit(parallel=True, cache=True)
def dequantize_flat(q, scale, zero_point, out):
    n = q.size
    s, z = np.float32(scale), np.float32(zero_point)
    for i in prange(n):
        out[i] = (np.float32(q[i]) - z) * s  # q - z is exact: small integers


@njit(parallel=True, cache=True)
def fake_quantize_grad_flat(g, x, inv, magic, z, qmin, qmax, out):
    """grad where ``rint(x * inv) + z`` lies in [qmin, qmax], else 0 (NaN and infinite codes are
    outside); the product in x's dtype, rounded with ``magic`` (MAGIC, or its float64 twin)."""
    zero = g.dtype.type(0)
    for i in prange(x.size):
        c = ((x[i] * inv + magic) - magic) + z
        out[i] = g[i] if (c >= qmin and c <= qmax) else zero
