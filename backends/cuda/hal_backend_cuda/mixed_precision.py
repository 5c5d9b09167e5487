"""amp_unscale_ and fused_adamw_ with torch ops, tensor by tensor: the fallbacks of the
multi-tensor Triton kernels (hal_triton.kernels) for what they do not take (float64 parameters,
non-contiguous tensors). Nothing is read back to the host."""

from __future__ import annotations

import math

import torch

from hal.plugin_sdk.arrays import float32_value

from ._common import FLOATS, kernel


@kernel("amp_unscale_", name="torch", priority=10, dtypes=FLOATS)
def amp_unscale_torch(tensors, inv_scale):
    """Per tensor: non-finite check before and after an in-place multiply (device-side flags)."""
    device = tensors[0].device if tensors else "cuda"
    found = torch.zeros((), dtype=torch.float32, device=device)
    # the op takes inv_scale as a float32 value (as GradScaler keeps it)
    inv = inv_scale.float() if isinstance(inv_scale, torch.Tensor) else float32_value(inv_scale)
    for t in tensors:
        found = torch.maximum(found, (~torch.isfinite(t)).any().float())
        t.mul_(inv)
        found = torch.maximum(found, (~torch.isfinite(t)).any().float())
    return found


@kernel("fused_adamw_", name="torch", priority=10, dtypes=FLOATS)
def fused_adamw_torch(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, master_params, inv_scale, found_inf):
    """The same step with torch ops, tensor by tensor; a device found_inf keeps the old values by
    torch.where (no host read), the half-precision parameters of master weights included (a skipped
    step changes nothing). The first moment is torch.optim.AdamW's lerp (its NaN/infinity behaviour:
    an infinite gradient gives NaN, as the Triton and C++ kernels and cpu_ref since 49125f8)."""
    if found_inf is not None and not isinstance(found_inf, torch.Tensor) and float(found_inf) != 0.0:
        return None
    skip = found_inf.reshape(()) != 0 if isinstance(found_inf, torch.Tensor) else None
    inv = inv_scale.reshape(()) if isinstance(inv_scale, torch.Tensor) else (1.0 if inv_scale is None else float(inv_scale))
    if isinstance(step, torch.Tensor):  # read on the device: no synchronisation
        t = step.reshape(()).to(torch.float64)
        step_size, bc2_sqrt = lr / (1.0 - beta1**t), torch.sqrt(1.0 - beta2**t)
    else:
        step_size, bc2_sqrt = lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step)
    masters = master_params if master_params is not None else [None] * len(params)
    for p, g, m, v, w in zip(params, grads, exp_avgs, exp_avg_sqs, masters):
        target = w if w is not None else p
        acc = torch.float64 if target.dtype == torch.float64 else torch.float32
        g32 = g.to(acc) * inv
        m_new = torch.lerp(m.to(acc), g32, 1.0 - beta1)
        v_new = beta2 * v.to(acc) + (1.0 - beta2) * g32 * g32
        p_new = target.to(acc) * (1.0 - lr * weight_decay) - step_size * m_new / (v_new.sqrt() / bc2_sqrt + eps)
        if skip is not None:
            m_new, v_new, p_new = (torch.where(skip, old.to(acc), new) for old, new in ((m, m_new), (v, v_new), (target, p_new)))
        m.copy_(m_new)
        v.copy_(v_new)
        target.copy_(p_new)
        if w is not None:
            p.copy_(p_new if skip is None else torch.where(skip, p, p_new.to(p.dtype)))
    return None
