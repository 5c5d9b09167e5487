"""Mixed-precision training steps: gradient unscaling with an overflow check, and one AdamW step.

Both write into the arrays they are given (the dispatcher copies back where it had to convert).
Scale factors are read as float32, the precision torch's GradScaler keeps them in.
"""

from __future__ import annotations

import math

import numpy as np

from ._common import f64, reference


def _float32_value(v) -> float:
    """A number or one-element array as the float32 value it denotes (as a Python float)."""
    with np.errstate(over="ignore"):  # beyond float32's range it is inf, as in a float32 tensor
        return float(np.float32(np.asarray(v, dtype=np.float64).reshape(())))


@reference("amp_unscale_")
def amp_unscale_(tensors, inv_scale):
    inv = _float32_value(inv_scale)
    found = False
    for t in tensors:
        with np.errstate(over="ignore"):  # an overflow is what this op reports, not an accident
            t[...] = f64(t) * inv
        found = found or not np.all(np.isfinite(t))  # non-finite before stays non-finite after
    return np.array(1.0 if found else 0.0, dtype=np.float32)


@reference("fused_adamw_")
def fused_adamw_(
    params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, master_params, inv_scale, found_inf
):
    if found_inf is not None and float(np.asarray(found_inf).reshape(())) != 0.0:
        return None
    inv = 1.0 if inv_scale is None else _float32_value(inv_scale)
    step = float(np.asarray(step, dtype=np.float64).reshape(()))  # a number or a one-element array
    c1, c2 = 1.0 - beta1**step, 1.0 - beta2**step
    targets = params if master_params is None else master_params
    for i, target in enumerate(targets):
        g = f64(grads[i]) * inv
        p = f64(target) * (1.0 - lr * weight_decay)
        m0, w = f64(exp_avgs[i]), 1.0 - beta1  # torch's lerp of m towards g by w (the op's docstring)
        m = m0 + w * (g - m0) if w < 0.5 else g - (g - m0) * (1.0 - w)
        v = beta2 * f64(exp_avg_sqs[i]) + (1.0 - beta2) * g * g
        p -= lr / c1 * m / (np.sqrt(v) / math.sqrt(c2) + eps)
        target[...] = p
        exp_avgs[i][...] = m
        exp_avg_sqs[i][...] = v
        if master_params is not None:
            params[i][...] = target  # the float32 master, rounded to the param's dtype
    return None
