"""Layer and RMS normalisation over the trailing ``normalized_shape`` dimensions, and their gradients.

With ``xhat`` the normalised input and ``r`` the reciprocal of the standard deviation (layer_norm)
or of the root mean square (rms_norm), ``y = xhat * w (+ b)``. The input gradient of both is
``r * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = grad_out * w``; rms_norm has no mean to
subtract, so its ``mean(g)`` term is absent.
"""

from __future__ import annotations

import numpy as np

from ._common import elements, f64, like, reference
from .fp8 import amax


def _axes(x: np.ndarray, normalized_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(range(x.ndim - len(normalized_shape), x.ndim))


def _batch_axes(x: np.ndarray, normalized_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(range(x.ndim - len(normalized_shape)))


def _mean(a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """The mean over ``axes`` (NaN over none: 0 / 0, without NumPy's empty-slice warning)."""
    return np.sum(a, axis=axes, keepdims=True) / elements(a.shape[i] for i in axes)


def _layer_stats(x: np.ndarray, axes: tuple[int, ...], eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(xhat, r): the normalised input and 1 / sqrt(biased variance + eps)."""
    centred = x - _mean(x, axes)
    r = 1.0 / np.sqrt(_mean(centred * centred, axes) + eps)
    return centred * r, r


def _rms_stats(x: np.ndarray, axes: tuple[int, ...], eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(xhat, r): the normalised input and 1 / sqrt(mean(x^2) + eps)."""
    r = 1.0 / np.sqrt(_mean(x * x, axes) + eps)
    return x * r, r


def _weight(weight, normalized_shape: tuple[int, ...]) -> np.ndarray:
    return np.ones(normalized_shape) if weight is None else f64(weight)


@reference("layer_norm")
def layer_norm(x, normalized_shape, weight, bias, eps):
    xhat, _ = _layer_stats(f64(x), _axes(x, normalized_shape), eps)
    y = xhat * _weight(weight, normalized_shape)
    if bias is not None:
        y = y + f64(bias)
    return like(y, x)


@reference("layer_norm_backward")
def layer_norm_backward(grad_out, x, normalized_shape, weight, eps):
    axes, batch = _axes(x, normalized_shape), _batch_axes(x, normalized_shape)
    dy = f64(grad_out)
    xhat, r = _layer_stats(f64(x), axes, eps)
    g = dy * _weight(weight, normalized_shape)
    grad_x = r * (g - _mean(g, axes) - xhat * _mean(g * xhat, axes))
    return like(grad_x, x), like(np.sum(dy * xhat, axis=batch), x), like(np.sum(dy, axis=batch), x)


@reference("rms_norm")
def rms_norm(x, normalized_shape, weight, eps):
    xhat, _ = _rms_stats(f64(x), _axes(x, normalized_shape), eps)
    return like(xhat * _weight(weight, normalized_shape), x)


@reference("rms_norm_amax")
def rms_norm_amax(x, normalized_shape, weight, eps):
    """rms_norm, and max |float32(y)| of y as written in x's dtype (0 for an empty y)."""
    y = rms_norm(x, normalized_shape, weight, eps)
    return y, amax(np.asarray(y).astype(np.float32), "tensor", 128)


@reference("rms_norm_backward")
def rms_norm_backward(grad_out, x, normalized_shape, weight, eps):
    axes, batch = _axes(x, normalized_shape), _batch_axes(x, normalized_shape)
    dy = f64(grad_out)
    xhat, r = _rms_stats(f64(x), axes, eps)
    g = dy * _weight(weight, normalized_shape)
    grad_x = r * (g - xhat * _mean(g * xhat, axes))
    return like(grad_x, x), like(np.sum(dy * xhat, axis=batch), x)
