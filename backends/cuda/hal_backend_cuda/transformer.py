"""rotary_embedding and swiglu through torch's own kernels (the eager twins): the fallback of the
Triton kernels (hal.triton.kernels) for what they do not take (broadcasting SwiGLU inputs, rotary
inputs whose leading dimensions do not merge)."""

from __future__ import annotations

from hal.eager import transformer as eager

from ._common import FLOATS, kernel

for _op in ("rotary_embedding", "rotary_embedding_backward", "swiglu", "swiglu_backward"):
    kernel(_op, name="torch", priority=10, dtypes=FLOATS)(getattr(eager, _op))
