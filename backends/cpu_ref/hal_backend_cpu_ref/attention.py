"""Softmax and scaled dot-product attention.

Attention is ``O = P @ v`` with ``P = softmax(S)``, ``S = q @ k^T * scale + mask``: a boolean mask
(True = attend) or is_causal (the top-left aligned lower triangle, as torch) puts -inf where a query
may not look. A query row with nothing to attend to gets P = 0, hence O = 0 and no gradient: torch
2.13's F.scaled_dot_product_attention does the same on CPU (its math path uses ``_safe_softmax``,
and so does its fused CPU kernel), not the NaN a plain softmax of an all -inf row would give.
"""

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


def _attention_weights(q, k, attn_mask, is_causal, scale) -> np.ndarray:
    """P = softmax over the keys of the masked, scaled scores; all-masked rows are 0."""
    s = f64(q) @ np.swapaxes(f64(k), -1, -2) * scale
    if is_causal:
        length, keys = s.shape[-2:]
        s = np.where(np.tril(np.ones((length, keys), dtype=bool)), s, -np.inf)
    elif attn_mask is not None:
        s = np.where(attn_mask, s, -np.inf) if attn_mask.dtype == bool else s + f64(attn_mask)
    blocked = np.all(s == -np.inf, axis=-1, keepdims=True)
    e = np.exp(s - np.where(blocked, 0.0, np.max(s, axis=-1, keepdims=True)))
    return np.where(blocked, 0.0, e / np.where(blocked, 1.0, np.sum(e, axis=-1, keepdims=True)))


@reference("scaled_dot_product_attention")
def scaled_dot_product_attention(q, k, v, attn_mask, is_causal, scale):
    return like(_attention_weights(q, k, attn_mask, is_causal, scale) @ f64(v), q)


@reference("scaled_dot_product_attention_backward")
def scaled_dot_product_attention_backward(grad_out, q, k, v, attn_mask, is_causal, scale):
    p = _attention_weights(q, k, attn_mask, is_causal, scale)
    do = f64(grad_out)
    dp = do @ np.swapaxes(f64(v), -1, -2)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * scale
    grad_q = ds @ f64(k)
    grad_k = np.swapaxes(ds, -1, -2) @ f64(q)
    grad_v = np.swapaxes(p, -1, -2) @ do
    return like(grad_q, q), like(grad_k, k), like(grad_v, v)
