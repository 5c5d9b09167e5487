"""amp_unscale_ and fused_adamw_ on torch's multi-tensor CPU kernels
(``_amp_foreach_non_finite_check_and_unscale_``, ``_fused_adamw_``: one vectorised pass per tensor);
fused_adamw_ calls that torch's fused kernel cannot take in place run hal_torch's copies."""

from __future__ import annotations

import itertools
import operator

import torch

from hal.plugin_sdk.arrays import flat_runs
from hal.plugin import Inputs
from hal_torch import mixed_precision as eager

from ._common import FLOATS, kernel

@kernel("amp_unscale_", name="torch", priority=20, dtypes=FLOATS)
def amp_unscale_(tensors, inv_scale):
    """One pass of torch's kernel where |inv_scale| <= 1 (read on the host: free on the CPU): a
    finite value times a factor of at most 1 cannot overflow, so the second pass hal_torch makes
    (which flags values that overflow while scaling) would find nothing. Loss scaling unscales by
    1 / scale, mostly below 1. Otherwise, and for NaN, hal_torch's two passes."""
    if tensors:
        factor = float(inv_scale)
        if abs(factor) <= 1.0:
            found = torch.zeros(1, dtype=torch.float32)
            torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found, torch.tensor([factor], dtype=torch.float32))
            return found.reshape(())
    return eager.amp_unscale_(tensors, inv_scale)


_DTYPE = operator.attrgetter("dtype")


def _fused_kernel_fits(inputs: Inputs) -> list[str]:
    """Whether torch's fused kernel can update the tensors themselves: one dtype for params, grads
    and states, tensors it can walk as runs of memory (hal.arrays.flat_runs), no master weights and
    no unscaling (its grad_scale would write the unscaled grads back, and grads must stay
    unchanged). A check, so it is decided once per input signature, not on every step."""
    if inputs["master_params"] is not None:
        return ["master weights: torch's fused kernel updates one set of parameters"]
    if inputs["inv_scale"] is not None:
        return ["inv_scale: torch's fused kernel would write the unscaled gradients back"]
    lists = tuple(inputs[n] for n in ("params", "grads", "exp_avgs", "exp_avg_sqs"))
    if len(set(map(_DTYPE, itertools.chain.from_iterable(lists)))) > 1:
        return ["params, grads and states of more than one dtype"]
    if not flat_runs(*lists):
        return ["tensors that are not dense, or not laid out alike across the lists"]
    return []


@kernel("fused_adamw_", name="torch_fused", priority=25, dtypes=FLOATS, checks=[_fused_kernel_fits])
def fused_adamw_fused(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, master_params, inv_scale, found_inf):
    """torch._fused_adamw_ in place (one step tensor shared by all: the kernel only reads it)."""
    if not params:
        return None
    skip = None if found_inf is None else (torch.as_tensor(found_inf, dtype=torch.float32).reshape(1) != 0).float()
    steps = [eager.step_tensor(step, params[0].device)] * len(params)
    torch._fused_adamw_(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=False, maximize=False, grad_scale=None, found_inf=skip,
    )  # fmt: skip
    return None


#: everything else (mixed dtypes, master weights, unscaling, strided tensors): hal_torch's working copies
kernel("fused_adamw_", name="torch", priority=20, dtypes=FLOATS)(eager.fused_adamw_)
