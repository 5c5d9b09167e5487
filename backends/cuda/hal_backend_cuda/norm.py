"""layer_norm and rms_norm, forward and backward: Triton row kernels (see hal.triton.norm), with
torch's own kernels as the fallback where Triton is missing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import launch
from ._common import FLOATS, family, kernel, numel


def _forward(x, n, weight, bias, eps, rms):
    return family("norm").norm_forward(x, n, weight, bias, eps, rms, **launch.rows(x, n))


def _backward(grad_out, x, n, weight, eps, rms):
    return family("norm").norm_backward(grad_out, x, n, weight, eps, rms, programs=launch.persistent_programs(x), **launch.rows(x, n))


@kernel("layer_norm", name="triton", priority=20, dtypes=FLOATS, triton=True)
def layer_norm(x, normalized_shape, weight, bias, eps):
    return _forward(x, numel(normalized_shape), weight, bias, eps, False)


@kernel("layer_norm_backward", name="triton", priority=20, dtypes=FLOATS, triton=True)
def layer_norm_backward(grad_out, x, normalized_shape, weight, eps):
    dx, dw, db = _backward(grad_out, x, numel(normalized_shape), weight, eps, False)
    return dx, dw.view(normalized_shape), db.view(normalized_shape)


@kernel("rms_norm", name="triton", priority=20, dtypes=FLOATS, triton=True)
def rms_norm(x, normalized_shape, weight, eps):
    return _forward(x, numel(normalized_shape), weight, None, eps, True)


@kernel("rms_norm_backward", name="triton", priority=20, dtypes=FLOATS, triton=True)
def rms_norm_backward(grad_out, x, normalized_shape, weight, eps):
    dx, dw, _ = _backward(grad_out, x, numel(normalized_shape), weight, eps, True)
    return dx, dw.view(normalized_shape)


@kernel("layer_norm", name="torch", priority=10, dtypes=FLOATS)
def layer_norm_torch(x, normalized_shape, weight, bias, eps):
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


@kernel("rms_norm", name="torch", priority=10, dtypes=FLOATS)
def rms_norm_torch(x, normalized_shape, weight, eps):
    return F.rms_norm(x, normalized_shape, weight, eps)


@kernel("layer_norm_backward", name="torch", priority=10, dtypes=FLOATS)
def layer_norm_backward_torch(grad_out, x, normalized_shape, weight, eps):
    """aten.native_layer_norm_backward with the statistics from a forward run."""
    w = weight if weight is not None else x.new_ones(normalized_shape)
    b = torch.zeros_like(w)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, list(normalized_shape), w, b, eps)
    return torch.ops.aten.native_layer_norm_backward(grad_out, x, list(normalized_shape), mean, rstd, w, b, [True, True, True])


@kernel("rms_norm_backward", name="torch", priority=10, dtypes=FLOATS)
def rms_norm_backward_torch(grad_out, x, normalized_shape, weight, eps):
    """Autograd through F.rms_norm (torch has no public rms_norm backward kernel)."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        w = (weight if weight is not None else x.new_ones(normalized_shape)).detach().requires_grad_(True)
        return torch.autograd.grad(F.rms_norm(xg, normalized_shape, w, eps), (xg, w), grad_out)
