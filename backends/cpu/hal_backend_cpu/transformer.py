"""rotary_embedding and swiglu on torch's CPU kernels (the eager twins: float32 arithmetic for
half-precision x, one rounding)."""

from __future__ import annotations

from hal.eager import transformer as eager

from ._common import FLOATS, kernel

for _op in ("rotary_embedding", "rotary_embedding_backward", "swiglu", "swiglu_backward"):
    kernel(_op, name="torch", priority=20, dtypes=FLOATS)(getattr(eager, _op))
