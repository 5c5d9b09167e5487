"""conv2d and its gradients through MIOpen (torch's ROCm build runs F.conv2d on MIOpen), batch_norm
through MIOpen, and eval-mode conv -> BN -> ReLU as one MIOpen fusion plan.

fused_conv_bn_relu has two paths. In eval, ``miopen_fused``: the batch norm folds into the
convolution (:mod:`hal.eager.fold`, cached while the parameters are unchanged) and
``torch.miopen_convolution_relu`` runs convolution + bias + ReLU. torch builds a MIOpen fusion plan
only for 4-D NCHW-contiguous float32 inputs and runs three passes otherwise, so the kernel states
exactly that; half-precision and channels_last inputs take ``miopen_triton`` from
hal.triton.kernels (MIOpen convolution, then one Triton pass for normalise + ReLU), as does
training. Padding arrives canonical (top, bottom, left, right); :mod:`hal.eager.conv` applies an
asymmetric one with F.pad first, as PyTorch does for such a "same" convolution.
"""

from __future__ import annotations

import torch

from hal.eager.fold import FoldCache
from hal.plugin import Inputs

from ._common import FLOATS, eager_kernel, ieee_fp32, kernel

#: MIOpen's convolution and its gradients with canonical arguments, IEEE float32 for float32 data;
#: the kit's ``miopen_triton`` kernels build on them (hal.triton.kernels.VendorLibs)
conv = eager_kernel("conv2d", name="miopen", priority=10, dtypes=FLOATS)
conv_grads = eager_kernel("conv2d_backward", name="miopen", priority=10, dtypes=FLOATS)
eager_kernel("batch_norm", name="miopen", priority=10, dtypes=FLOATS)

FOLDED = FoldCache()


def _fusion_plan(inputs: Inputs) -> list[str]:
    """Where torch runs MIOpen's conv + bias + ReLU fusion plan: eval mode, NCHW float32, one
    padding per side pair."""
    x = inputs["x"]
    top, bottom, left, right = inputs["padding"]
    reasons = []
    if inputs["training"]:
        reasons.append("training mode (batch statistics cannot be folded into the weights)")
    if not x.is_contiguous():
        reasons.append("input not NCHW-contiguous (torch.miopen_convolution_relu fuses NCHW inputs only)")
    if top != bottom or left != right:
        reasons.append("asymmetric padding (torch.miopen_convolution_relu takes one padding per side pair)")
    return reasons


@kernel("fused_conv_bn_relu", name="miopen_fused", priority=30, dtypes=("float32",), checks=[_fusion_plan])
def fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    weight, bias = FOLDED.get(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps)
    with ieee_fp32(x):
        return torch.miopen_convolution_relu(x, weight, bias, stride, (padding[0], padding[2]), dilation, groups)
