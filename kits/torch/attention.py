"""Softmax and scaled dot-product attention in eager PyTorch: F.softmax and torch's own softmax
backward, F.scaled_dot_product_attention without dropout and its gradients by autograd."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .overlap import dense


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return F.softmax(x, dim)


def softmax_backward(grad_out: torch.Tensor, out: torch.Tensor, dim: int) -> torch.Tensor:
    return torch._softmax_backward_data(grad_out, out, dim, out.dtype)


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    if attn_mask is not None and attn_mask.ndim == 1:
        attn_mask = attn_mask[None]  # torch 2.13's fused CPU kernel rejects a 1-D (keys) mask
    # a query whose rows share memory is copied: torch's flash CPU kernel misreads it (.overlap)
    return F.scaled_dot_product_attention(dense(q), k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale)


def scaled_dot_product_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
        out = scaled_dot_product_attention(*leaves, attn_mask, is_causal, scale)
        return torch.autograd.grad(out, leaves, grad_out)


__all__ = ["softmax", "softmax_backward", "scaled_dot_product_attention", "scaled_dot_product_attention_backward"]
