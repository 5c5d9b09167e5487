"""The multi-tensor optimizer kernels (one launch per list, nothing read back): amp_unscale_ and
fused_adamw_. Launch configuration: the plugin's ``multi_tensor`` blocks for the first tensor."""

from __future__ import annotations

import torch

from ..checks import flat_lists
from .kit import FIRST, NOT_F64, Kit, family


def register(kit: Kit) -> None:
    tables = kit.tables
    adamw_lists = flat_lists("params", "grads", "exp_avgs", "exp_avg_sqs", "master_params")

    @kit.kernel("amp_unscale_", "triton", FIRST, checks=(flat_lists("tensors"),))
    def amp_unscale_(tensors, inv_scale):
        if not tensors:
            return torch.zeros((), dtype=torch.float32, device=inv_scale.device if isinstance(inv_scale, torch.Tensor) else "cuda")
        t0 = tensors[0]
        return family("optim").amp_unscale(tensors, inv_scale, device=t0.device, **tables.multi_tensor(t0))

    @kit.kernel("fused_adamw_", "triton", FIRST, dtypes=NOT_F64, checks=(adamw_lists,))
    def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, master_params, inv_scale, found_inf):
        if not params:
            return None
        family("optim").fused_adamw(
            params, grads, exp_avgs, exp_avg_sqs, master_params, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, step=step, inv_scale=inv_scale, found_inf=found_inf, **tables.multi_tensor(params[0]),
        )
        return None
