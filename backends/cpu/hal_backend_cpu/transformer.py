"""rotary_embedding and swiglu on torch's CPU kernels (the eager twins: float32 arithmetic for
half-precision x, one rounding)."""

from __future__ import annotations

from hal.plugin import Inputs
from hal_torch import transformer as eager

from ._common import FLOATS, kernel


def _rotary_in_graphs(inputs: Inputs) -> list[str]:
    """rotary's eager calls stay with hal's node: its backward op is one rotation, where the recorded
    graph of the forward's upcasts, halves and products is slower (150 against 160 us,
    benchmarks/host_training.py on the CPU VM, float32 (2, 64, 512), 2026-12-01). Inside torch.compile
    graphs its ops join the graph: there an opaque node cost 438 us a forward + backward against 190
    for Inductor's code of the same ops (medians of 7 interleaved rounds, (2, 8, 4, 16) float32,
    2026-12-03); joined, 256 against 229."""
    return [] if inputs.traced else ["eagerly hal's node with its one-rotation backward is faster than torch's recorded ops"]


for _op in ("rotary_embedding_backward", "swiglu_backward"):
    kernel(_op, name="torch", priority=20, dtypes=FLOATS)(getattr(eager, _op))
kernel("rotary_embedding", name="torch", priority=20, dtypes=FLOATS, differentiable=_rotary_in_graphs)(eager.rotary_embedding)
# swiglu's forward is F.silu(gate) * up, which torch's autograd records: forward + backward 124 us
# against 375 us through hal's node and float32 backward op (benchmarks/host_training.py on the CPU
# VM, float32 (2, 64, 512), 2026-12-01).
kernel("swiglu", name="torch", priority=20, dtypes=FLOATS, differentiable=True)(eager.swiglu)
# swiglu with its result's amax (hal.fp8's per-tensor cast of the down projection's input): recorded as swiglu
kernel("swiglu_amax", name="torch", priority=20, dtypes=FLOATS, differentiable=True)(eager.swiglu_amax)
