"""linear, matmul and grouped_gemm, and their gradients, in eager PyTorch."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .elementwise import ACTIVATION_FNS, detached, filled_leaf, leaf, masked_grads


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> torch.Tensor:
    return ACTIVATION_FNS[act](F.linear(x, weight, bias))


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


# --- torch._grouped_mm: torch's own grouped GEMM (CUTLASS on sm_90), offsets on the device ----------


def grouped_mm_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """The end row of each group as int32, as torch._grouped_mm takes them (one device kernel)."""
    return group_sizes.cumsum(0, dtype=torch.int32)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """grouped_gemm through torch._grouped_mm: (rows, K) x (G, K, N) with the groups' end rows."""
    return torch._grouped_mm(x, weight, offs=grouped_mm_offsets(group_sizes))


def grouped_mm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> tuple:
    """(grad_x, grad_weight) through torch._grouped_mm: grad_x = grad_out[g] @ weight[g]^T per group
    (2-d by 3-d), grad_weight[g] = x[g]^T @ grad_out[g] (2-d by 2-d, the groups along the shared rows)."""
    offs = grouped_mm_offsets(group_sizes)
    return (torch._grouped_mm(grad_out, weight.transpose(1, 2), offs=offs),
            torch._grouped_mm(x.t(), grad_out, offs=offs))


def grouped_mm_layout(name: str, t: torch.Tensor) -> list[str]:
    """Why torch._grouped_mm would refuse ``t`` as an operand (its stride rules): the last two
    dimensions row- or column-major with the leading stride a multiple of 16 bytes, the start and
    any batch stride 16-byte aligned."""
    item = t.element_size()
    *batch, rows, cols = t.shape
    *batch_strides, s_rows, s_cols = t.stride()
    row_major = s_cols == 1 and s_rows >= max(1, cols) and s_rows * item % 16 == 0
    col_major = s_rows == 1 and s_cols >= max(1, rows) and s_cols * item % 16 == 0
    reasons = []
    if not (row_major or col_major):
        reasons.append(f"{name} {tuple(t.shape)} with strides {tuple(t.stride())}: torch._grouped_mm needs its last two "
                       "dimensions row- or column-major with the leading stride a multiple of 16 bytes")
    if t.data_ptr() % 16 or any(s * item % 16 for s in batch_strides):
        reasons.append(f"{name} does not start on a 16-byte boundary or its batch stride is not a multiple of 16 bytes")
    return reasons


__all__ = ["linear", "linear_backward", "matmul", "matmul_backward", "grouped_gemm", "grouped_gemm_backward"]
