"""rotary_embedding and swiglu through torch's own kernels (the eager twins): the fallback of the
Triton kernels (hal_triton.kernels) for what they do not take (broadcasting SwiGLU inputs, rotary
inputs whose leading dimensions do not merge), and the rotary kernel of compiled graphs.

The swiglu forward (``F.silu(gate) * up``, which torch's autograd records) is above Triton's
(25 > 20) for inputs below 2**25 elements: there its host time decides, in steps that are
host-bound without graphs (forward + backward with autograd at (2, 64, 512) bf16 on the H200's host,
2026-12-01: 172.2 us as eager PyTorch runs it against 256.8 us through hal's Triton kernel and node,
benchmarks/host_training.py). From 2**25 elements on it declines inputs the Triton kernel takes and
that kernel runs: torch's five kernels (two forward, three backward) move 28 bytes an element in
bfloat16 against Triton's 16 (one pass each way), and 12 bytes at the H200's 4.25 TB/s are the 85 us
of host time at about 30 M elements. The two halves of a packed projection (``h.chunk(2, -1)``)
also save the backward's concatenation there, and torch's elementwise kernels on them run
unvectorised: the Mixtral-style MoE layer's SwiGLU, (8192, 14336) halves of (8192, 28672), took
1.76 ms of its 15.2 ms step on the H200 through torch's kernels and cat (2026-12-02, graph_ab.py).

In steps replayed from a CUDA graph (hal.graphs) the Triton kernel ranks first (graph priority 15
for torch's): no host time is paid there, and in the graphed Llama training step (8 layers, SwiGLU
(4096, 2816) bf16) Triton's one kernel each way with hal's node, which saves gate and up only, made
the step 11.14 -> 10.86 ms and its peak memory 4.30 -> 4.13 GiB (benchmarks/graph_ab.py on the H200,
2026-12-02), against torch's five kernels and the activation autograd saves."""

from __future__ import annotations

from hal.plugin import Inputs
from hal_torch import transformer as eager
from hal_triton.layouts import swiglu_geometry

from ._common import FLOATS, kernel

for _op in ("rotary_embedding_backward", "swiglu_backward"):
    kernel(_op, name="torch", priority=10, dtypes=FLOATS)(getattr(eager, _op))
# below the Triton kernel in eager calls; the kernel a torch.compile graph takes in (its ops, fused
# by Inductor with the projections around them) in place of the Triton kernel's opaque node
kernel("rotary_embedding", name="torch", priority=10, dtypes=FLOATS, differentiable=True)(eager.rotary_embedding)
#: from this many elements eager calls take the Triton kernel where it runs (module docstring)
TRITON_FROM = 1 << 25


def _small_or_beyond_triton(inputs: Inputs) -> list[str]:
    """Declines what the Triton kernel takes from TRITON_FROM elements on, except inside a
    torch.compile trace (:func:`hal.plugin.traced`), where Inductor fuses torch's ops into its own one pass.
    A check, not ``contexts=``: the kernel serves every context, and what it declines depends on the
    inputs' size; a trace inside ``hal.graphs.device_bound`` is a ``graph`` call that takes any size too."""
    gate, up = inputs["gate"], inputs["up"]
    if gate.numel() >= TRITON_FROM and not inputs.traced and swiglu_geometry(gate, up) is not None:
        return [f"{gate.numel()} elements (at least 2**25): the Triton kernel's one pass each way moves less memory "
                "than torch's five kernels, which outweighs its host time"]
    return []


kernel("swiglu", name="torch", contexts={"eager": 25, "training": 25, "compiled": 25, "graph": 15}, dtypes=FLOATS, differentiable=True,
       checks=(_small_or_beyond_triton,))(eager.swiglu)
# swiglu with its result's amax (hal.fp8's per-tensor cast of the down projection's input): below the
# Triton kernel, which reduces the amax as it writes y; torch's ops where the Triton kernel declines
# (broadcasting inputs) and, unmeasured, inside torch.compile graphs
kernel("swiglu_amax", name="torch", priority=10, dtypes=FLOATS, differentiable=True)(eager.swiglu_amax)
