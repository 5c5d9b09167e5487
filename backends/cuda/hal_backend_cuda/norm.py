"""layer_norm and rms_norm through torch's own CUDA kernels: for layer_norm the fallback of the
Triton row kernels (registered by hal_triton.kernels) where Triton is missing; for rms_norm also
the kernel of inputs small enough for the host to decide.

rms_norm's torch kernel is above Triton's (25 > 20) up to :data:`HOST_BOUND_ELEMENTS`, measured on
the H200 on 2026-12-01: at (2, 64, 256) bf16 a forward + backward with autograd cost 145.7 us of
host time through torch (one fused kernel each way, torch's C++ node) against 299.7 us through
hal's Triton kernels and node; on the device at (32768, 4096) Triton's take 134.8 + 319.3 us
against torch's 157.0 + 438.4 us (hal bench). The 140 us Triton saves there shrink with the size
while the host's cost does not: at 16M elements (32 MB of bf16) they are about 17 us, well below
the host difference, so torch's kernel runs up to that size and Triton's beyond it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal.plugin import Inputs
from hal_torch import norm as eager_norm

from ._common import FLOATS, kernel

HOST_BOUND_ELEMENTS = 1 << 24


def _host_bound(inputs: Inputs) -> list[str]:
    n = inputs["x"].numel()
    return [] if n <= HOST_BOUND_ELEMENTS else [f"{n} elements: above {HOST_BOUND_ELEMENTS}, Triton's kernel is faster on the device"]


@kernel("layer_norm", name="torch", priority=10, dtypes=FLOATS, differentiable=True)
def layer_norm_torch(x, normalized_shape, weight, bias, eps):
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


@kernel("rms_norm", name="torch", priority=25, dtypes=FLOATS, checks=[_host_bound], differentiable=True)
def rms_norm_torch(x, normalized_shape, weight, eps):
    return F.rms_norm(x, normalized_shape, weight, eps)


# rms_norm with its result's amax (hal.fp8's per-tensor cast of a norm's output): below the Triton
# kernel, which reduces the amax as it writes y (torch's ops read y again); the kernel a torch.compile
# graph takes in where nothing was measured (Inductor fuses its ops with their neighbours)
kernel("rms_norm_amax", name="torch", priority=10, dtypes=FLOATS, differentiable=True)(eager_norm.rms_norm_amax)


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
