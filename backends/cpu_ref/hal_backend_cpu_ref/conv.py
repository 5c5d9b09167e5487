"""Convolution, batch normalisation, conv -> batch-norm -> ReLU and conv -> batch-norm -> add -> ReLU,
with their gradients (float64).

Arguments arrive canonical: x batched (N, C, H, W), stride and dilation as pairs, padding as
(top, bottom, left, right). A convolution is a sum over kernel taps: tap (i, j) reads input row
``p * sh - top + i * dh`` (and column likewise) for output position (p, q) and multiplies it by
``weight[:, :, i, j]``, channels split into groups. Padding contributes zeros, so the input seen by
each tap ("columns", an (N, G, C/G, kH, kW, rows, Wo) array) is built only from the output
positions whose tap lands inside the input, and a block of output rows at a time: the padded input
is never built, and the memory a convolution needs is its input, weight and output plus one block,
whatever its padding and dilation. Each block is then one contraction with the weight. The input
gradient adds each tap's columns gradient back into the input positions it read.
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from hal.plugin import Inputs

from ._common import elements, f64, like, reference, with_result

# --- conv2d ------------------------------------------------------------------------------------

#: elements of the columns of one block of output rows (at least one row's).
BLOCK_ELEMENTS = 2**23


def _tap_span(size: int, rows: range, stride: int, before: int, offset_of_tap: int) -> Optional[tuple[slice, slice]]:
    """(output positions within ``rows``, input positions) where a tap lands inside the input, as
    slices (output positions relative to rows.start; input positions strided), or None."""
    offset = offset_of_tap - before  # input position read by output position 0
    first = max(rows.start, -(offset // stride) if offset < 0 else 0)  # p * stride + offset >= 0
    last = min(rows.stop - 1, (size - 1 - offset) // stride)  # p * stride + offset < size
    if first > last:
        return None
    start = first * stride + offset
    return slice(first - rows.start, last - rows.start + 1), slice(start, start + (last - first) * stride + 1, stride)


def _taps(x_shape, weight_shape, rows: range, wo: int, stride, padding, dilation) -> Iterator[tuple[int, int, tuple, tuple]]:
    """(i, j, columns index, input index) of every tap landing inside the input for output rows
    ``rows`` (indices into (N, G, C/G, H, W) and the block's (N, G, C/G, kH, kW, rows, Wo))."""
    (sh, sw), (dh, dw), (top, _, left, _) = stride, dilation, padding
    every = (slice(None),) * 3
    for i in range(weight_shape[2]):
        r = _tap_span(x_shape[2], rows, sh, top, i * dh)
        if r is None:
            continue
        for j in range(weight_shape[3]):
            c = _tap_span(x_shape[3], range(wo), sw, left, j * dw)
            if c is not None:
                yield i, j, every + (i, j, r[0], c[0]), every + (r[1], c[1])


def _row_blocks(x_shape, weight_shape, groups: int, ho: int, wo: int) -> Iterator[range]:
    per_row = x_shape[0] * x_shape[1] * weight_shape[2] * weight_shape[3] * wo
    step = max(1, BLOCK_ELEMENTS // max(1, per_row))
    for start in range(0, ho, step):
        yield range(start, min(ho, start + step))


def _out_hw(x_shape, weight_shape, stride, padding, dilation) -> tuple[int, int]:
    (sh, sw), (dh, dw), (top, bottom, left, right) = stride, dilation, padding
    ho = (x_shape[2] + top + bottom - dh * (weight_shape[2] - 1) - 1) // sh + 1
    wo = (x_shape[3] + left + right - dw * (weight_shape[3] - 1) - 1) // sw + 1
    return ho, wo


def _grouped_x(x: np.ndarray, groups: int) -> np.ndarray:
    """(N, G, C/G, H, W)."""
    return x.reshape(x.shape[0], groups, x.shape[1] // groups, *x.shape[2:])


def _grouped(weight: np.ndarray, groups: int) -> np.ndarray:
    """(G, O/G, C/G, kH, kW)."""
    return weight.reshape(groups, weight.shape[0] // groups, *weight.shape[1:])


def _columns(xg: np.ndarray, weight_shape, rows: range, wo: int, stride, padding, dilation) -> np.ndarray:
    """What every tap reads for output rows ``rows``: (N, G, C/G, kH, kW, len(rows), Wo), zeros where
    it lands in the padding."""
    cols = np.zeros(xg.shape[:3] + tuple(weight_shape[2:]) + (len(rows), wo))
    for _, _, at, read in _taps(xg.shape[:2] + xg.shape[3:], weight_shape, rows, wo, stride, padding, dilation):
        cols[at] = xg[read]
    return cols


def _conv(x: np.ndarray, weight: np.ndarray, bias: Optional[np.ndarray], stride, padding, dilation, groups) -> np.ndarray:
    n, o = x.shape[0], weight.shape[0]
    ho, wo = _out_hw(x.shape, weight.shape, stride, padding, dilation)
    if not x.shape[1]:
        return np.zeros((n, 0, ho, wo))  # as torch: an input without channels gives an output without any
    y = np.zeros((n, groups, o // groups, ho, wo))
    xg, wg = _grouped_x(x, groups), _grouped(weight, groups)
    for rows in _row_blocks(x.shape, weight.shape, groups, ho, wo):
        cols = _columns(xg, weight.shape, rows, wo, stride, padding, dilation)
        y[..., rows.start : rows.stop, :] = np.einsum("ngcijhw,gocij->ngohw", cols, wg, optimize=True)
    y = y.reshape(n, o, ho, wo)
    return y if bias is None else y + bias[:, None, None]


def _conv_f64(x, weight, bias, stride, padding, dilation, groups) -> np.ndarray:
    """The convolution of arrays of any float dtype, in float64."""
    return _conv(f64(x), f64(weight), None if bias is None else f64(bias), stride, padding, dilation, groups)


def _conv_grads(g: np.ndarray, x: np.ndarray, weight: np.ndarray, stride, padding, dilation, groups):
    """(grad_x, grad_weight, grad_bias) of _conv, all float64."""
    o = weight.shape[0]
    if not x.shape[1]:  # the output has no channels: nothing depends on the weight or the bias
        return np.zeros(x.shape), np.zeros(weight.shape), np.zeros(o)
    ho, wo = g.shape[2:]
    gg = g.reshape(g.shape[0], groups, o // groups, ho, wo)  # (N, G, O/G, Ho, Wo)
    xg, wg = _grouped_x(x, groups), _grouped(weight, groups)
    grad_x, grad_w = np.zeros(xg.shape), np.zeros(wg.shape)
    for rows in _row_blocks(x.shape, weight.shape, groups, ho, wo):
        g_rows = gg[..., rows.start : rows.stop, :]
        grad_w += np.einsum("ngohw,ngcijhw->gocij", g_rows, _columns(xg, weight.shape, rows, wo, stride, padding, dilation), optimize=True)
        grad_cols = np.einsum("ngohw,gocij->ngcijhw", g_rows, wg, optimize=True)
        for _, _, at, read in _taps(x.shape, weight.shape, rows, wo, stride, padding, dilation):
            grad_x[read] += grad_cols[at]
    return grad_x.reshape(x.shape), grad_w.reshape(weight.shape), g.sum(axis=(0, 2, 3))


def _conv_output_elements(inputs: Inputs) -> int:
    x = inputs["x"]
    w = inputs["weight"] if "weight" in inputs.op.param_names else inputs["conv_weight"]
    ho, wo = _out_hw(x.shape, w.shape, inputs["stride"], inputs["padding"], inputs["dilation"])
    return elements((x.shape[0], w.shape[0], ho, wo))


def _conv_footprint(inputs: Inputs) -> int:
    """A convolution's working set: inputs, the output and its gradient's temporaries, and two
    blocks of columns (the columns and their gradient)."""
    return with_result(_conv_output_elements)(inputs) + 2 * 8 * BLOCK_ELEMENTS


CONV_FOOTPRINT = _conv_footprint


@reference("conv2d", CONV_FOOTPRINT)
def conv2d(x, weight, bias, stride, padding, dilation, groups):
    return like(_conv_f64(x, weight, bias, stride, padding, dilation, groups), x)


@reference("conv2d_backward", CONV_FOOTPRINT)
def conv2d_backward(grad_out, x, weight, stride, padding, dilation, groups, output_mask):
    grads = _conv_grads(f64(grad_out), f64(x), f64(weight), stride, padding, dilation, groups)
    return tuple(like(gr, x) if m else None for gr, m in zip(grads, output_mask))


# --- batch_norm over dimension 1 ---------------------------------------------------------------


def _per_channel(v: np.ndarray, ndim: int) -> np.ndarray:
    """A (C,) vector shaped (1, C, 1, ...) to broadcast against an ndim-dimensional input."""
    return f64(v).reshape((1, -1) + (1,) * (ndim - 2))


def _stats(x: np.ndarray, running_mean, running_var, training: bool) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (biased) variance used to normalise: the batch's in training, else the running ones."""
    if training:
        axes = (0,) + tuple(range(2, x.ndim))
        if not x.size:  # no values: no statistics (and nothing to normalise)
            return np.zeros((1, x.shape[1]) + (1,) * (x.ndim - 2)), np.ones((1, x.shape[1]) + (1,) * (x.ndim - 2))
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
    count = elements(x.shape) // x.shape[1] if x.shape[1] else 0
    if training and count:  # an empty batch has no statistics: the running ones stay (as torch)
        _update_running(running_mean, running_var, mean, var, count, momentum)
    if not training:  # x * a + (bias - mean * a): the op's eval formula, whose infinities at var + eps = 0 are defined
        with np.errstate(divide="ignore", invalid="ignore"):
            a = (1.0 / np.sqrt(var + eps)) * (1.0 if weight is None else _per_channel(weight, x.ndim))
            return x * a + ((0.0 if bias is None else _per_channel(bias, x.ndim)) - mean * a)
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
    if training and x.size:  # mean and variance depend on x too
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


# --- fused_conv_bn_relu: relu(batch_norm(conv2d(x))), fused_conv_bn_add_relu: relu(... + residual)


def _conv_bn(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum,
             training) -> tuple[np.ndarray, np.ndarray]:
    """(z, y): the float64 convolution output z and its batch norm y (running statistics updated in
    place in training, when given)."""
    z = _conv_f64(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    return z, _bn(z, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)


def _conv_bn_grads(g_y: np.ndarray, z: np.ndarray, x, conv_weight, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation,
                   groups, eps, training) -> tuple:
    """(grad_x, grad_conv_weight, grad_conv_bias, grad_bn_weight, grad_bn_bias) from g_y, the
    gradient at the batch norm's output y = bn(z), each in its input's dtype."""
    g_z, grad_gamma, grad_beta = _bn_grads(g_y, z, running_mean, running_var, bn_weight, training, eps)
    grad_x, grad_w, grad_b = _conv_grads(g_z, f64(x), f64(conv_weight), stride, padding, dilation, groups)
    gamma_like, beta_like = _param_dtype(bn_weight, x), _param_dtype(bn_bias, x)
    return like(grad_x, x), like(grad_w, x), like(grad_b, x), like(grad_gamma, gamma_like), like(grad_beta, beta_like)


@reference("fused_conv_bn_relu", CONV_FOOTPRINT)
def fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    _, y = _conv_bn(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training)
    return like(np.maximum(y, 0.0), x)


@reference("fused_conv_bn_relu_backward", CONV_FOOTPRINT)
def fused_conv_bn_relu_backward(grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training):
    stats = (None, None) if training else (running_mean, running_var)  # training: leave them untouched
    z, y = _conv_bn(x, conv_weight, conv_bias, bn_weight, bn_bias, *stats, stride, padding, dilation, groups, eps, 0.0, training)
    g_y = f64(grad_out) * (y > 0)
    return _conv_bn_grads(g_y, z, x, conv_weight, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training)


@reference("fused_conv_bn_add_relu", CONV_FOOTPRINT)
def fused_conv_bn_add_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups, eps,
                           momentum, training):
    _, y = _conv_bn(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training)
    return like(np.maximum(y + f64(residual), 0.0), x)


@reference("fused_conv_bn_add_relu_backward", CONV_FOOTPRINT)
def fused_conv_bn_add_relu_backward(grad_out, out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation,
                                    groups, eps, training):
    """The ReLU passes grad_out where the forward's result is positive; that is grad_residual."""
    g_y = f64(grad_out) * (f64(out) > 0)
    z = _conv_f64(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    grads = _conv_bn_grads(g_y, z, x, conv_weight, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training)
    return (*grads, like(g_y, x))
