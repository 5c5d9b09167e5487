"""layer_norm and rms_norm in eager PyTorch (F.layer_norm, F.rms_norm), gradients by autograd."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def layer_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
) -> torch.Tensor:
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


def rms_norm(x: torch.Tensor, normalized_shape: tuple[int, ...], weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return F.rms_norm(x, normalized_shape, weight, eps)


def amax_of(y: torch.Tensor) -> torch.Tensor:
    """max |float32(y)| as a 0-d float32 without gradient (NaN propagates; 0 for an empty y): the
    max in y's dtype, then rounded (rounding is monotone, so that is the max of the rounded values)."""
    a = y.detach().abs()
    return (a.amax() if a.numel() else a.new_zeros(())).float()


def rms_norm_amax(x: torch.Tensor, normalized_shape: tuple[int, ...], weight: Optional[torch.Tensor], eps: float) -> tuple:
    """F.rms_norm and the amax of its result (a second pass over y here: eager torch has no norm
    that reduces; torch.compile fuses the two)."""
    y = F.rms_norm(x, normalized_shape, weight, eps)
    return y, amax_of(y)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _affine(x: torch.Tensor, normalized_shape: tuple[int, ...], weight: Optional[torch.Tensor]) -> torch.Tensor:
    """A leaf weight to differentiate against: ``weight``, or ones (the same forward) when None,
    since the backward ops return grad_weight whether or not the forward had a weight."""
    if weight is None:
        return torch.ones(normalized_shape, dtype=x.dtype, device=x.device, requires_grad=True)
    return _leaf(weight)


def layer_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: Optional[torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        xl, w = _leaf(x), _affine(x, normalized_shape, weight)
        b = torch.zeros_like(w, requires_grad=True)
        y = F.layer_norm(xl, normalized_shape, w, b, eps)
        return torch.autograd.grad(y, (xl, w, b), grad_out)


def rms_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: Optional[torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        xl, w = _leaf(x), _affine(x, normalized_shape, weight)
        y = F.rms_norm(xl, normalized_shape, w, eps)
        return torch.autograd.grad(y, (xl, w), grad_out)


__all__ = ["layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward", "rms_norm_amax"]
