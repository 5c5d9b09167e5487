"""Rotary position embeddings and the SwiGLU gate (float64 math)."""

from __future__ import annotations

import numpy as np

from ._common import f64, like, reference
from .elementwise import sigmoid
from .fp8 import amax


def _halves(a: np.ndarray, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """The two coordinates each rotation acts on: pairs (2i, 2i+1), or the first and second half."""
    if interleaved:
        return a[..., 0::2], a[..., 1::2]
    half = a.shape[-1] // 2
    return a[..., :half], a[..., half:]


def _join(a: np.ndarray, b: np.ndarray, interleaved: bool) -> np.ndarray:
    if interleaved:
        return np.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])
    return np.concatenate([a, b], axis=-1)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Each pair (x1, x2) turned by the angle whose cosine and sine are given."""
    x1, x2 = _halves(f64(x), interleaved)
    c, s = f64(cos), f64(sin)
    return _join(x1 * c - x2 * s, x2 * c + x1 * s, interleaved)


@reference("rotary_embedding")
def rotary_embedding(x, cos, sin, interleaved):
    return like(_rotate(x, cos, sin, interleaved), x)


@reference("rotary_embedding_backward")
def rotary_embedding_backward(grad_out, cos, sin, interleaved):
    """A rotation's adjoint is the rotation by the opposite angle: sin negated."""
    return like(_rotate(grad_out, cos, -f64(sin), interleaved), grad_out)


def _sum_to(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``g`` summed over the dimensions broadcasting added or stretched to reach its shape."""
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    stretched = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    return g.sum(axis=stretched, keepdims=True) if stretched else g


@reference("swiglu")
def swiglu(gate, up):
    g = f64(gate)
    return like(g * sigmoid(g) * f64(up), gate)


@reference("swiglu_amax")
def swiglu_amax(gate, up):
    """swiglu, and max |float32(y)| of y as written in gate's dtype (0 for an empty y)."""
    y = swiglu(gate, up)
    return y, amax(np.asarray(y).astype(np.float32), "tensor", 128)


@reference("swiglu_backward")
def swiglu_backward(grad_out, gate, up):
    """d silu(g)/dg = s (1 + g (1 - s)) with s = sigmoid(g)."""
    g, u, go = f64(gate), f64(up), f64(grad_out)
    s = sigmoid(g)
    grad_gate = go * u * s * (1.0 + g * (1.0 - s))
    grad_up = go * g * s
    return like(_sum_to(np.broadcast_to(grad_gate, go.shape), gate.shape), gate), like(_sum_to(np.broadcast_to(grad_up, go.shape), up.shape), up)
