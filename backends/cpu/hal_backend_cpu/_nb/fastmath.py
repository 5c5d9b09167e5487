"""Elementwise math for the numba kernels: activations and their derivatives, float32 and float64.

float64 uses libm (``math.exp``, ``math.erfc`` ...): exact to the last bit or so, as its tolerances
ask. float32 uses formulas LLVM can vectorise (libm calls are scalar, which made a float32 GELU ten
times slower than torch's vectorised one), accurate to a few units in the last place, far inside
float32's tolerance (rtol 1e-5):

- ``exp``: ``2**n * e**r`` with ``n = round(x / ln 2)``, ``r = x - n ln 2`` (ln 2 split in two
  parts so that r is exact), ``e**r`` by its Taylor polynomial to degree 7 (|r| <= ln 2 / 2: error
  below 1e-8 relative) and ``2**n`` built from its bits;
- ``erfc``: the Chebyshev fit of Numerical Recipes (``erfcc``, fractional error below 1.2e-7
  everywhere), so GELU's Phi(z) = erfc(-z / sqrt 2) / 2 keeps its relative accuracy for negative z;
- GELU's tanh form as ``z sigmoid(2u)`` (the same function, one exp);
- ``tanh``: odd Taylor polynomial to degree 9 for |u| < 0.3, else ``(1 - e) / (1 + e)`` with
  ``e = exp(-2|u|)`` (no cancellation there).

Activation codes are positions in ``hal.ops.ACTIVATIONS``.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from hal.ops import ACTIVATIONS

RELU, GELU, GELU_TANH, SILU, SIGMOID, TANH = (ACTIVATIONS.index(a) for a in ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"))

_SQRT1_2 = 0.7071067811865476
_SQRT_2_PI = 0.7978845608028654  # sqrt(2 / pi)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 pi)
_GELU_C = 0.044715


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 ``bits`` (an LLVM bitcast: vectorises)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


def exp(x):  # replaced by the typed implementations below inside numba code
    return math.exp(x)


def erfc(x):
    return math.erfc(x)


def tanh(x):
    return math.tanh(x)


@njit(inline="always", cache=True)
def _exp32(x):
    f = np.float32
    n = math.floor(x * f(1.4426950408889634) + f(0.5))
    r = x - n * f(0.693145751953125) - n * f(1.4286068203094172e-06)
    p = f(1.0) + r * (f(1.0) + r * (f(0.5) + r * (f(1.0 / 6) + r * (f(1.0 / 24) + r * (f(1.0 / 120) + r * (f(1.0 / 720) + r * f(1.0 / 5040)))))))
    ni = np.int32(min(max(n, f(-126.0)), f(127.0)))
    y = p * _f32_from_bits((ni + np.int32(127)) << np.int32(23))
    y = f(0.0) if x < f(-87.33654) else y
    y = f(np.inf) if x > f(88.72283) else y
    return x if x != x else y


@njit(inline="always", cache=True)
def _erfc32(x):
    f = np.float32
    z = abs(x)
    t = f(1.0) / (f(1.0) + f(0.5) * z)
    poly = f(-1.26551223) + t * (f(1.00002368) + t * (f(0.37409196) + t * (f(0.09678418) + t * (f(-0.18628806) + t * (
        f(0.27886807) + t * (f(-1.13520398) + t * (f(1.48851587) + t * (f(-0.82215223) + t * f(0.17087277)))))))))
    r = t * _exp32(-z * z + poly)
    return r if x >= f(0.0) else f(2.0) - r


@njit(inline="always", cache=True)
def _tanh32(u):
    f = np.float32
    a = abs(u)
    u2 = u * u
    small = u * (f(1.0) + u2 * (f(-1.0 / 3) + u2 * (f(2.0 / 15) + u2 * (f(-17.0 / 315) + u2 * f(62.0 / 2835)))))
    e = _exp32(f(-2.0) * a)
    big = (f(1.0) - e) / (f(1.0) + e)
    big = big if u >= f(0.0) else -big
    return small if a < f(0.3) else big


def _typed(fast, exact):
    """An overload: ``fast`` for float32 arguments, ``exact`` (libm) for any other number."""

    def impl(x):
        if isinstance(x, types.Float) and x.bitwidth == 32:
            return lambda x: fast(x)
        return lambda x: exact(x)

    return impl


def like(z, v):  # ``v`` in z's float type, inside numba code
    return v


@overload(like, inline="always")
def _like(z, v):
    if isinstance(z, types.Float) and z.bitwidth == 32:
        return lambda z, v: np.float32(v)
    return lambda z, v: np.float64(v)


overload(exp, inline="always")(_typed(_exp32, math.exp))
overload(erfc, inline="always")(_typed(_erfc32, math.erfc))
overload(tanh, inline="always")(_typed(_tanh32, math.tanh))


@njit(inline="always", cache=True)
def act(z, code):
    """The activation ``ACTIVATIONS[code]`` of z, in z's type."""
    one = like(z, 1.0)
    half = like(z, 0.5)
    if code == RELU:
        return like(z, 0.0) if z <= 0 else z  # NaN stays NaN
    if code == GELU:
        e = half * erfc(abs(z) * like(z, _SQRT1_2))
        return z * (one - e if z >= 0 else e)
    if code == GELU_TANH:  # z (1 + tanh u) / 2 = z sigmoid(2u): one exp, no cancellation
        return z / (one + exp(like(z, -2.0 * _SQRT_2_PI) * (z + like(z, _GELU_C) * z * z * z)))
    if code == SILU:
        return z / (one + exp(-z))
    if code == SIGMOID:
        return one / (one + exp(-z))
    if code == TANH:
        return tanh(z)
    return z


@njit(inline="always", cache=True)
def act_grad(z, code):
    """d ACTIVATIONS[code](z) / dz, in z's type; relu's is 0 at z <= 0 (torch's threshold_backward)."""
    one = like(z, 1.0)
    half = like(z, 0.5)
    if code == RELU:
        return like(z, 0.0) if z <= 0 else one
    if code == GELU:
        e = half * erfc(abs(z) * like(z, _SQRT1_2))
        cdf = one - e if z >= 0 else e
        return cdf + z * like(z, _INV_SQRT_2PI) * exp(-half * z * z)
    if code == GELU_TANH:
        k = like(z, _SQRT_2_PI)
        c = like(z, _GELU_C)
        t = tanh(k * (z + c * z * z * z))
        return half * (one + t) + half * z * (one - t * t) * k * (one + like(z, 3.0) * c * z * z)
    if code == SILU:
        s = one / (one + exp(-z))
        return s * (one + z * (one - s))
    if code == SIGMOID:
        s = one / (one + exp(-z))
        return s * (one - s)
    if code == TANH:
        t = tanh(z)
        return one - t * t
    return one
