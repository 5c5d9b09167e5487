"""The op with a backward: ``rms_norm`` over the trailing ``normalized_shape`` dimensions, and
``rms_norm_backward``, the kernel hal's autograd node dispatches for its gradients.

With ``r = 1 / sqrt(mean(x^2) + eps)`` over the normalised dimensions (n elements) and
``xhat = x * r``, the forward is ``y = xhat * weight`` and the gradients are

    grad_weight = sum over the leading dimensions of grad_out * xhat
    grad_x      = r * (g - xhat * mean(g * xhat)),   g = grad_out * weight

(differentiating r through mean(x^2) gives the second term). A missing weight is a weight of ones;
grad_weight is returned whether or not the forward had one, as the op declares.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import plugin
from ._precision import DTYPES, upcast


def _normalised(x: torch.Tensor, dims: tuple[int, ...], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xhat, r)`` of x upcast to its compute dtype, r keeping the reduced dimensions."""
    xf = upcast(x)
    r = torch.rsqrt(xf.square().mean(dim=dims, keepdim=True) + eps)
    return xf * r, r


def _trailing(x: torch.Tensor, normalized_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dimensions of x that normalized_shape covers (hal has checked that they match)."""
    return tuple(range(x.ndim - len(normalized_shape), x.ndim))


# hal hands the kernel normalized_shape as a tuple and eps as a float (None resolved to torch's
# default); it has checked that weight, when given, has shape normalized_shape and x's dtype.
@plugin.kernel("rms_norm", name="torch_math", dtypes=DTYPES)
def rms_norm(x: torch.Tensor, normalized_shape: tuple[int, ...], weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` in float32 (float64 for float64), rounded once."""
    xhat, _ = _normalised(x, _trailing(x, normalized_shape), eps)
    y = xhat if weight is None else xhat * upcast(weight)
    return y.to(x.dtype)


@plugin.kernel("rms_norm_backward", name="torch_math", dtypes=DTYPES)
def rms_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: Optional[torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight)``: grad_x of x's shape and dtype, grad_weight of shape
    normalized_shape in the weight's dtype (x's where there is no weight)."""
    dims = _trailing(x, normalized_shape)
    xhat, r = _normalised(x, dims, eps)
    go = upcast(grad_out)
    g = go if weight is None else go * upcast(weight)
    grad_x = r * (g - xhat * (g * xhat).mean(dim=dims, keepdim=True))
    leading = tuple(range(x.ndim - len(normalized_shape)))
    grad_weight = (go * xhat).sum(dim=leading) if leading else go * xhat
    return grad_x.to(x.dtype), grad_weight.to(x.dtype)
