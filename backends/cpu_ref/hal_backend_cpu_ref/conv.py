"""Convolution, batch normalisation and conv -> batch-norm -> ReLU, with their gradients (float64).

Arguments arrive canonical: x batched (N, C, H, W), stride and dilation as pairs, padding as
(top, bottom, left, right). A convolution is an einsum over the strided, dilated windows of the
padded input, with the channels split into groups; its input gradient adds each kernel tap's
contribution back into the padded input.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ._common import f64, like, reference

# --- conv2d ------------------------------------------------------------------------------------


def _pad(x: np.ndarray, padding: tuple[int, int, int, int]) -> np.ndarray:
    top, bottom, left, right = padding
    return np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))


def _windows(xp: np.ndarray, kernel: tuple[int, int], stride, dilation, groups: int) -> np.ndarray:
    """(N, G, C/G, Ho, Wo, kH, kW): the input seen by each kernel tap at each output position."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    win = sliding_window_view(xp, ((kh - 1) * dh + 1, (kw - 1) * dw + 1), axis=(2, 3))
    win = win[:, :, ::sh, ::sw, ::dh, ::dw]
    n, c = xp.shape[:2]
    return win.reshape(n, groups, c // groups, *win.shape[2:])


def _grouped(weight: np.ndarray, groups: int) -> np.ndarray:
    """(G, O/G, C/G, kH, kW)."""
    return weight.reshape(groups, weight.shape[0] // groups, *weight.shape[1:])


def _conv(x: np.ndarray, weight: np.ndarray, bias: Optional[np.ndarray], stride, padding, dilation, groups) -> np.ndarray:
    win = _windows(_pad(x, padding), weight.shape[2:], stride, dilation, groups)
    y = np.einsum("ngchwij,gocij->ngohw", win, _grouped(weight, groups), optimize=True)
    y = y.reshape(x.shape[0], weight.shape[0], *y.shape[3:])
    return y if bias is None else y + bias[:, None, None]


def _conv_grads(g: np.ndarray, x: np.ndarray, weight: np.ndarray, stride, padding, dilation, groups):
    """(grad_x, grad_weight, grad_bias) of _conv, all float64."""
    (sh, sw), (dh, dw) = stride, dilation
    n, (top, _, left, _) = x.shape[0], padding
    ho, wo = g.shape[2:]
    xp = _pad(x, padding)
    gg = g.reshape(n, groups, -1, ho, wo)  # (N, G, O/G, Ho, Wo)
    win = _windows(xp, weight.shape[2:], stride, dilation, groups)
    grad_w = np.einsum("ngchwij,ngohw->gocij", win, gg, optimize=True).reshape(weight.shape)
    grad_win = np.einsum("ngohw,gocij->ngchwij", gg, _grouped(weight, groups), optimize=True)
    grad_xp = np.zeros_like(xp)
    for i in range(weight.shape[2]):
        for j in range(weight.shape[3]):
            rows = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
            grad_xp[:, :, rows, cols] += grad_win[..., i, j].reshape(n, -1, ho, wo)
    grad_x = grad_xp[:, :, top : top + x.shape[2], left : left + x.shape[3]]
    return grad_x, grad_w, g.sum(axis=(0, 2, 3))


@reference("conv2d")
def conv2d(x, weight, bias, stride, padding, dilation, groups):
    b = None if bias is None else f64(bias)
    return like(_conv(f64(x), f64(weight), b, stride, padding, dilation, groups), x)


@reference("conv2d_backward")
def conv2d_backward(grad_out, x, weight, stride, padding, dilation, groups):
    grads = _conv_grads(f64(grad_out), f64(x), f64(weight), stride, padding, dilation, groups)
    return tuple(like(gr, x) for gr in grads)


# --- batch_norm over dimension 1 ---------------------------------------------------------------


def _per_channel(v: np.ndarray, ndim: int) -> np.ndarray:
    """A (C,) vector shaped (1, C, 1, ...) to broadcast against an ndim-dimensional input."""
    return f64(v).reshape((1, -1) + (1,) * (ndim - 2))


def _stats(x: np.ndarray, running_mean, running_var, training: bool) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (biased) variance used to normalise: the batch's in training, else the running ones."""
    if training:
        axes = (0,) + tuple(range(2, x.ndim))
        return x.mean(axis=axes, keepdims=True), x.var(axis=axes, keepdims=True)
    return _per_channel(running_mean, x.ndim), _per_channel(running_var, x.ndim)


def _update_running(running_mean, running_var, mean: np.ndarray, var: np.ndarray, n: int, momentum: float) -> None:
    """r = (1 - momentum) * r + momentum * stat, written into the given arrays (unbiased variance)."""
    if running_mean is None:
        return
    running_mean[...] = (1 - momentum) * f64(running_mean) + momentum * mean.ravel()
    running_var[...] = (1 - momentum) * f64(running_var) + momentum * var.ravel() * n / (n - 1)


def _bn(x: np.ndarray, running_mean, running_var, weight, bias, training: bool, momentum: float, eps: float) -> np.ndarray:
    """Batch norm of a float64 x; updates the running statistics in place when training."""
    mean, var = _stats(x, running_mean, running_var, training)
    if training:
        _update_running(running_mean, running_var, mean, var, x.size // x.shape[1], momentum)
    y = (x - mean) / np.sqrt(var + eps)
    if weight is not None:
        y = y * _per_channel(weight, x.ndim)
    return y if bias is None else y + _per_channel(bias, x.ndim)


def _bn_grads(g: np.ndarray, x: np.ndarray, running_mean, running_var, weight, training: bool, eps: float):
    """(grad_x, grad_weight, grad_bias) of _bn, all float64; a missing weight counts as ones."""
    axes = (0,) + tuple(range(2, x.ndim))
    mean, var = _stats(x, running_mean, running_var, training)
    inv_std = 1.0 / np.sqrt(var + eps)
    x_hat = (x - mean) * inv_std
    gamma = 1.0 if weight is None else _per_channel(weight, x.ndim)
    g_hat = g * gamma
    if training:  # mean and variance depend on x too
        g_hat = g_hat - g_hat.mean(axis=axes, keepdims=True) - x_hat * (g_hat * x_hat).mean(axis=axes, keepdims=True)
    return g_hat * inv_std, (g * x_hat).sum(axis=axes), g.sum(axis=axes)


def _param_dtype(param, x: np.ndarray) -> np.ndarray:
    """The array whose dtype a (C,) parameter's gradient takes: the parameter's own (float32 beside
    half-precision x, as torch autograd gives), x's when the parameter is absent."""
    return x if param is None else param


@reference("batch_norm")
def batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
    return like(_bn(f64(x), running_mean, running_var, weight, bias, training, momentum, eps), x)


@reference("batch_norm_backward")
def batch_norm_backward(grad_out, x, running_mean, running_var, weight, training, eps):
    grad_x, grad_w, grad_b = _bn_grads(f64(grad_out), f64(x), running_mean, running_var, weight, training, eps)
    p = _param_dtype(weight, x)
    return like(grad_x, x), like(grad_w, p), like(grad_b, p)


# --- fused_conv_bn_relu: relu(batch_norm(conv2d(x))) -------------------------------------------


@reference("fused_conv_bn_relu")
def fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    b = None if conv_bias is None else f64(conv_bias)
    z = _conv(f64(x), f64(conv_weight), b, stride, padding, dilation, groups)
    y = _bn(z, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
    return like(np.maximum(y, 0.0), x)


@reference("fused_conv_bn_relu_backward")
def fused_conv_bn_relu_backward(grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training):
    xs, w = f64(x), f64(conv_weight)
    z = _conv(xs, w, None if conv_bias is None else f64(conv_bias), stride, padding, dilation, groups)
    stats = (None, None) if training else (running_mean, running_var)  # training: leave them untouched
    y = _bn(z, *stats, bn_weight, bn_bias, training, 0.0, eps)
    g_y = f64(grad_out) * (y > 0)
    g_z, grad_gamma, grad_beta = _bn_grads(g_y, z, running_mean, running_var, bn_weight, training, eps)
    grad_x, grad_w, grad_b = _conv_grads(g_z, xs, w, stride, padding, dilation, groups)
    gamma_like, beta_like = _param_dtype(bn_weight, x), _param_dtype(bn_bias, x)
    return like(grad_x, x), like(grad_w, x), like(grad_b, x), like(grad_gamma, gamma_like), like(grad_beta, beta_like)
