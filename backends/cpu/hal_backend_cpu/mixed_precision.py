"""amp_unscale_ and fused_adamw_ on torch's multi-tensor CPU kernels
(``_amp_foreach_non_finite_check_and_unscale_``, ``_fused_adamw_``: one vectorised pass per tensor)."""

from __future__ import annotations

import itertools
import operator

import torch

from hal.arrays import flat_runs
from hal.eager import mixed_precision as eager

from ._common import FLOATS, kernel

kernel("amp_unscale_", name="torch", priority=20, dtypes=FLOATS)(eager.amp_unscale_)


_DTYPE = operator.attrgetter("dtype")


def _direct(params, grads, exp_avgs, exp_avg_sqs, master_params, inv_scale) -> bool:
    """Whether torch's fused kernel can update the tensors themselves: one dtype for params, grads
    and states, tensors it can walk as runs of memory (hal.arrays.flat_runs), no master weights and
    no unscaling (its grad_scale would write the unscaled grads back, and grads must stay unchanged)."""
    if master_params is not None or inv_scale is not None:
        return False
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    return len(set(map(_DTYPE, itertools.chain.from_iterable(lists)))) == 1 and flat_runs(*lists)


@kernel("fused_adamw_", name="torch", priority=20, dtypes=FLOATS)
def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, master_params, inv_scale, found_inf):
    """torch._fused_adamw_ in place where it can (one step tensor shared by all: the kernel only
    reads it); hal.eager's working copies otherwise (mixed dtypes, master weights, unscaling)."""
    if not params:
        return None
    if not _direct(params, grads, exp_avgs, exp_avg_sqs, master_params, inv_scale):
        return eager.fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, master_params, inv_scale, found_inf)
    skip = None if found_inf is None else (torch.as_tensor(found_inf, dtype=torch.float32).reshape(1) != 0).float()
    steps = [eager.step_tensor(step, params[0].device)] * len(params)
    torch._fused_adamw_(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=False, maximize=False, grad_scale=None, found_inf=skip,
    )  # fmt: skip
    return None
