"""The precision the kernels compute in, torch's "opmath" type: float32 for float16, bfloat16 and
float32, float64 for float64. Each kernel upcasts its inputs once, computes, and rounds its result
once to the input's dtype, as torch's own CPU kernels do."""

from __future__ import annotations

import torch

#: the dtypes the kernels serve: every floating dtype the ops declare (a kernel may list fewer; hal
#: then declines it for the others, saying which dtypes it supports)
DTYPES = ("float16", "bfloat16", "float32", "float64")


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype to compute with (``t`` itself where it already is)."""
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)
