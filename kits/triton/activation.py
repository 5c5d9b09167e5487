"""Activations as Triton device functions: value and derivative, selected by a code.

A kernel passes the code as a compile-time constant where the activation is the hot part of the
kernel (scale_shift_act: only its branch is compiled, and scheduled as straight-line code), or as a
run-time integer where it is a cheap epilogue (GEMMs: one compiled kernel serves every activation).
tanh and sigmoid are written with ``exp`` only, so the sources stay portable across vendors.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: activation name (hal.ops.ACTIVATIONS) -> the code the kernels take.
ACT_CODES = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4, "sigmoid": 5, "tanh": 6}

# Constants inlined below: 0.70710678... = 1/sqrt(2), 0.39894228... = 1/sqrt(2 pi),
# 0.79788456... = sqrt(2/pi) (the tanh approximation of GELU).


@triton.jit
def sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def tanh(z):
    return 2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0


@triton.jit
def act_fwd(z, act):
    """act(z) for an activation code (see ACT_CODES)."""
    y = z
    if act == 1:
        y = tl.where(z < 0.0, 0.0, z)  # NaN passes through, as torch.relu
    elif act == 2:
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif act == 3:
        y = 0.5 * z * (1.0 + tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)))
    elif act == 4:
        y = z * sigmoid(z)
    elif act == 5:
        y = sigmoid(z)
    elif act == 6:
        y = tanh(z)
    return y


@triton.jit
def act_grad(z, act):
    """d act / dz at z for an activation code (relu's derivative at 0 is 0, as torch's)."""
    d = z * 0.0 + 1.0
    if act == 1:
        d = tl.where(z > 0.0, 1.0, 0.0)
    elif act == 2:
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        pdf = 0.3989422804014327 * tl.exp(-0.5 * z * z)
        d = cdf + z * pdf
    elif act == 3:
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = tanh(inner)
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
    elif act == 4:
        s = sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    elif act == 5:
        s = sigmoid(z)
        d = s * (1.0 - s)
    elif act == 6:
        t = tanh(z)
        d = 1.0 - t * t
    return d
