"""cross_entropy on torch's CPU kernels (F.cross_entropy on float32 logits), and the LM head with
its loss in blocks of rows: at most BLOCK_ELEMENTS logits exist at a time, the backward recomputes
each block's logits and turns them into gradients without an autograd graph. The float32 GEMMs go
through oneDNN (hal_backend_cpu.gemm.mm: MKL's sgemm ran 2.2x slower on the AMD EPYC VM)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal.eager import loss as eager
from hal.errors import InvalidArgumentError

from ._common import FLOATS, kernel
from ._device import onednn_dtype_reason
from .gemm import linear_rows, mm

#: logits held at once by linear_cross_entropy (float32: 16 MiB)
BLOCK_ELEMENTS = 1 << 22


def _check_targets(op: str, target: torch.Tensor, ignore_index: int, classes: int) -> None:
    """Class indices in range or ignored (reading them costs nothing on the CPU), as cpu_ref demands."""
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


@kernel("linear_cross_entropy", name="blocked", priority=20, dtypes=FLOATS)
def linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, reduction):
    _check_targets("linear_cross_entropy", target, ignore_index, weight.shape[0])
    losses = torch.cat([F.cross_entropy(_logits(x, weight, bias, r), target[r].long(), ignore_index=ignore_index,
                                        label_smoothing=label_smoothing, reduction="none") for r in _blocks(x.shape[0], weight.shape[0])])
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / (target != ignore_index).sum()


@kernel("linear_cross_entropy_backward", name="blocked", priority=20, dtypes=FLOATS)
def linear_cross_entropy_backward(grad_out, x, weight, target, bias, ignore_index, label_smoothing, reduction):
    _check_targets("linear_cross_entropy_backward", target, ignore_index, weight.shape[0])
    acc = _acc(x)
    counted = target != ignore_index
    scale = _row_scale(grad_out, counted, reduction)
    gemm = x.dtype if _half_gemm(x) else acc  # the logits' gradient rounded to x's dtype, GEMMs in it (as autograd of autocast's F.linear)
    w = weight.to(gemm)
    grad_x = torch.empty(x.shape, dtype=gemm)
    grad_w = torch.zeros(weight.shape, dtype=acc)
    grad_b = torch.zeros(weight.shape[0], dtype=acc)
    for r in _blocks(x.shape[0], weight.shape[0]):
        d = _logit_grad(_logits(x, weight, bias, r), target[r], counted[r], scale[r], label_smoothing)
        grad_b += d.sum(0)
        d = d.to(gemm)
        grad_x[r] = mm(d, w)
        grad_w += mm(d.t(), x[r].to(gemm))
    return grad_x.to(x.dtype), grad_w.to(x.dtype), grad_b.to(x.dtype)
