"""layer_norm and rms_norm, forward and backward: torch's native CPU kernels, and numba row kernels
for RMS norm (torch 2.13 has no CPU RMS-norm kernel: F.rms_norm decomposes into several passes and
its backward into an autograd graph of them)."""

from __future__ import annotations

import numpy as np
import torch

from hal.plugin_sdk.kept import KeptForBackward, armed
from hal_torch import norm as eager

from . import _numba
from ._common import FLOATS, contiguous, kernel, numba_kernel, numel


def _rows(x: np.ndarray, normalized_shape: tuple[int, ...]) -> np.ndarray:
    return x.reshape(-1, numel(normalized_shape))


def _weight64(weight, normalized_shape) -> tuple[np.ndarray, bool]:
    """The weight as the numba kernels read it: a float32 or float64 weight as it is (they multiply in
    float64, each float32 value widened exactly: the results of a float64 copy, without making one,
    0.8 us a call on the project's VM), anything else (float16, the other byte order) as a float64
    copy; ones where there is none."""
    n = numel(normalized_shape)
    if weight is None:
        return np.ones(n), False
    if weight.dtype in _NATIVE_FLOATS:
        return weight.reshape(n), True
    return np.ascontiguousarray(weight, dtype=np.float64).reshape(n), True


_NATIVE_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


@numba_kernel("rms_norm", priority=30, checks=[contiguous("x")])
def rms_norm_numba(x, normalized_shape, weight, eps):
    w, has_w = _weight64(weight, normalized_shape)
    out = np.empty_like(x)
    _numba.family("norm").rms_forward(_rows(x, normalized_shape), w, has_w, float(eps), _rows(out, normalized_shape))
    return out


@numba_kernel("rms_norm_amax", priority=30, checks=[contiguous("x")])
def rms_norm_amax_numba(x, normalized_shape, weight, eps):
    """rms_norm's numba kernel (the same y), and max |float32(y)| (NaN propagates; 0 for an empty y)."""
    y = rms_norm_numba(x, normalized_shape, weight, eps)
    return y, np.array(np.max(np.abs(y.astype(np.float32)), initial=np.float32(0)), dtype=np.float32)


#: row blocks of the backward (each sums its own grad_weight partial): a few per thread
BACKWARD_BLOCKS = 64


@numba_kernel("rms_norm_backward", priority=30, checks=[contiguous("x", "grad_out")])
def rms_norm_backward_numba(grad_out, x, normalized_shape, weight, eps):
    w, has_w = _weight64(weight, normalized_shape)
    x2 = _rows(x, normalized_shape)
    gx = np.empty_like(x)
    nb = _numba.family("norm")
    # a call its rows run serially for sums its weight gradient in one block: no partials to add up
    # (numpy's sum over them cost 2.5 us of a 8.7 us call at (32, 64) on the project's VM)
    blocks = 1 if x2.size <= nb.SERIAL_ELEMENTS else max(1, min(BACKWARD_BLOCKS, x2.shape[0]))
    partial = np.empty((blocks, x2.shape[1]))
    nb.rms_backward(_rows(grad_out, normalized_shape), x2, w, has_w, float(eps), _rows(gx, normalized_shape), partial)
    gw = (partial[0] if blocks == 1 else partial.sum(0)).astype(x.dtype if weight is None else weight.dtype).reshape(normalized_shape)
    return gx, gw

kernel("rms_norm", name="torch", priority=20, dtypes=FLOATS, differentiable=True)(eager.rms_norm)
# rms_norm with its result's amax (hal.fp8's per-tensor cast of a norm's output): torch's ops, recorded
kernel("rms_norm_amax", name="torch", priority=20, dtypes=FLOATS, differentiable=True)(eager.rms_norm_amax)

#: (mean, 1/std) of float32 and float64 layer-norm forwards, for the backward of the same x (hal.integration.kept)
KEPT = KeptForBackward()
_KEEPS = (torch.float32, torch.float64)


@kernel("layer_norm", name="torch", priority=20, dtypes=FLOATS, differentiable=True)
def layer_norm(x, normalized_shape, weight, bias, eps):
    """torch's layer-norm kernel; in float32 and float64, where hal's autograd node runs it, its
    statistics are kept for the backward op of this x (half precision: the backward recomputes them
    in float32, see below). Elsewhere (no autograd, or torch's recording the call) F.layer_norm:
    through ``torch.ops.aten`` the statistics cost 3 us of host time more."""
    if x.dtype not in _KEEPS or not armed():
        return eager.layer_norm(x, normalized_shape, weight, bias, eps)
    out, mean, rstd = torch.ops.aten.native_layer_norm(x, list(normalized_shape), weight, bias, eps)
    KEPT.keep(x, eps, (mean, rstd), out)
    return out


@kernel("layer_norm_backward", name="torch", priority=20, dtypes=FLOATS)
def layer_norm_backward(grad_out, x, normalized_shape, weight, eps):
    """torch's layer-norm backward kernel, with the statistics its forward kept for this x or from
    its forward kernel run again; half precision runs in float32 (torch's half-precision backward
    loses the parameter gradients of data with a large mean) and rounds once."""
    dtype = x.dtype
    kept = KEPT.take(x, eps) if dtype in _KEEPS else None
    if dtype in (torch.float16, torch.bfloat16):
        grad_out, x, weight = grad_out.float(), x.float(), None if weight is None else weight.float()
    shape = list(normalized_shape)
    w = weight if weight is not None else x.new_ones(normalized_shape)
    mean, rstd = kept if kept is not None else torch.ops.aten.native_layer_norm(x, shape, w, None, eps)[1:]
    grads = torch.ops.aten.native_layer_norm_backward(grad_out, x, shape, mean, rstd, w, w, [True, True, True])
    return tuple(g.to(dtype) for g in grads)


@kernel("rms_norm_backward", name="torch", priority=20, dtypes=FLOATS)
def rms_norm_backward(grad_out, x, normalized_shape, weight, eps):
    """The gradient formula in torch ops, over rows of the normalised size, in float32 (float64
    for float64): with r = 1 / sqrt(mean(x^2) + eps), xhat = x r and h = grad_out * weight,
    grad_x = r (h - xhat mean(h xhat)) and grad_weight = sum over rows of grad_out xhat."""
    n = numel(normalized_shape)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    x2 = x.reshape(-1, n).to(acc)
    g2 = grad_out.reshape(-1, n).to(acc)
    r = torch.rsqrt(x2.square().mean(-1, keepdim=True) + eps)
    xhat = x2 * r
    h = g2 if weight is None else g2 * weight.reshape(n).to(acc)
    gx = r * (h - xhat * (h * xhat).mean(-1, keepdim=True))
    gw = (g2 * xhat).sum(0)
    return gx.to(x.dtype).view(x.shape), gw.to(x.dtype if weight is None else weight.dtype).view(normalized_shape)
