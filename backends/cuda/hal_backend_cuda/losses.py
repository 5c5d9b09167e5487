"""cross_entropy and linear_cross_entropy through torch's own kernels (the eager twins: F.cross_entropy
on float32 logits): the fallback of the Triton kernels (hal_triton.kernels) where Triton is missing.
linear_cross_entropy's fallback holds the whole logits, as eager PyTorch does."""

from __future__ import annotations

from hal_backend_eager import loss as eager

from ._common import FLOATS, kernel

for _op in ("cross_entropy", "cross_entropy_backward", "linear_cross_entropy", "linear_cross_entropy_backward"):
    kernel(_op, name="torch", priority=10, dtypes=FLOATS)(getattr(eager, _op))
