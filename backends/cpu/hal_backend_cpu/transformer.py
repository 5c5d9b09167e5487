"""rotary_embedding and swiglu on torch's CPU kernels (the eager twins: float32 arithmetic for
half-precision x, one rounding)."""

from __future__ import annotations

from hal_backend_eager import transformer as eager

from ._common import FLOATS, kernel

for _op in ("rotary_embedding", "rotary_embedding_backward", "swiglu_backward"):
    kernel(_op, name="torch", priority=20, dtypes=FLOATS)(getattr(eager, _op))
# swiglu's forward is F.silu(gate) * up, which torch's autograd records: forward + backward 124 us
# against 375 us through hal's node and float32 backward op (benchmarks/host_training.py on the CPU
# VM, float32 (2, 64, 512), 2026-12-01). rotary's stays with hal's node: its backward op is one
# rotation, where the recorded graph of the forward's upcasts, halves and products is slower
# (150 against 160 us there).
kernel("swiglu", name="torch", priority=20, dtypes=FLOATS, differentiable=True)(eager.swiglu)
