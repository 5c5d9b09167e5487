"""linear, matmul and grouped_gemm, and their gradients, in eager PyTorch."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .elementwise import ACTIVATION_FNS, filled_leaf, leaf


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> torch.Tensor:
    return ACTIVATION_FNS[act](F.linear(x, weight, bias))


def linear_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> tuple:
    """(grad_x, grad_weight, grad_bias) by autograd; a missing bias is a zero bias, so grad_bias exists."""
    with torch.enable_grad():
        b = leaf(bias) if bias is not None else filled_leaf(weight.shape[0], 0.0, x)
        xg, wg = leaf(x), leaf(weight)
        return torch.autograd.grad(linear(xg, wg, b, act), (xg, wg, b), grad_out)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def matmul_backward(grad_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple:
    with torch.enable_grad():
        ag, bg = leaf(a), leaf(b)
        return torch.autograd.grad(torch.matmul(ag, bg), (ag, bg), grad_out)


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """One matmul per group, as an MoE layer without a fused kernel runs its experts."""
    parts = torch.split(x, [int(s) for s in group_sizes.tolist()])
    products = [rows @ weight[g] for g, rows in enumerate(parts)]
    return torch.cat(products) if products else torch.einsum("mk,gkn->mn", x, weight)  # no groups: a sum over none


def grouped_gemm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> tuple:
    with torch.enable_grad():
        xg, wg = leaf(x), leaf(weight)
        return torch.autograd.grad(grouped_gemm(xg, wg, group_sizes), (xg, wg), grad_out)


__all__ = ["linear", "linear_backward", "matmul", "matmul_backward", "grouped_gemm", "grouped_gemm_backward"]
