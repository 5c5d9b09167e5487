"""cross_entropy and the LM head fused with it (float64 math).

linear_cross_entropy never holds the whole (N, V) logits, here too: rows go through in blocks of at
most BLOCK_ELEMENTS logits, and the backward recomputes each block's logits.
"""

from __future__ import annotations

import numpy as np

from hal.errors import InvalidArgumentError

from ._common import f64, reference

#: logits held at once by linear_cross_entropy (and its backward), in elements
BLOCK_ELEMENTS = 1 << 20


def _loss_dtype(a: np.ndarray) -> np.dtype:
    return np.dtype(np.float64) if a.dtype == np.float64 else np.dtype(np.float32)


def _checked_targets(op: str, target: np.ndarray, ignore_index: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(counted rows, their class indices with ignored rows at 0); out-of-range targets raise."""
    t = np.asarray(target, dtype=np.int64)
    counted = t != ignore_index
    bad = counted & ((t < 0) | (t >= classes))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InvalidArgumentError(op, "target", f"class indices in [0, {classes}) or ignore_index ({ignore_index})", f"{int(t[i])} at row {i}")
    return counted, np.where(counted, t, 0)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = np.max(z, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return z - m - np.log(np.sum(np.exp(z - m), axis=1, keepdims=True))


def _row_losses(logp: np.ndarray, t: np.ndarray, counted: np.ndarray, eps: float) -> np.ndarray:
    picked = np.take_along_axis(logp, t[:, None], axis=1)[:, 0]
    rows = -(1.0 - eps) * picked - eps / logp.shape[1] * logp.sum(axis=1)
    return np.where(counted, rows, 0.0)


def _reduce(rows: np.ndarray, counted: np.ndarray, reduction: str, dtype: np.dtype) -> np.ndarray:
    if reduction == "none":
        return rows.astype(dtype)
    total = rows.sum()
    if reduction == "mean":
        total = total / counted.sum() if counted.any() else np.nan
    return np.asarray(total, dtype=dtype)


def _row_scale(grad_out: np.ndarray, counted: np.ndarray, reduction: str) -> np.ndarray:
    """The factor of each row's logit gradient: its grad_out (none), grad_out (sum), grad_out / count (mean)."""
    g = f64(grad_out)
    if reduction == "mean":
        g = g / max(1, int(counted.sum()))
    return np.where(counted, np.broadcast_to(g, counted.shape), 0.0)


def _logit_grad(logp: np.ndarray, t: np.ndarray, eps: float, scale: np.ndarray) -> np.ndarray:
    """(softmax - (1 - eps) onehot - eps / C) * scale, row by row."""
    d = np.exp(logp) - eps / logp.shape[1]
    d[np.arange(len(t)), t] -= 1.0 - eps
    return d * scale[:, None]


@reference("cross_entropy")
def cross_entropy(logits, target, ignore_index, label_smoothing, reduction):
    counted, t = _checked_targets("cross_entropy", target, ignore_index, logits.shape[1])
    rows = _row_losses(_log_softmax(f64(logits)), t, counted, label_smoothing)
    return _reduce(rows, counted, reduction, _loss_dtype(logits))


@reference("cross_entropy_backward")
def cross_entropy_backward(grad_out, logits, target, ignore_index, label_smoothing, reduction):
    counted, t = _checked_targets("cross_entropy_backward", target, ignore_index, logits.shape[1])
    grad = _logit_grad(_log_softmax(f64(logits)), t, label_smoothing, _row_scale(grad_out, counted, reduction))
    return grad.astype(logits.dtype)


def _blocks(n: int, v: int):
    step = max(1, BLOCK_ELEMENTS // max(1, v))
    for i in range(0, n, step):
        yield slice(i, min(n, i + step))


def _logits(x: np.ndarray, weight: np.ndarray, bias, rows: slice) -> np.ndarray:
    z = f64(x[rows]) @ f64(weight).T
    return z + f64(bias) if bias is not None else z


@reference("linear_cross_entropy")
def linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, reduction):
    counted, t = _checked_targets("linear_cross_entropy", target, ignore_index, weight.shape[0])
    rows = np.zeros(x.shape[0])
    for r in _blocks(x.shape[0], weight.shape[0]):
        rows[r] = _row_losses(_log_softmax(_logits(x, weight, bias, r)), t[r], counted[r], label_smoothing)
    return _reduce(rows, counted, reduction, _loss_dtype(x))


@reference("linear_cross_entropy_backward")
def linear_cross_entropy_backward(grad_out, x, weight, target, bias, ignore_index, label_smoothing, reduction):
    counted, t = _checked_targets("linear_cross_entropy_backward", target, ignore_index, weight.shape[0])
    scale = _row_scale(grad_out, counted, reduction)
    w = f64(weight)
    grad_x = np.zeros(x.shape)
    grad_w = np.zeros(weight.shape)
    grad_b = np.zeros(weight.shape[0])
    for r in _blocks(x.shape[0], weight.shape[0]):
        d = _logit_grad(_log_softmax(_logits(x, weight, bias, r)), t[r], label_smoothing, scale[r])
        grad_x[r] = d @ w
        grad_w += d.T @ f64(x[r])
        grad_b += d.sum(axis=0)
    return grad_x.astype(x.dtype), grad_w.astype(x.dtype), grad_b.astype(x.dtype)
