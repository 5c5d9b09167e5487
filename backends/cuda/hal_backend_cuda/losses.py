"""cross_entropy and linear_cross_entropy through torch's own kernels (the eager twins: F.cross_entropy
on float32 logits): the fallback of the Triton kernels (hal_triton.kernels) where Triton is missing.
linear_cross_entropy's fallback holds the whole logits, as eager PyTorch does: where Triton is
installed it takes an eager call only if the blocked kernel would hold them as one block anyway
(:func:`_one_block`); inside torch.compile graphs, where those logits fit, its ops join the graph
(Inductor's LM head and loss) in place of the Triton kit's opaque blocked kernel."""

from __future__ import annotations

import importlib.util

from hal.plugin import Inputs
from hal_torch import loss as eager
from hal_triton.kernels import LCE_BLOCK_ELEMENTS

from ._common import FLOATS, kernel, not_float32

#: whether the Triton kit's blocked kernels can run here (the torch kernel is their fallback)
_TRITON = importlib.util.find_spec("triton") is not None


def _in_graphs(inputs: Inputs) -> list[str]:
    return eager.whole_logits_in_graphs(inputs) or not_float32(inputs)


def _one_block(inputs: Inputs) -> list[str]:
    """The op's contract, no whole logits, for eager calls where the blocked kernel can run: on an
    H100 the measured choice gave this kernel a Llama-3 LM head (4096 x 128256 logits) in an eager
    call, 5.37 GiB above its inputs and 24.9 ms forward + backward (its backward computes the logits
    again) against eager PyTorch's 17.2 (benchmarks/results/h100-2026-12-07-twentyfirst.md)."""
    if inputs.traced or not _TRITON:
        return []
    rows, classes = inputs["x"].shape[0], inputs["weight"].shape[0]
    if rows * classes > LCE_BLOCK_ELEMENTS:
        return [f"would hold the whole logits ({rows} x {classes}) in an eager call, more than one block of the blocked "
                f"kernel ({LCE_BLOCK_ELEMENTS} logits), which runs it"]
    return []


for _op in ("cross_entropy", "cross_entropy_backward"):
    kernel(_op, name="torch", priority=10, dtypes=FLOATS)(getattr(eager, _op))
kernel("linear_cross_entropy", name="torch", priority=10, dtypes=FLOATS, checks=[_one_block],
       differentiable=_in_graphs)(eager.linear_cross_entropy)
kernel("linear_cross_entropy_backward", name="torch", priority=10, dtypes=FLOATS, checks=[_one_block])(eager.linear_cross_entropy_backward)
