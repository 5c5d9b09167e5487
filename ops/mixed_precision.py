"""Mixed-precision training steps: gradient unscaling with an overflow check, and fused AdamW."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hal.arrays import FLOAT_DTYPES
from hal.registry import declare
from hal.types import OptionalScalarOrTensor, OptionalTensorList, ScalarOrTensor, TensorList

from . import _checks as c
from . import _empty as e
from ._tolerances import ELEMENTWISE

#: where this family's ops stand among hal's (hal.ops: the order of API.md and docs/ops.md)
ORDER = 60


@declare(
    dtypes=FLOAT_DTYPES,
    tolerances=ELEMENTWISE,
    mutates=("tensors",),
    dtype_from="tensors",
    volatile={"inv_scale": c.one_value},  # a loss scaler's number changes every few steps
)
def amp_unscale_(tensors: TensorList, inv_scale: ScalarOrTensor) -> Any:
    """Multiply every tensor by ``inv_scale`` in place (the gradient unscale of dynamic loss scaling).

    ``inv_scale`` is taken as a float32 value, the precision torch's GradScaler keeps it in.
    Returns a 0-d float32 array or tensor on the tensors' device: 1.0 if any value (before or after
    scaling) was NaN or infinite, else 0.0. All tensors are scaled either way, as torch's
    ``_amp_foreach_non_finite_check_and_unscale_`` does (which flags only values non-finite before
    scaling; a finite value overflowing when ``inv_scale > 1`` is flagged here too).
    """


@amp_unscale_.checker
def _check_amp_unscale(tensors, inv_scale):
    for i, t in enumerate(tensors):
        c.float_dtype("amp_unscale_", f"tensors[{i}]", t)
        c.writable("amp_unscale_", f"tensors[{i}]", t)


def _empty_amp_unscale_(a: Mapping[str, Any]) -> Any:
    """Empty tensors hold nothing to scale or check: the op runs on the others (0.0 when none)."""
    from hal.ops import amp_unscale_

    tensors = a["tensors"]
    kept = [t for t in tensors if not e.has_empty(t)]
    return amp_unscale_(kept, a["inv_scale"]) if kept else e.zeros(tensors[0], (), "float32")


#: fused_adamw_'s scalars change every step (schedules, step counts): validated per call, not cached.
ADAMW_SCALARS = {
    "lr": c.number_in(low=0.0),
    "beta1": c.number_in(low=0.0, high=1.0, high_open=True),
    "beta2": c.number_in(low=0.0, high=1.0, high_open=True),
    "eps": c.number_in(low=0.0),
    "weight_decay": c.number_in(low=0.0),
    "step": c.one_value_in(low=1.0),  # a number, or a 0-d tensor on the params' device (a capturable step count)
    "inv_scale": c.optional_one_value,
    "found_inf": c.optional_one_value,
}

LISTS = ("params", "grads", "exp_avgs", "exp_avg_sqs")


@declare(
    dtypes=FLOAT_DTYPES,
    tolerances=ELEMENTWISE,
    mutates=("params", "exp_avgs", "exp_avg_sqs", "master_params"),
    dtype_from="params",
    volatile=ADAMW_SCALARS,
)
def fused_adamw_(
    params: TensorList,
    grads: TensorList,
    exp_avgs: TensorList,
    exp_avg_sqs: TensorList,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: ScalarOrTensor,
    master_params: OptionalTensorList = None,
    inv_scale: OptionalScalarOrTensor = None,
    found_inf: OptionalScalarOrTensor = None,
) -> None:
    """One ``torch.optim.AdamW`` step over lists of tensors, in place; returns None.

    With the bias corrections ``c1 = 1 - beta1**step`` and ``c2 = 1 - beta2**step`` (step counted
    from 1), for each tensor: ``g = grad * inv_scale``; ``p *= 1 - lr * weight_decay``;
    ``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * g**2``;
    ``p -= lr / c1 * m / (sqrt(v) / sqrt(c2) + eps)``. ``m`` is computed as torch.optim.AdamW's
    ``exp_avg.lerp_(grad, w)``, ``w = 1 - beta1``: ``m + w * (g - m)`` for ``w < 0.5``, else
    ``g - (g - m) * (1 - w)``, so NaN and infinities spread as there (an infinite ``m`` meeting a
    finite ``g`` gives NaN for ``w < 0.5``, an infinite ``g`` meeting a finite ``m`` otherwise;
    torch's fused CUDA kernel differs at these points). With ``master_params`` (float32) the update
    applies to the masters and each param receives its master rounded to the param's dtype; the
    grads then have the params' dtype or float32 (the params may be half-precision copies of
    float32 weights, the masters, stepped on the weights' float32 gradients: the copies are written
    in the same pass). All grads of one call share a dtype. ``inv_scale`` is taken as a float32
    value (as amp_unscale_ does). A non-zero ``found_inf`` skips the step: nothing is written.
    Grads are never modified. ``step`` is a number or a one-element float tensor on the params'
    device, read there (no host synchronisation: an optimizer keeping its step count on the device
    can be captured in a CUDA graph).
    """


@fused_adamw_.checker
def _check_fused_adamw(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, master_params, inv_scale, found_inf):
    op = "fused_adamw_"
    lists = dict(zip(LISTS, (params, grads, exp_avgs, exp_avg_sqs)))
    if master_params is not None:
        lists["master_params"] = master_params
    n = len(params)
    for name, items in lists.items():
        if len(items) != n:
            raise c.fail(op, name, f"a list of {n} arrays (one per param)", items)
    if n:
        pdtype = c.float_dtype(op, "params[0]", params[0])
        sdtype = c.float_dtype(op, "exp_avgs[0]", exp_avgs[0])
        gdtype = c.float_dtype(op, "grads[0]", grads[0])
        if master_params is None:
            c.dtype_in(op, "grads[0]", grads[0], (pdtype,), "grads have their params' dtype")
        else:
            c.dtype_in(op, "grads[0]", grads[0], (pdtype, "float32"), "grads have their params' dtype, or float32 beside float32 master weights")
        for i in range(n):
            shape = c.shape_of(params[i])
            for name, items in lists.items():
                c.shape_is(op, f"{name}[{i}]", items[i], shape, f"(the shape of params[{i}])")
            c.dtype_in(op, f"params[{i}]", params[i], (pdtype,), "all params of one call share a dtype")
            c.dtype_in(op, f"grads[{i}]", grads[i], (gdtype,), "all grads of one call share a dtype")
            c.dtype_in(op, f"exp_avgs[{i}]", exp_avgs[i], (sdtype,), "all optimizer states of one call share a dtype")
            c.dtype_in(op, f"exp_avg_sqs[{i}]", exp_avg_sqs[i], (sdtype,), "all optimizer states of one call share a dtype")
            if master_params is not None:
                c.dtype_in(op, f"master_params[{i}]", master_params[i], ("float32",), "master weights are float32")
            for name in ("params", "exp_avgs", "exp_avg_sqs", "master_params"):
                if name in lists:
                    c.writable(op, f"{name}[{i}]", lists[name][i])
        if master_params is not None and sdtype not in ("float32", "float64"):
            raise c.fail(op, "exp_avgs[0]", "of dtype float32 (or float64) beside float32 master weights", exp_avgs[0])
        if master_params is None and sdtype not in (pdtype, "float32"):
            raise c.fail(op, "exp_avgs[0]", f"of dtype {pdtype} or float32", exp_avgs[0])


@amp_unscale_.fake
def _fake_amp_unscale(a):
    tensors = a["tensors"]
    return tensors[0].new_empty((), dtype=torch.float32) if tensors else torch.empty((), dtype=torch.float32)


@fused_adamw_.fake
def _fake_fused_adamw(a):
    return None


def _empty_fused_adamw_(a: Mapping[str, Any]) -> None:
    """Empty parameters have nothing to step: the op runs on the others (nothing when none)."""
    from hal.ops import fused_adamw_

    keep = [i for i, p in enumerate(a["params"]) if not e.has_empty(p)]
    if not keep:
        return None
    lists = {name: [a[name][i] for i in keep] for name in (*LISTS, "master_params") if a[name] is not None}
    scalars = {name: a[name] for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "inv_scale", "found_inf")}
    fused_adamw_(**{"master_params": None, **lists}, **scalars)
    return None


# zero-size inputs: each op's empty rule (the dispatcher answers such calls with it, no kernel runs)
amp_unscale_.empty(_empty_amp_unscale_)
fused_adamw_.empty(_empty_fused_adamw_)


__all__ = ["amp_unscale_", "fused_adamw_"]
