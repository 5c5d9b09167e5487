"""linear's pieces that backends and kits share: its gradients from the gradient of the
pre-activation, a product added into an accumulator through small temporaries, and the key of the
gradients a ``linear_cross_entropy`` forward keeps for its backward. Plain torch math on arrays a kernel already has; the GEMM is the caller's choice."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from hal.integration.kept import param_state


def grads_of_rows(gz: torch.Tensor, x2: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mask: Sequence[bool],
                  mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.mm) -> tuple:
    """linear's (grad_x, grad_weight, grad_bias) from the pre-activation's gradient ``gz`` (rows,
    out) and x as rows ``x2``: two GEMMs (``mm``, a backend's choice of GEMM) and a column sum, each
    only where ``mask`` asks (shared by the CPU backend and the Triton kit's kernels)."""
    want_x, want_w, want_b = mask
    return (
        mm(gz, weight).view(x.shape) if want_x else None,
        mm(gz.t(), x2) if want_w else None,
        gz.sum(0) if want_b else None,
    )


#: the largest temporary product (elements) :func:`add_product_in_slices` makes: linear_cross_entropy's
#: grad_weight accumulator is vocabulary x hidden in float32 (1 GiB at Llama-3's 128256 x 2048), and
#: a temporary of its size would raise a training step's peak memory by as much
SLICE_ELEMENTS = 1 << 24


def add_product_in_slices(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``acc += a @ b`` (``product``: the backend's GEMM with acc's dtype out) for a GEMM that cannot
    add in place: slice by slice of acc's rows, each temporary at most ``SLICE_ELEMENTS``; returns acc."""
    rows = max(1, SLICE_ELEMENTS // max(1, int(acc.shape[1])))
    for r in range(0, int(acc.shape[0]), rows):
        acc[r : r + rows].add_(product(a[r : r + rows], b))
    return acc


def kept_gradients_state(weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor], ignore_index: int,
                         label_smoothing: float, reduction: str) -> tuple:
    """What gradients a linear_cross_entropy forward keeps for its backward (:mod:`hal.integration.kept`, keyed
    by x) depend on besides x: the backends that keep them (the Triton kit, the CPU backend) key
    their entries on it."""
    return (param_state(weight, target, bias), ignore_index, label_smoothing, reduction)
