"""Tensors whose elements may share memory (``as_strided`` views whose rows overlap, ``expand``-ed
dimensions), and dense copies of them for torch kernels that misread such inputs.

torch 2.13's fused flash-attention CPU kernel (behind ``F.scaled_dot_product_attention``) returns
garbage for a query whose batch or head stride overlaps its feature dimension (a query of shape
(2, 2, 16, 8) with strides (0, 1, 1, 1) gave errors of 1e37 against the same values made
contiguous); the kernels that hand queries, keys and values to it copy such inputs first.
"""

from __future__ import annotations

import torch


def may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory, from its shape and strides alone (no data is
    read): dimensions of more than one element sorted by stride must each step past everything the
    smaller ones span. True is conservative: a few interleaved layouts that do not overlap answer it
    too (a copy of them is merely unneeded)."""
    if t.is_contiguous():
        return False
    span = 1  # elements covered by the dimensions seen so far, from the first one
    for stride, size in sorted((abs(st), sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride < span:
            return True
        span += (size - 1) * stride
    return False


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a contiguous copy where its elements may share memory."""
    return t.contiguous() if may_overlap(t) else t
