"""The elementwise op: ``swiglu(gate, up) = silu(gate) * up``, broadcasting as torch does."""

from __future__ import annotations

import torch

from . import plugin
from ._precision import DTYPES, upcast


# `differentiable=True`: the kernel is made of torch's differentiable ops, so where a call needs
# autograd, torch records it and computes the gradient; no swiglu_backward kernel is needed.
@plugin.kernel("swiglu", name="torch_math", dtypes=DTYPES, differentiable=True)
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate * sigmoid(gate) * up`` in float32 (float64 for float64), rounded once."""
    g = upcast(gate)
    return (g * torch.sigmoid(g) * upcast(up)).to(gate.dtype)
