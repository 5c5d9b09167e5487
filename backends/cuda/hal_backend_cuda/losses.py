"""cross_entropy and linear_cross_entropy through torch's own kernels (the eager twins: F.cross_entropy
on float32 logits): the fallback of the Triton kernels (hal_triton.kernels) where Triton is missing.
linear_cross_entropy's fallback holds the whole logits, as eager PyTorch does; inside torch.compile
graphs, where those logits fit, its ops join the graph (Inductor's LM head and loss) in place of the
Triton kit's opaque blocked kernel."""

from __future__ import annotations

from hal.plugin import Inputs
from hal_backend_eager import loss as eager

from ._common import FLOATS, kernel, not_float32


def _in_graphs(inputs: Inputs) -> list[str]:
    return eager.whole_logits_in_graphs(inputs) or not_float32(inputs)


for _op in ("cross_entropy", "cross_entropy_backward", "linear_cross_entropy", "linear_cross_entropy_backward"):
    kernel(_op, name="torch", priority=10, dtypes=FLOATS, differentiable=_in_graphs if _op == "linear_cross_entropy" else False)(getattr(eager, _op))
