"""Softmax and scaled dot-product attention.

Attention is ``O = P @ v`` with ``P = softmax(S)``, ``S = q @ k^T * scale + mask``: a boolean mask
(True = attend) or is_causal (the top-left aligned lower triangle, as torch) puts -inf where a query
may not look. A query row with nothing to attend to (every key masked, or no keys at all) gets
P = 0, hence O = 0 and no gradient: torch 2.13's F.scaled_dot_product_attention does the same on
CPU (its math path uses ``_safe_softmax``, and so does its fused CPU kernel), not the NaN a plain
softmax of an all -inf row would give. The batch dimensions of q, k, v and the mask broadcast.

Queries are independent, so attention runs over blocks of query rows: the (batch, L, S) scores
and weights are never held whole, only a block of them (memory proportional to the inputs and
output, whatever the sequence lengths).
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from hal.plugin import Inputs

from ._common import F64, array_elements, elements, f64, like, reference
from .elementwise import sum_to

#: elements of scores one query block holds at most (unless one query row alone is larger).
BLOCK_ELEMENTS = 2**22


def _softmax(s: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(s - np.max(s, axis=axis, keepdims=True, initial=-np.inf))
    return e / np.sum(e, axis=axis, keepdims=True)


@reference("softmax")
def softmax(x, dim):
    s = f64(x)
    if s.ndim == 0:  # the softmax of a single value is 1 (0 for NaN, which propagates)
        return like(_softmax(s.reshape(1), 0).reshape(()), x)
    return like(_softmax(s, dim), x)


@reference("softmax_backward")
def softmax_backward(grad_out, out, dim):
    g, y = f64(grad_out), f64(out)
    return like(y * (g - np.sum(g * y, axis=dim if y.ndim else None, keepdims=True)), out)


def _batch(q, k, v, attn_mask) -> tuple[int, ...]:
    """The broadcast batch shape of a call."""
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    if attn_mask is not None:
        shapes.append(attn_mask.shape[:-2])
    return tuple(np.broadcast_shapes(*shapes))


def _query_blocks(batch: tuple[int, ...], length: int, keys: int) -> Iterator[slice]:
    rows = max(1, BLOCK_ELEMENTS // max(1, elements(batch) * keys))
    for start in range(0, length, rows):
        yield slice(start, min(length, start + rows))


def _rows(a: Optional[np.ndarray], rows: slice, length: int) -> Optional[np.ndarray]:
    """The query rows ``rows`` of an array whose second-to-last dimension is queries (length L, or
    1 when broadcast)."""
    if a is None or a.ndim < 2 or a.shape[-2] != length:
        return a
    return a[..., rows, :]


def _attention_weights(q, k, attn_mask, is_causal, scale, rows: slice) -> np.ndarray:
    """P for the query rows ``rows``: softmax over the keys of the masked, scaled scores; rows with
    nothing to attend to are 0."""
    length, keys = q.shape[-2], k.shape[-2]
    s = f64(q[..., rows, :]) @ np.swapaxes(f64(k), -1, -2) * scale
    if is_causal:
        s = np.where(np.arange(rows.start, rows.stop)[:, None] >= np.arange(keys)[None, :], s, -np.inf)
    elif attn_mask is not None:
        m = _rows(attn_mask, rows, length)
        s = np.where(m, s, -np.inf) if m.dtype == bool else s + f64(m)
    peak = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    blocked = peak == -np.inf
    e = np.exp(s - np.where(blocked, 0.0, peak))
    return np.where(blocked, 0.0, e / np.where(blocked, 1.0, np.sum(e, axis=-1, keepdims=True)))


def _attention_footprint(inputs: Inputs) -> int:
    q, k, v, mask = inputs["q"], inputs["k"], inputs["v"], inputs["attn_mask"]
    batch, length, keys = _batch(q, k, v, mask), int(q.shape[-2]), int(k.shape[-2])
    block = elements(batch) * keys * max(1, min(length, BLOCK_ELEMENTS // max(1, elements(batch) * keys)))
    out = elements(batch) * length * (int(q.shape[-1]) + int(v.shape[-1]))  # the result, and grad_q's size
    return F64 * (2 * array_elements(inputs) + 3 * out + 6 * block)


@reference("scaled_dot_product_attention", _attention_footprint)
def scaled_dot_product_attention(q, k, v, attn_mask, is_causal, scale):
    batch, length = _batch(q, k, v, attn_mask), q.shape[-2]
    out, vs = np.zeros(batch + (length, v.shape[-1])), f64(v)
    for rows in _query_blocks(batch, length, k.shape[-2]):
        out[..., rows, :] = _attention_weights(q, k, attn_mask, is_causal, scale, rows) @ vs
    return like(out, q)


@reference("scaled_dot_product_attention_backward", _attention_footprint)
def scaled_dot_product_attention_backward(grad_out, q, k, v, attn_mask, is_causal, scale):
    batch, length = _batch(q, k, v, attn_mask), q.shape[-2]
    do, ks, vs = f64(grad_out), f64(k), f64(v)
    grad_q = np.zeros(batch + q.shape[-2:])  # summed to q's shape at the end (its rows are split)
    grad_k, grad_v = np.zeros(k.shape), np.zeros(v.shape)  # summed to their shapes block by block
    for rows in _query_blocks(batch, length, k.shape[-2]):
        p = _attention_weights(q, k, attn_mask, is_causal, scale, rows)
        do_r = do[..., rows, :]
        dp = do_r @ np.swapaxes(vs, -1, -2)
        ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * scale
        grad_q[..., rows, :] = ds @ ks
        grad_k += sum_to(np.swapaxes(ds, -1, -2) @ f64(q[..., rows, :]), k.shape)
        grad_v += sum_to(np.swapaxes(p, -1, -2) @ do_r, v.shape)
    return like(sum_to(grad_q, q.shape), q), like(grad_k, k), like(grad_v, v)
