"""layer_norm and rms_norm through torch's own CUDA kernels: the fallback of the Triton row
kernels (registered by hal.triton.kernels) where Triton is missing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import FLOATS, kernel


@kernel("layer_norm", name="torch", priority=10, dtypes=FLOATS, differentiable=True)
def layer_norm_torch(x, normalized_shape, weight, bias, eps):
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


@kernel("rms_norm", name="torch", priority=10, dtypes=FLOATS, differentiable=True)
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
