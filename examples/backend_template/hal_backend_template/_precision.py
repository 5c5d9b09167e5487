"""The precision the kernels compute in: float32 for the half-precision types and float32 itself,
float64 for float64, as torch's own CPU kernels do (its "opmath" type). Each kernel upcasts its
inputs once, computes, and rounds its result once to the input's dtype."""

from __future__ import annotations

import torch

#: the dtypes the kernels serve: every floating dtype the ops declare (a kernel may list fewer; hal
#: then declines it for the others, saying so, and picks another backend's kernel)
DTYPES = ("float16", "bfloat16", "float32", "float64")


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype to compute ``t``'s op in."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its compute dtype (``t`` itself where it already is)."""
    return t.to(compute_dtype(t))
