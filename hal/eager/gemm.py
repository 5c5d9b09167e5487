"""linear, matmul and grouped_gemm, and their gradients, in eager PyTorch."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .elementwise import ACTIVATION_FNS, detached, filled_leaf, leaf, masked_grads


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> torch.Tensor:
    return ACTIVATION_FNS[act](F.linear(x, weight, bias))


def grads_of_rows(gz: torch.Tensor, x2: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mask: Sequence[bool]) -> tuple:
    """linear's (grad_x, grad_weight, grad_bias) from the pre-activation's gradient ``gz`` (rows,
    out) and x as rows ``x2``: two GEMMs and a column sum, each only where ``mask`` asks (shared by
    the CPU backend and the Triton kit's kernels)."""
    want_x, want_w, want_b = mask
    return (
        (gz @ weight).view(x.shape) if want_x else None,
        gz.t() @ x2 if want_w else None,
        gz.sum(0) if want_b else None,
    )


def linear_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str,
    output_mask: Sequence[bool] = (True, True, True),
) -> tuple:
    """(grad_x, grad_weight, grad_bias) by autograd; a missing bias is a zero bias, so grad_bias
    exists; None where ``output_mask`` is False."""
    want_x, want_w, want_b = output_mask
    with torch.enable_grad():
        if want_b:
            b = leaf(bias) if bias is not None else filled_leaf(weight.shape[0], 0.0, x)
        else:
            b = None if bias is None else detached(bias)
        xg = leaf(x) if want_x else detached(x)
        wg = leaf(weight) if want_w else detached(weight)
        return masked_grads(lambda: linear(xg, wg, b, act), (xg, wg, b), output_mask, grad_out)


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
