"""Activations and ``act(x * scale + shift)``, with their derivatives (float64 math).

The activation helpers are shared with the GEMM family (linear's epilogue). Every formula is the
one PyTorch uses: gelu is erf-based, gelu_tanh the tanh approximation, relu's derivative is 0 at 0.
"""

from __future__ import annotations

import math

import numpy as np

from ._common import f64, like, reference

_erf = np.frompyfunc(math.erf, 1, 1)  # exact to float64 rounding; NumPy has no erf of its own
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715


def erf(z: np.ndarray) -> np.ndarray:
    return np.asarray(_erf(z), dtype=np.float64)


def sigmoid(z: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-z)), written so that exp never overflows."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def activation(z: np.ndarray, act: str) -> np.ndarray:
    """act(z) for the names of ``ops.elementwise.ACTIVATIONS``."""
    if act == "none":
        return z
    if act == "relu":
        return np.maximum(z, 0.0)
    if act == "gelu":
        return 0.5 * z * (1.0 + erf(z / math.sqrt(2.0)))
    if act == "gelu_tanh":
        return 0.5 * z * (1.0 + np.tanh(_SQRT_2_OVER_PI * (z + _GELU_TANH_C * z**3)))
    if act == "silu":
        return z * sigmoid(z)
    if act == "sigmoid":
        return sigmoid(z)
    if act == "tanh":
        return np.tanh(z)
    raise ValueError(f"unknown activation {act!r}")


def activation_grad(z: np.ndarray, act: str) -> np.ndarray:
    """d act(z) / dz."""
    if act == "none":
        return np.ones_like(z)
    if act == "relu":
        return (z > 0).astype(np.float64)
    if act == "gelu":  # Phi(z) + z * phi(z)
        return 0.5 * (1.0 + erf(z / math.sqrt(2.0))) + z * np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    if act == "gelu_tanh":
        t = np.tanh(_SQRT_2_OVER_PI * (z + _GELU_TANH_C * z**3))
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du
    if act == "silu":
        s = sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    if act == "sigmoid":
        s = sigmoid(z)
        return s * (1.0 - s)
    if act == "tanh":
        return 1.0 - np.tanh(z) ** 2
    raise ValueError(f"unknown activation {act!r}")


def sum_to(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``g`` over the dimensions along which an array of ``shape`` was broadcast to g's shape."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    return g.sum(axis=tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1), keepdims=True)


@reference("scale_shift_act")
def scale_shift_act(x, scale, shift, act):
    return like(activation(f64(x) * f64(scale) + f64(shift), act), x)


@reference("scale_shift_act_backward")
def scale_shift_act_backward(grad_out, x, scale, shift, act, output_mask):
    xs, s = f64(x), f64(scale)
    gz = f64(grad_out) * activation_grad(xs * s + f64(shift), act)
    grads = (gz * s, sum_to(gz * xs, np.shape(scale)), sum_to(gz, np.shape(shift)))
    return tuple(like(g, x) if m else None for g, m in zip(grads, output_mask))
