"""cross_entropy and linear_cross_entropy, and their gradients, in eager PyTorch: F.cross_entropy
on float32 logits (float64 for float64), as LLM training code upcasts them; the LM head's logits
are held whole here (that is the eager baseline a fused kernel is measured against)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hal.plugin import Inputs

from .elementwise import filled_leaf, leaf


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str) -> torch.Tensor:
    return F.cross_entropy(logits.to(_acc(logits)), target.long(), ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)


def cross_entropy_backward(grad_out: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                           label_smoothing: float, reduction: str) -> torch.Tensor:
    with torch.enable_grad():
        z = leaf(logits)
        (g,) = torch.autograd.grad(cross_entropy(z, target, ignore_index, label_smoothing, reduction), (z,), grad_out)
    return g


#: the most logits (rows x classes) a torch.compile graph may hold whole for linear_cross_entropy: 2^30
#: (2 GiB in bfloat16, a 128k vocabulary over 8k tokens); beyond it hal's blocked kernels run the call.
#: At 2^28 a Llama-3.2-1B step (4096 tokens, vocabulary 128256) ran the opaque blocked kernel, 24.9 ms
#: forward + backward on an H100 where Inductor's LM head and loss took 10.1 ms holding 0.98 GiB
#: (benchmarks/levers40.py, 2026-12-07)
GRAPH_LOGITS_LIMIT = 1 << 30


def whole_logits_in_graphs(inputs: Inputs) -> list[str]:
    """Where a backend's kernel of torch's ops for linear_cross_entropy may run a call: inside
    torch.compile graphs only, and only while the whole logits fit GRAPH_LOGITS_LIMIT. There Inductor
    generates the LM head and its loss with the step's other code (on the H200 its Llama LM head and
    loss took 1.4 ms where hal's blocked kernel, an opaque node, took 2.4); an eager call keeps
    hal's blocked kernels, which never hold the whole logits."""
    if not inputs.traced:
        return ["holds the whole logits: only inside torch.compile graphs, where Inductor fuses it (eager calls take the blocked kernels)"]
    rows, classes = inputs["x"].shape[0], inputs["weight"].shape[0]
    if rows * classes > GRAPH_LOGITS_LIMIT:  # symbolic sizes guard on the comparison, not on their values
        return [f"the whole logits ({rows} x {classes}) exceed {GRAPH_LOGITS_LIMIT} elements (hal_torch.loss.GRAPH_LOGITS_LIMIT)"]
    return []


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                         ignore_index: int, label_smoothing: float, reduction: str) -> torch.Tensor:
    return cross_entropy(F.linear(x, weight, bias), target, ignore_index, label_smoothing, reduction)


def linear_cross_entropy_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                  bias: Optional[torch.Tensor], ignore_index: int, label_smoothing: float, reduction: str) -> tuple:
    """(grad_x, grad_weight, grad_bias) by autograd; a missing bias is a zero bias, so grad_bias exists."""
    with torch.enable_grad():
        b = leaf(bias) if bias is not None else filled_leaf(weight.shape[0], 0.0, x)
        xg, wg = leaf(x), leaf(weight)
        loss = linear_cross_entropy(xg, wg, target, b, ignore_index, label_smoothing, reduction)
        return torch.autograd.grad(loss, (xg, wg, b), grad_out)


__all__ = ["cross_entropy", "cross_entropy_backward", "linear_cross_entropy", "linear_cross_entropy_backward"]
