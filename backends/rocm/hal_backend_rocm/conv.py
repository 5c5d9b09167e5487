"""conv2d and its gradients through MIOpen (torch's ROCm build runs F.conv2d on MIOpen), batch_norm
through MIOpen, eval-mode conv -> BN -> ReLU as one MIOpen fusion plan, and eval-mode conv -> BN ->
add -> ReLU through ``torch.miopen_convolution_add_relu`` (the batch norm folded; see its kernel).

fused_conv_bn_relu has two paths. In eval, ``miopen_fused``: the batch norm folds into the
convolution (:mod:`hal.plugin_sdk.fold`, cached while the parameters are unchanged) and
``torch.miopen_convolution_relu`` runs convolution + bias + ReLU. torch builds a MIOpen fusion plan
only for 4-D NCHW-contiguous float32 inputs and runs three passes otherwise, so the kernel states
exactly that; half-precision and channels_last inputs take ``miopen_triton`` from
hal_triton.kernels (MIOpen convolution, then one Triton pass for normalise + ReLU), as does
training. Padding arrives canonical (top, bottom, left, right); :mod:`hal_torch.conv` applies an
asymmetric one with F.pad first, as PyTorch does for such a "same" convolution.
"""

from __future__ import annotations

import torch

from hal.plugin import Inputs
from hal.plugin_sdk.fold import FoldCache, folds_finitely
from hal_torch.conv import add_relu_backward_in_float32, add_relu_in_float32, torch_bn_eps

from ._common import FLOATS, NOT_F64, eager_kernel, ieee_fp32, kernel

#: MIOpen's convolution and its gradients with canonical arguments, IEEE float32 for float32 data;
#: the kit's ``miopen_triton`` kernels build on them (hal_triton.kernels.VendorLibs)
conv = eager_kernel("conv2d", name="miopen", priority=10, dtypes=FLOATS)
conv_grads = eager_kernel("conv2d_backward", name="miopen", priority=10, dtypes=FLOATS)
eager_kernel("batch_norm", name="miopen", priority=10, dtypes=FLOATS, checks=[torch_bn_eps])

FOLDED = FoldCache()


def _folded_eval(inputs: Inputs) -> list[str]:
    """Where a folded batch norm can run: eval mode, one padding per side pair (torch's MIOpen
    calls take no other)."""
    top, bottom, left, right = inputs["padding"]
    reasons = folds_finitely(inputs)
    if inputs["training"]:
        reasons.append("training mode (batch statistics cannot be folded into the weights)")
    if top != bottom or left != right:
        reasons.append(f"asymmetric padding ({_MIOPEN_CALLS[inputs.op.name]} takes one padding per side pair)")
    return reasons


#: the torch call of each fused op's ``miopen_fused`` kernel
_MIOPEN_CALLS = {"fused_conv_bn_relu": "torch.miopen_convolution_relu", "fused_conv_bn_add_relu": "torch.miopen_convolution_add_relu"}


def _fusion_plan(inputs: Inputs) -> list[str]:
    """Where torch runs MIOpen's conv + bias + ReLU fusion plan: eval mode, NCHW float32, one
    padding per side pair."""
    reasons = _folded_eval(inputs)
    if not inputs["x"].is_contiguous():
        reasons.append("input not NCHW-contiguous (torch.miopen_convolution_relu fuses NCHW inputs only)")
    return reasons


@kernel("fused_conv_bn_relu", name="miopen_fused", priority=30, dtypes=("float32",), checks=[_fusion_plan])
def fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    weight, bias = FOLDED.get(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps)
    with ieee_fp32(x):
        return torch.miopen_convolution_relu(x, weight, bias, stride, (padding[0], padding[2]), dilation, groups)


# torch.miopen_convolution_add_relu: torch's ROCm build runs it as a MIOpen convolution followed by the
# bias, the residual and the ReLU in separate passes (MIOpen's fusion plans have no add; see
# aten/src/ATen/native/miopen/Conv_miopen.cpp), for any layout and dtype MIOpen convolves. What this
# kernel saves on AMD GPUs is the batch norm, folded into the weights; training takes the op's
# decomposition or the ``torch`` kernel of :mod:`.fallbacks`.
@kernel("fused_conv_bn_add_relu", name="miopen_fused", priority=30, dtypes=NOT_F64, checks=[_folded_eval])
def fused_conv_bn_add_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups, eps,
                           momentum, training):
    weight, bias = FOLDED.get(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps)
    with ieee_fp32(x):
        return torch.miopen_convolution_add_relu(x, weight, residual, 1.0, bias, stride, (padding[0], padding[2]), dilation, groups)


# torch's ops for every other call (training without autograd, asymmetric padding, float64), half
# precision computed in float32 and rounded once (hal_torch.conv.add_relu_in_float32; fallbacks.py
# would register torch's ops as they are, which round the batch norm's output before the add)
eager_kernel("fused_conv_bn_add_relu", name="torch", priority=1, wrap=add_relu_in_float32)
eager_kernel("fused_conv_bn_add_relu_backward", name="torch", priority=1, wrap=add_relu_backward_in_float32)
