"""The reduction: ``softmax(x, dim)``, the exponentials of x normalised to sum to 1 along ``dim``."""

from __future__ import annotations

import torch

from . import plugin
from ._precision import DTYPES, upcast


# hal hands the kernel dim >= 0, checked against x's rank (0 for a 0-d x, where torch's reductions
# take dim 0 too). Like swiglu, it is made of torch's differentiable ops.
@plugin.kernel("softmax", name="torch_math", dtypes=DTYPES, differentiable=True)
def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``exp(x - max) / sum(exp(x - max))`` along ``dim``: subtracting the maximum keeps exp from
    overflowing and does not change the result. NaN and infinities propagate as in ``F.softmax``."""
    xf = upcast(x)
    e = torch.exp(xf - xf.amax(dim=dim, keepdim=True))
    return (e / e.sum(dim=dim, keepdim=True)).to(x.dtype)
