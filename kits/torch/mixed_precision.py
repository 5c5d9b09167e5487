"""Gradient unscaling and the AdamW step in eager PyTorch, on torch's own fused kernels.

amp_unscale_ runs ``torch._amp_foreach_non_finite_check_and_unscale_``; fused_adamw_ runs
``torch._fused_adamw_`` (CPU and CUDA), on float32 working copies where the dtypes of params, grads
and states differ (low-precision params with float32 states or master weights), since the fused
kernel takes one dtype, and on contiguous copies where the tensors of one index are not dense or
differ in memory layout (it walks each tensor as one run of memory). Neither reads a device value
on the host.

At NaN and infinities the moments are torch's fused kernel's, which is not torch.optim.AdamW's on
every torch: from torch 2.11 the CUDA kernel computes ``m`` as ``fma(beta1, m, fma(-beta1, g, g))``
(and ``v`` alike), NaN at an infinite gradient where torch.optim.AdamW's ``lerp_`` (and the op's
formula, hal's other kernels) give an infinity, and an infinity where the lerp gives NaN (an
infinite ``m`` meeting a finite ``g``). Finite values agree to rounding.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from hal.plugin_sdk.arrays import dense_alike, flat_runs

Scalar = Union[float, torch.Tensor]


def _float32_scalar(v: Scalar, device: torch.device) -> torch.Tensor:
    """A number or one-element tensor as a one-element float32 tensor on ``device``."""
    return torch.as_tensor(v, dtype=torch.float32, device=device).reshape(1)


def _working(lists: Sequence[Sequence[torch.Tensor]], dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """The lists in ``dtype``, each index in one flat memory layout (torch's fused kernel walks
    tensors as runs of memory): the same objects where they already are (channels_last weights
    with moments and gradients alike included), else copies (contiguous where layouts differ)."""
    if flat_runs(*lists):
        return [[t.to(dtype) for t in ts] for ts in lists]
    rows = [[t.to(dtype) if dense_alike(*group) else t.to(dtype).contiguous() for t in group] for group in zip(*lists)]
    return [list(ts) for ts in zip(*rows)]


def amp_unscale_(tensors: Sequence[torch.Tensor], inv_scale: Scalar) -> torch.Tensor:
    device = tensors[0].device if tensors else torch.device("cpu")
    found = torch.zeros(1, dtype=torch.float32, device=device)
    if tensors:
        tensors = list(tensors)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, _float32_scalar(inv_scale, device))
        # torch flags values that were non-finite before scaling; a pass with inv_scale 1 (values
        # unchanged) also flags those that overflowed while scaling, as the op specifies.
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, torch.ones_like(found))
    return found.reshape(())


def step_tensor(step: Scalar, device: torch.device) -> torch.Tensor:
    """The step count as the 0-d float32 tensor torch's fused AdamW reads (a tensor stays on the device)."""
    if isinstance(step, torch.Tensor):
        return step.reshape(()).to(device=device, dtype=torch.float32)
    return torch.full((), float(step), dtype=torch.float32, device=device)


def fused_adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Scalar,
    master_params: Optional[Sequence[torch.Tensor]] = None,
    inv_scale: Optional[Scalar] = None,
    found_inf: Optional[Scalar] = None,
) -> None:
    if not params:
        return None
    device = params[0].device
    targets = list(params if master_params is None else master_params)
    dtype = targets[0].dtype if exp_avgs[0].dtype == targets[0].dtype == grads[0].dtype else torch.float32
    w_params, w_avgs, w_sqs, w_grads = _working((targets, exp_avgs, exp_avg_sqs, grads), dtype)
    if inv_scale is not None:  # never in place: grads are not modified
        w_grads = torch._foreach_mul(w_grads, _float32_scalar(inv_scale, device).reshape(()))
    skip = None if found_inf is None else (_float32_scalar(found_inf, device) != 0).float()
    steps = [step_tensor(step, device)] * len(targets)  # torch's kernel reads the steps, never writes them
    torch._fused_adamw_(
        w_params, w_grads, w_avgs, w_sqs, [], steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=False, maximize=False, grad_scale=None, found_inf=skip,
    )  # fmt: skip
    written = [(targets, w_params), (exp_avgs, w_avgs), (exp_avg_sqs, w_sqs)]
    if master_params is not None:
        written.append((params, w_params))
    for dst_list, src_list in written:
        for dst, src in zip(dst_list, src_list):
            if dst is src:
                continue
            value = src.to(dst.dtype)
            dst.copy_(value if skip is None else torch.where(skip.bool(), dst, value))
    return None


__all__ = ["amp_unscale_", "fused_adamw_"]
