"""Losses: cross-entropy over class logits, and the LM head fused with its cross-entropy.

Both follow ``F.cross_entropy`` (class indices, ``ignore_index``, ``label_smoothing``, reductions
none/mean/sum; a mean over zero counted rows is NaN) with two departures that LLM training wants:
the arithmetic is float32 whatever the logits' dtype (float64 for float64), and so is the loss
(float64 for float64 inputs). Targets outside ``[0, C)`` other than ``ignore_index`` are an error
where the reference can see them (cpu_ref raises); GPU kernels cannot raise from the device and give
NaN for such rows instead, as they cannot be read back without a synchronisation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from hal.arrays import FLOAT_DTYPES, dtype_name, from_numpy, to_numpy
from hal.registry import Autocast, declare
from hal.types import OptionalTensor, Tensor

from . import _checks as c
from ._fake import like, new_array
from ._tolerances import REDUCTION

#: where this family's ops stand among hal's (hal.ops: the order of API.md and docs/ops.md)
ORDER = 100

REDUCTIONS = ("none", "mean", "sum")


def loss_dtype(dtype: Any) -> torch.dtype:
    """The dtype of a loss over inputs of ``dtype``: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_target(op: str, target: Any, n: int) -> None:
    c.rank(op, "target", target, (1,), "(N,) of class indices")
    c.int_dtype(op, "target", target, ("int32", "int64"))
    c.shape_is(op, "target", target, (n,), "(one class index per row)")


def _check_options(op: str, ignore_index: Any, label_smoothing: Any, reduction: Any) -> dict[str, Any]:
    return {
        "ignore_index": c.integer(op, "ignore_index", ignore_index),
        "label_smoothing": c.number(op, "label_smoothing", label_smoothing, low=0.0, high=1.0),
        "reduction": c.choice(op, "reduction", reduction, REDUCTIONS),
    }


def _check_logits(op: str, logits: Any, target: Any) -> int:
    c.rank(op, "logits", logits, (2,), "(N, C)")
    c.float_dtype(op, "logits", logits)
    classes = int(logits.shape[1])
    if classes < 1:
        raise c.fail(op, "logits", "an (N, C) array with at least one class (C >= 1)", logits)
    _check_target(op, target, int(logits.shape[0]))
    return classes


def _loss_shape(a: Any) -> tuple:
    return (int(a["target"].shape[0]),) if a["reduction"] == "none" else ()


def _check_grad_out(op: str, grad_out: Any, reduction: str, n: int, dtype: torch.dtype) -> None:
    want = (n,) if reduction == "none" else ()
    c.shape_is(op, "grad_out", grad_out, want, "(the loss's shape)")
    c.dtype_in(op, "grad_out", grad_out, [str(dtype).replace("torch.", "")], "the loss's dtype")


# --- cross_entropy ------------------------------------------------------------------------------


# No autocast rule: torch casts the logits of F.cross_entropy to float32 under autocast (its fp32
# list), and the loss here is float32 for half-precision logits already, computed in float32; the
# same dtype without a float32 copy of the logits.
@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="cross_entropy_backward", gradients="logits",
         reduction=lambda a: int(a["logits"].shape[1]))
def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(logits, target, ignore_index=..., label_smoothing=..., reduction=...)`` on
    logits (N, C) and int32/int64 class indices (N,), accumulated in float32 (float64 for float64
    logits); the loss is float32 (float64), 0-d for mean and sum, (N,) for none (0 at ignored rows).
    With label smoothing e a row's loss is ``(1 - e) * -log p[t] + e / C * sum_c -log p[c]``.
    """


@cross_entropy.checker
def _check_cross_entropy(logits, target, ignore_index, label_smoothing, reduction):
    _check_logits("cross_entropy", logits, target)
    return _check_options("cross_entropy", ignore_index, label_smoothing, reduction)


@cross_entropy.fake
def _fake_cross_entropy(a):
    logits = a["logits"]
    return logits.new_empty(_loss_shape(a), dtype=loss_dtype(logits.dtype))


def _empty_loss(a: Any, like_this: Any) -> Any:
    """The loss over zero rows: an empty (0,) vector, a 0 sum, a NaN mean."""
    dt = loss_dtype(like_this.dtype) if isinstance(like_this, torch.Tensor) else (np.float64 if like_this.dtype == np.float64 else np.float32)
    if a["reduction"] == "none":
        return new_array(like_this, (0,), dtype=dt)
    return new_array(like_this, (), math.nan if a["reduction"] == "mean" else 0.0, dtype=dt)


@cross_entropy.empty
def _empty_cross_entropy(a):
    return _empty_loss(a, a["logits"])


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="cross_entropy", dtype_from="logits",
         reduction=lambda a: int(a["logits"].shape[1]))
def cross_entropy_backward(grad_out: Tensor, logits: Tensor, target: Tensor, ignore_index: int = -100,
                           label_smoothing: float = 0.0, reduction: str = "mean") -> Tensor:
    """Gradient of cross_entropy with respect to the logits, in the logits' dtype:
    ``(softmax(logits) - (1 - e) * onehot(target) - e / C) * g`` per row, with g the row's
    grad_out (none), grad_out (sum) or grad_out / (count of non-ignored rows) (mean); 0 at ignored rows."""


@cross_entropy_backward.checker
def _check_cross_entropy_backward(grad_out, logits, target, ignore_index, label_smoothing, reduction):
    op = "cross_entropy_backward"
    _check_logits(op, logits, target)
    canon = _check_options(op, ignore_index, label_smoothing, reduction)
    _check_grad_out(op, grad_out, canon["reduction"], int(logits.shape[0]), loss_dtype(_torch_dtype(logits)))
    return canon


def _torch_dtype(a: Any) -> torch.dtype:
    return a.dtype if isinstance(a, torch.Tensor) else getattr(torch, dtype_name(a))


@cross_entropy_backward.fake
def _fake_cross_entropy_backward(a):
    return like(a["logits"])


@cross_entropy_backward.empty
def _empty_cross_entropy_backward(a):
    return new_array(a["logits"], c.shape_of(a["logits"]))


# --- linear_cross_entropy -----------------------------------------------------------------------


def _check_lce(op: str, x: Any, weight: Any, target: Any, bias: Any) -> None:
    c.rank(op, "x", x, (2,), "(N, K)")
    c.float_dtype(op, "x", x)
    c.rank(op, "weight", weight, (2,), "(V, K)")
    c.same_dtype(op, "weight", weight, "x", x)
    if int(weight.shape[1]) != int(x.shape[1]):
        raise c.fail(op, "weight", f"of shape (V, {int(x.shape[1])}) to match x's K", weight)
    if int(weight.shape[0]) < 1:
        raise c.fail(op, "weight", "a (V, K) array with at least one class (V >= 1)", weight)
    if bias is not None:
        c.rank(op, "bias", bias, (1,))
        c.shape_is(op, "bias", bias, (int(weight.shape[0]),), "(V,)")
        c.same_dtype(op, "bias", bias, "x", x)
    _check_target(op, target, int(x.shape[0]))


def _lce_k(a: Any) -> int:
    return max(int(a["x"].shape[1]), int(a["weight"].shape[0]))


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="linear_cross_entropy_backward", gradients=("x", "weight", "bias"),
         reduction=_lce_k, autocast=Autocast("lower", args=("x", "weight", "bias")))  # linear's cast; the loss is float32 already
def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, bias: OptionalTensor = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean") -> Tensor:
    """``cross_entropy(linear(x, weight, bias), target, ...)`` for x (N, K), weight (V, K), bias (V,):
    an LM head and its loss in one op, computed without ever holding the whole (N, V) logits (every
    backend works through blocks of rows or classes). The loss as cross_entropy's (float32)."""


@linear_cross_entropy.checker
def _check_linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, reduction):
    _check_lce("linear_cross_entropy", x, weight, target, bias)
    return _check_options("linear_cross_entropy", ignore_index, label_smoothing, reduction)


@linear_cross_entropy.fake
def _fake_linear_cross_entropy(a):
    return a["x"].new_empty(_loss_shape(a), dtype=loss_dtype(a["x"].dtype))


#: rows per block of the composite: at most this many logits are held at once
COMPOSITE_BLOCK_ELEMENTS = 1 << 22


@linear_cross_entropy.composite
def _lce_composite(x, weight, target, bias, ignore_index, label_smoothing, reduction):
    """linear + cross_entropy over blocks of rows (at most COMPOSITE_BLOCK_ELEMENTS logits at a time),
    the per-row losses summed (mean: divided by the count of counted rows)."""
    from hal.ops import cross_entropy, linear

    n, v = int(x.shape[0]), int(weight.shape[0])
    step = max(1, COMPOSITE_BLOCK_ELEMENTS // v)
    parts = [cross_entropy(linear(x[i : i + step], weight, bias), target[i : i + step], ignore_index, label_smoothing, "none")
             for i in range(0, max(n, 1), step)]  # one (empty) block for an empty batch
    losses = _concat(parts)
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return total
    counted = (target != ignore_index).sum()
    return total / counted


def _concat(parts: list) -> Any:
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts)


def _head_only_loss(a: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """For K = 0 (no features), every row's logits are the bias (zeros without one): the row losses
    and the class probabilities, computed in O(N + V). Returns (row losses, counted mask,
    probabilities, eps) as float64 torch tensors on the inputs' device."""
    x, weight, target, bias = (from_numpy(v) if isinstance(v, np.ndarray) else v for v in (a["x"], a["weight"], a["target"], a["bias"]))
    v = int(weight.shape[0])
    b = bias.double() if bias is not None else torch.zeros(v, dtype=torch.float64, device=x.device)
    logp = torch.log_softmax(b, 0)
    eps = float(a["label_smoothing"])
    counted = target != a["ignore_index"]
    t = torch.where(counted, target, 0).long()
    rows = -(1.0 - eps) * logp[t] - eps / v * logp.sum()
    return torch.where(counted, rows, 0.0), counted, logp.exp(), eps


def _as_input_kind(t: torch.Tensor, like_this: Any, dtype: Any) -> Any:
    t = t.to(dtype)
    return t if isinstance(like_this, torch.Tensor) else to_numpy(t)


@linear_cross_entropy.empty
def _empty_linear_cross_entropy(a):
    x = a["x"]
    if int(x.shape[0]) == 0:
        return _empty_loss(a, x)
    rows, counted, _, _ = _head_only_loss(a)  # K == 0
    out = rows if a["reduction"] == "none" else (rows.sum() if a["reduction"] == "sum" else rows.sum() / counted.sum())
    dt = loss_dtype(_torch_dtype(x))
    return _as_input_kind(out, x, dt)


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="linear_cross_entropy", dtype_from="x", reduction=_lce_k)
def linear_cross_entropy_backward(grad_out: Tensor, x: Tensor, weight: Tensor, target: Tensor, bias: OptionalTensor = None,
                                  ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean") -> tuple:
    """Gradients of linear_cross_entropy: ``(grad_x, grad_weight, grad_bias)`` in x's dtype, the
    logits recomputed block by block (never all at once); grad_bias (V,) whether or not the forward
    had a bias."""


@linear_cross_entropy_backward.checker
def _check_linear_cross_entropy_backward(grad_out, x, weight, target, bias, ignore_index, label_smoothing, reduction):
    op = "linear_cross_entropy_backward"
    _check_lce(op, x, weight, target, bias)
    canon = _check_options(op, ignore_index, label_smoothing, reduction)
    _check_grad_out(op, grad_out, canon["reduction"], int(x.shape[0]), loss_dtype(_torch_dtype(x)))
    return canon


@linear_cross_entropy_backward.fake
def _fake_linear_cross_entropy_backward(a):
    x, w = a["x"], a["weight"]
    return like(x), like(w), like(x, (w.shape[0],))


@linear_cross_entropy_backward.empty
def _empty_linear_cross_entropy_backward(a):
    """N = 0: no row contributes (zero weight and bias gradients). K = 0: x and weight have no
    elements to differentiate; the bias gradient sums the rows' logit gradients, in O(N + V)."""
    x, weight = a["x"], a["weight"]
    n, v = int(x.shape[0]), int(weight.shape[0])
    grad_x, grad_w = new_array(x, c.shape_of(x), 0.0), new_array(weight, c.shape_of(weight), 0.0)
    if n == 0:
        return grad_x, grad_w, new_array(x, (v,), 0.0)
    _, counted, probs, eps = _head_only_loss(a)
    g = from_numpy(a["grad_out"]) if isinstance(a["grad_out"], np.ndarray) else a["grad_out"]
    g = g.double()
    if a["reduction"] == "mean":
        g = g / counted.sum()
    scale = torch.where(counted, g.expand(n), 0.0)
    t = from_numpy(a["target"]) if isinstance(a["target"], np.ndarray) else a["target"]
    hits = torch.zeros(v, dtype=torch.float64, device=scale.device).index_add_(0, torch.where(counted, t, 0).long(), scale)
    grad_b = scale.sum() * (probs - eps / v) - (1.0 - eps) * hits
    return grad_x, grad_w, _as_input_kind(grad_b, x, _torch_dtype(x))


__all__ = ["cross_entropy", "cross_entropy_backward", "linear_cross_entropy", "linear_cross_entropy_backward", "loss_dtype"]
