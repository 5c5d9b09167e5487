"""Softmax and scaled dot-product attention."""

from __future__ import annotations

import numpy as np

from ._common import f64, like, reference


def _softmax(s: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(s - np.max(s, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


@reference("softmax")
def softmax(x, dim):
    return like(_softmax(f64(x), dim), x)


@reference("softmax_backward")
def softmax_backward(grad_out, out, dim):
    g, y = f64(grad_out), f64(out)
    return like(y * (g - np.sum(g * y, axis=dim, keepdims=True)), out)
