"""cross_entropy on torch's CPU kernels (F.cross_entropy on float32 logits), and the LM head with
its loss in blocks of rows: at most BLOCK_ELEMENTS logits exist at a time. A training forward (hal's
autograd node) also turns each block's logits into gradients and keeps them for the backward;
otherwise the backward recomputes each block's logits. No autograd graph either way. The float32
GEMMs go through oneDNN (hal_backend_cpu.gemm.mm: MKL's sgemm ran 2.2x slower on the AMD EPYC VM).
torch's LM head and loss (the whole logits) serve calls whose logits are one block, and
torch.compile graphs (:func:`_whole_logits_fit`)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hal.errors import InvalidArgumentError
from hal.plugin import Inputs
from hal.plugin_sdk.calls import traced
from hal.plugin_sdk.kept import KeptForBackward, backward_follows
from hal.plugin_sdk.linear import kept_gradients_state
from hal_torch import loss as eager

from ._common import FLOATS, kernel
from ._device import onednn_dtype_reason
from .gemm import linear_rows, mm

#: logits held at once by linear_cross_entropy (float32: 16 MiB)
BLOCK_ELEMENTS = 1 << 22


def _check_targets(op: str, target: torch.Tensor, ignore_index: int, classes: int) -> None:
    """Class indices in range or ignored (reading them costs nothing on the CPU), as cpu_ref demands.
    Not while torch.compile traces the kernel into a graph (its fake tensors hold no values; the
    compiled graph then behaves as torch's cross_entropy does)."""
    if traced((target,)):
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= classes))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise InvalidArgumentError(op, "target", f"class indices in [0, {classes}) or ignore_index ({ignore_index})", f"{int(target[i])} at row {i}")


@kernel("cross_entropy", name="torch", priority=20, dtypes=FLOATS, differentiable=True)
def cross_entropy(logits, target, ignore_index, label_smoothing, reduction):
    _check_targets("cross_entropy", target, ignore_index, logits.shape[1])
    return eager.cross_entropy(logits, target, ignore_index, label_smoothing, reduction)


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@kernel("cross_entropy_backward", name="torch", priority=20, dtypes=FLOATS)
def cross_entropy_backward(grad_out, logits, target, ignore_index, label_smoothing, reduction):
    _check_targets("cross_entropy_backward", target, ignore_index, logits.shape[1])
    counted = target != ignore_index
    return _logit_grad(logits.to(_acc(logits)), target, counted, _row_scale(grad_out, counted, reduction), label_smoothing).to(logits.dtype)


def _row_scale(grad_out: torch.Tensor, counted: torch.Tensor, reduction: str) -> torch.Tensor:
    g = grad_out.to(torch.float64 if grad_out.dtype == torch.float64 else torch.float32)
    if reduction == "mean":
        g = g / counted.sum().clamp_min(1)
    return torch.where(counted, g.expand(counted.shape), 0.0)


def _logit_grad(z: torch.Tensor, target: torch.Tensor, counted: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """(softmax(z) - (1 - eps) onehot(target) - eps / C) * scale, row by row."""
    d = torch.softmax(z, dim=1).sub_(eps / z.shape[1])
    rows = torch.arange(z.shape[0])
    d[rows, torch.where(counted, target, 0).long()] -= 1.0 - eps
    return d.mul_(scale[:, None])


def _blocks(n: int, v: int):
    step = max(1, BLOCK_ELEMENTS // max(1, v))
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def _half_gemm(x: torch.Tensor) -> bool:
    """Half precision whose GEMMs oneDNN runs on this CPU (float16 needs AVX512-FP16 or AVX-NE-CONVERT;
    without them the float32 detour is faster)."""
    return x.dtype in (torch.float16, torch.bfloat16) and onednn_dtype_reason(str(x.dtype).removeprefix("torch.")) is None


def _logits(x, weight, bias, rows):
    """A block's logits in float32 (float64 for float64): half precision multiplies in its own dtype
    (oneDNN's bfloat16 GEMM, float32 accumulation, logits rounded once, as autocast's F.linear
    does) and the loss math runs on them in float32."""
    acc = _acc(x)
    if _half_gemm(x):
        return linear_rows(x[rows], weight, bias).to(acc)
    return linear_rows(x[rows].to(acc), weight.to(acc), None if bias is None else bias.to(acc))


class _Grads:
    """linear_cross_entropy's gradients for per-row scales of the loss (``_row_scale``), block by
    block from the block's logits: grad_x in the GEMMs' dtype (x's in half precision, as autograd of
    autocast's F.linear), grad_weight and grad_bias accumulated in float32 (float64 for float64)."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, counted: torch.Tensor, label_smoothing: float) -> None:
        acc = _acc(x)
        self.gemm = x.dtype if _half_gemm(x) else acc
        self.w = weight.to(self.gemm)
        self.scale, self.counted, self.label_smoothing = scale, counted, label_smoothing
        self.x = torch.empty(x.shape, dtype=self.gemm)
        self.weight = torch.zeros(weight.shape, dtype=acc)
        self.bias = torch.zeros(weight.shape[0], dtype=acc)

    def add_block(self, r: slice, z: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> None:
        d = _logit_grad(z, target[r], self.counted[r], self.scale[r], self.label_smoothing)
        self.bias += d.sum(0)
        d = d.to(self.gemm)
        self.x[r] = mm(d, self.w)
        self.weight += mm(d.t(), x[r].to(self.gemm))

    def result(self, x: torch.Tensor, grad_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gradients in x's dtype, scaled by ``grad_out`` (one value) when the row scales were
        for a grad_out of one."""
        gx, gw, gb = self.x, self.weight, self.bias
        if grad_out is not None:
            g = grad_out.reshape(()).to(gw.dtype)
            gx, gw, gb = gx.mul_(g), gw.mul_(g), gb.mul_(g)
        return gx.to(x.dtype), gw.to(x.dtype), gb.to(x.dtype)


#: the gradients a training forward computes beside its loss, for the backward of the same call
_KEPT = KeptForBackward()


@kernel("linear_cross_entropy", name="blocked", priority=20, dtypes=FLOATS)
def linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, reduction):
    """The loss; in a training forward (hal's autograd node, a mean or sum) also the gradients for
    a grad_out of one from the same logits, kept for the backward op (hal.integration.kept): the logits' GEMM
    runs once a step instead of twice."""
    _check_targets("linear_cross_entropy", target, ignore_index, weight.shape[0])
    counted = target != ignore_index
    grads = None
    if reduction != "none" and backward_follows(x, weight, bias):
        grads = _Grads(x, weight, _row_scale(torch.ones((), dtype=_acc(x)), counted, reduction), counted, label_smoothing)
    losses = []
    for r in _blocks(x.shape[0], weight.shape[0]):
        z = _logits(x, weight, bias, r)
        losses.append(F.cross_entropy(z, target[r].long(), ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"))
        if grads is not None:
            grads.add_block(r, z, x, target)
    if grads is not None:
        _KEPT.keep(x, kept_gradients_state(weight, target, bias, ignore_index, label_smoothing, reduction), grads)
    losses = torch.cat(losses)
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / counted.sum()


def _whole_logits_fit(inputs: Inputs) -> list[str]:
    """Where torch's LM head and loss (the whole logits) may run a call: in an eager call, logits
    that the blocked kernel would hold as one block anyway (BLOCK_ELEMENTS); inside torch.compile
    graphs, logits that fit hal_torch.loss.GRAPH_LOGITS_LIMIT, where Inductor compiles them
    with the step's other code. Forward + backward of one call on the CPU VM, timed by
    :func:`hal.tuning.for_compile` (2026-12-03), Inductor's LM head and loss against the blocked
    kernel as an opaque node: 223 against 211 ms at 2048 x 512 x 8192 in bfloat16 (442 against 417
    in float32), 1268 against 2086 ms at 4096 x 512 x 32000 (3415 against 3825). Within whole Llama
    steps the two never measured apart; a tuned step measures each call and keeps the faster."""
    if inputs.traced:
        return eager.whole_logits_in_graphs(inputs)
    rows, classes = inputs["x"].shape[0], inputs["weight"].shape[0]
    if rows * classes > BLOCK_ELEMENTS:
        return [f"would hold the whole logits ({rows} x {classes}), more than {BLOCK_ELEMENTS} elements (one block of the blocked kernel)"]
    return []


kernel("linear_cross_entropy", name="torch", priority=10, dtypes=FLOATS, checks=[_whole_logits_fit], differentiable=True)(eager.linear_cross_entropy)


@kernel("linear_cross_entropy_backward", name="blocked", priority=20, dtypes=FLOATS)
def linear_cross_entropy_backward(grad_out, x, weight, target, bias, ignore_index, label_smoothing, reduction):
    """The forward's kept gradients scaled by grad_out where it kept them; otherwise each block's
    logits again, turned into gradients."""
    _check_targets("linear_cross_entropy_backward", target, ignore_index, weight.shape[0])
    if reduction != "none":
        kept = _KEPT.take(x, kept_gradients_state(weight, target, bias, ignore_index, label_smoothing, reduction))
        if kept is not None:
            return kept.result(x, grad_out)
    counted = target != ignore_index
    grads = _Grads(x, weight, _row_scale(grad_out, counted, reduction), counted, label_smoothing)
    for r in _blocks(x.shape[0], weight.shape[0]):
        grads.add_block(r, _logits(x, weight, bias, r), x, target)
    return grads.result(x)
