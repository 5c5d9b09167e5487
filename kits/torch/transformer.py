"""rotary_embedding and swiglu, and their gradients, in eager PyTorch (as a Llama model writes them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import amax_of


def _compute(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Each pair (x1, x2) turned by the angle of (cos, sin), in float32 (float64), rounded once."""
    acc = _compute(x)
    xf, c, s = x.to(acc), cos.to(acc), sin.to(acc)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate(x, cos, sin, interleaved)


def rotary_embedding_backward(grad_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The adjoint of a rotation: the rotation by the opposite angle."""
    return _rotate(grad_out, cos, -sin, interleaved)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_amax(gate: torch.Tensor, up: torch.Tensor) -> tuple:
    """F.silu(gate) * up and the amax of its result (see hal_torch.norm.amax_of)."""
    y = F.silu(gate) * up
    return y, amax_of(y)


def swiglu_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple:
    """d silu(g)/dg = s (1 + g (1 - s)), s = sigmoid(g), in float32 (float64), summed back over
    broadcast dimensions before the one rounding (no autograd graph: it also runs where autograd is
    off, inside torch.ops.hal operators)."""
    acc = _compute(gate)
    g, u, go = gate.to(acc), up.to(acc), grad_out.to(acc)
    s = torch.sigmoid(g)
    grad_gate = (go * u * s * (1.0 + g * (1.0 - s))).sum_to_size(gate.shape)
    grad_up = (go * g * s).sum_to_size(up.shape)
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


__all__ = ["rotary_embedding", "rotary_embedding_backward", "swiglu", "swiglu_backward", "swiglu_amax"]
