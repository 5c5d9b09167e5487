"""rotary_embedding and swiglu through torch's own kernels (the eager twins): the fallback of the
Triton kernels (hal.triton.kernels) for what they do not take (broadcasting SwiGLU inputs, rotary
inputs whose leading dimensions do not merge), and the rotary kernel of compiled graphs.

The swiglu forward (``F.silu(gate) * up``, which torch's autograd records) is above Triton's
(25 > 20): measured on the H200 on 2026-12-01 it is faster on the host (forward + backward with
autograd at (2, 64, 512) bf16: 172.2 us as eager PyTorch runs it against 256.8 us through hal's
Triton kernel and node, benchmarks/host_training.py) and on the device (323.5 against 421.9 us
forward at (16384, 8192), and torch's recorded backward 566.8 against Triton's 906.3 us, hal bench:
the Triton kernels reach 35-45% of the copy bandwidth, a known miss of issue 13).

In steps replayed from a CUDA graph (hal.graphs) the Triton kernel ranks first (graph priority 15
for torch's): no host time is paid there, and in the graphed Llama training step (8 layers, SwiGLU
(4096, 2816) bf16) Triton's one kernel each way with hal's node, which saves gate and up only, made
the step 11.14 -> 10.86 ms and its peak memory 4.30 -> 4.13 GiB (benchmarks/graph_ab.py on the H200,
2026-12-02), against torch's five kernels and the activation autograd saves. At (16384, 8192)
alone torch's kernels remain faster on the device (above)."""

from __future__ import annotations

from hal.eager import transformer as eager

from ._common import FLOATS, kernel

for _op in ("rotary_embedding_backward", "swiglu_backward"):
    kernel(_op, name="torch", priority=10, dtypes=FLOATS)(getattr(eager, _op))
# below the Triton kernel in eager calls; the kernel a torch.compile graph takes in (its ops, fused
# by Inductor with the projections around them) in place of the Triton kernel's opaque node
kernel("rotary_embedding", name="torch", priority=10, dtypes=FLOATS, differentiable=True)(eager.rotary_embedding)
kernel("swiglu", name="torch", priority=25, graph_priority=15, dtypes=FLOATS, differentiable=True)(eager.swiglu)
