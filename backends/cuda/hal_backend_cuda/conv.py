"""conv2d (cuDNN), batch_norm through cuDNN, and eval-mode conv -> BN -> ReLU and conv -> BN -> add ->
ReLU as one cuDNN call each.

float32 convolutions run with TensorFloat-32 off (``ieee_fp32``): hal's float32 is IEEE float32.

fused_conv_bn_relu has two paths: in eval, ``cudnn_fused`` here: the batch norm folds into the
convolution (w * gamma / sqrt(var + eps), bias (b - mean) * gamma / sqrt(var + eps) + beta) and
``torch.cudnn_convolution_relu`` runs conv + bias + ReLU as one cuDNN call; folded weights are
cached per parameter set and rebuilt when any parameter changes (tensor identity, version
counter, hal's count of statistics writes: :class:`hal.plugin_sdk.fold.ParamCache`). In training (and
eval where the fused call cannot run) ``cudnn_triton`` from hal_triton.kernels: cuDNN convolution
(:func:`conv`), then the Triton batch-norm kernels. The Triton batch_norm kernels are registered
there too.

fused_conv_bn_add_relu (a ResNet block's tail): in eval ``cudnn_fused``, the same folded weights and
``torch.cudnn_convolution_add_relu`` (the residual is cuDNN's ``z``); otherwise torch's ops
(``torch``), and calls with autograd take the op's training decomposition.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from hal.plugin import Inputs
from hal.plugin_sdk.fold import FoldCache, folds_finitely
from hal_torch import conv as eager

from ._common import FLOATS, HALF, NOT_F64, ieee_fp32, kernel, not_float32

Pair = tuple[int, int]
Pads = tuple[int, int, int, int]


def _symmetric(padding: Pads) -> bool:
    top, bottom, left, right = padding
    return top == bottom and left == right


def conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: Pair, padding: Pads, dilation: Pair, groups: int) -> torch.Tensor:
    """F.conv2d (cuDNN) with canonical padding; an asymmetric one is applied with F.pad first."""
    top, bottom, left, right = padding
    with ieee_fp32(x.dtype):
        if _symmetric(padding):
            return F.conv2d(x, weight, bias, stride, (top, left), dilation, groups)
        return F.conv2d(F.pad(x, (left, right, top, bottom)), weight, bias, stride, 0, dilation, groups)


def conv_grads(
    g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: Pair, padding: Pads, dilation: Pair, groups: int,
    mask: Sequence[bool] = (True, True, True),
) -> tuple:
    """(grad_x, grad_weight, grad_bias) through aten.convolution_backward (cuDNN); None where
    ``mask`` is False (not computed)."""
    top, bottom, left, right = padding
    sym = _symmetric(padding)
    xp = x if sym else F.pad(x, (left, right, top, bottom))
    pad = [top, left] if sym else [0, 0]
    with ieee_fp32(x.dtype):
        gx, gw, gb = torch.ops.aten.convolution_backward(
            g, xp, weight, [int(weight.shape[0])], list(stride), pad, list(dilation), False, [0, 0], groups, list(mask)
        )
    if not sym and gx is not None:
        gx = gx[:, :, top : top + x.shape[2], left : left + x.shape[3]]
    return gx, gw, gb


@kernel("conv2d", name="cudnn", priority=10, dtypes=FLOATS, differentiable=not_float32)
def conv2d(x, weight, bias, stride, padding, dilation, groups):
    return conv(x, weight, bias, stride, padding, dilation, groups)


@kernel("conv2d_backward", name="cudnn", priority=10, dtypes=FLOATS)
def conv2d_backward(grad_out, x, weight, stride, padding, dilation, groups, output_mask):
    return conv_grads(grad_out, x, weight, stride, padding, dilation, groups, output_mask)


# --- batch_norm ---------------------------------------------------------------------------------


@kernel("batch_norm", name="cudnn", priority=10, dtypes=FLOATS, checks=[eager.torch_bn_eps], differentiable=True)
def batch_norm_cudnn(x, running_mean, running_var, weight, bias, training, momentum, eps):
    return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


# torch's own batch-norm kernels, the training forward keeping its statistics for the backward
# (hal_torch.conv.kept_batch_norm). Above the Triton kernels (20): measured on the H200 on 2026-12-01
# (benchmarks/host_training.py), a training forward costs 24-35 us of host time here against 91-148
# us for the Triton one (three launches and their planning), and in a graph the backward takes 58 us
# of device time at ResNet's (64, 64, 56, 56) channels_last against Triton's 117 us; Triton's
# forward is 54 us against 62 us there. Model steps are host-bound on this machine, so the host
# cost decides; the Triton and C++ kernels stay for conformance and hal.use(kernel=...).
_NATIVE_CHECKS = [eager.torch_bn_eps, eager.torch_bn_dtypes]


@kernel("batch_norm", name="native", priority=25, dtypes=FLOATS, checks=_NATIVE_CHECKS, differentiable=True)
def batch_norm_native(x, running_mean, running_var, weight, bias, training, momentum, eps):
    return eager.kept_batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


@kernel("batch_norm_backward", name="native", priority=25, dtypes=FLOATS, checks=_NATIVE_CHECKS)
def batch_norm_backward_native(grad_out, x, running_mean, running_var, weight, training, eps):
    return eager.kept_batch_norm_backward(grad_out, x, running_mean, running_var, weight, training, eps)


# --- fused_conv_bn_relu --------------------------------------------------------------------------


FOLDED = FoldCache()
#: the cuDNN call of each fused op's ``cudnn_fused`` kernel
_FUSED_CALLS = {"fused_conv_bn_relu": "cudnn_convolution_relu", "fused_conv_bn_add_relu": "cudnn_convolution_add_relu"}


def _eval_only(inputs: Inputs) -> list[str]:
    """Where cuDNN's fused calls (``cudnn_convolution_relu``, ``cudnn_convolution_add_relu``) run a
    folded batch norm: eval mode, one padding per side pair."""
    reasons = folds_finitely(inputs)
    if inputs["training"]:
        reasons.append("training mode (batch statistics cannot be folded into the weights)")
    if not _symmetric(inputs["padding"]):
        reasons.append(f"asymmetric padding ({_FUSED_CALLS[inputs.op.name]} takes one padding per side pair)")
    return reasons


def _training_only(inputs: Inputs) -> list[str]:
    return [] if inputs["training"] else ["eval mode: cudnn_fused folds the batch norm into one cuDNN call"]


# torch's convolution, batch norm and ReLU, first in training. Its ops are the kernels the op's
# training decomposition picks step by step (cuDNN convolution, torch's batch norm above Triton's,
# torch's ReLU: measured on the H200, see batch_norm_native above), so a call with autograd in half
# precision runs it as one entry into hal that torch's autograd records, instead of the composite and
# its three steps: the same autograd graph for about a quarter of hal's host time. float32 calls with
# autograd keep the decomposition (its cuDNN steps run their backward under the IEEE float32 guard).
# Inside a torch.compile graph its ops join the graph in training (hal.dispatch.Dispatcher.
# traced_alternative); it declines eval, which the ``graph`` kernel below serves in compiled graphs.
# In a step replayed from a CUDA graph (hal.graphs) it ranks last: host time is not paid there, and
# the decomposition with the C++ batch norm (hal_backend_cuda.cpp_kernels) made ResNet-50's graphed
# training step 15.47 -> 13.66 ms on the H200 (benchmarks/graph_ab.py, 2026-12-02).
# _training_only stays a check: it reads the batch norm's ``training`` argument (batch statistics or
# running ones), which is no context: eval-mode calls train (a frozen batch norm under autograd) and
# train-mode calls run without autograd, in every context.
@kernel("fused_conv_bn_relu", name="torch", contexts={"eager": 35, "training": 35, "compiled": 35, "graph": 1}, dtypes=FLOATS,
        checks=_NATIVE_CHECKS + [eager.padding_in_proportion, _training_only], differentiable=not_float32)
def fused_conv_bn_relu_torch(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    with ieee_fp32(x.dtype):
        return eager.fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training)


@kernel("fused_conv_bn_relu", name="cudnn_fused", priority=30, dtypes=NOT_F64, checks=[_eval_only])
def fused_conv_bn_relu_cudnn(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    w, b = FOLDED.get(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps)
    with ieee_fp32(x.dtype):
        return torch.cudnn_convolution_relu(x, w, b, stride, (padding[0], padding[2]), dilation, groups)


# --- kernels for compiled graphs only -------------------------------------------------------------
#
# In eval both fused ops run cuDNN's fused call on folded weights (``cudnn_fused``), which a
# torch.compile graph can only hold as an opaque node: a Python call per run, and no fusion with its
# neighbours. ResNet-50 inference, whose compiled graph held 49 such nodes, ran at 0.51x (float16)
# and 0.37x (bfloat16) of torch.compile alone with hal+compile, with 6.1 and 11.0 ms of host time a
# step against compile's 2.1 and 3.5 ms (hal bench --models on the H200, 2026-12-02, 194ccdc).
# With these kernels chosen where AOTAutograd builds the graph (720bf2d, hal.plugin.traced) it ran
# at 1.00x and 0.99x of compile in one call, with compile's own memory and error. In a trace
# these kernels give the graph torch's convolution, batch norm, residual add and ReLU in the inputs'
# half precision, as the compiled model without hal has them; Inductor fuses the batch norm, the add
# and the ReLU into one pass computed in float32 and rounded once. Eagerly they decline: there torch's
# ops would round between the steps (the float32 ``torch`` kernels exist for that).
# A check rather than ``contexts={"compiled": 2}``: a compiled step that hal.graphs.graphed warms up
# and captures is traced inside device_bound, a ``graph`` call, where these kernels must still join
# the graph (tests/core/test_backend_routing.py records it); ``graph: 2`` would also offer them to
# eager captures.


_GRAPH_CHECKS = _NATIVE_CHECKS + [eager.padding_in_proportion, eager.in_compiled_graphs_only("cudnn_fused or torch's float32 ops")]


@kernel("fused_conv_bn_relu", name="graph", priority=2, dtypes=HALF, checks=_GRAPH_CHECKS, differentiable=True)
def fused_conv_bn_relu_graph(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    return eager.fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training)


@kernel("fused_conv_bn_add_relu", name="graph", priority=2, dtypes=HALF, checks=_GRAPH_CHECKS, differentiable=True)
def fused_conv_bn_add_relu_graph(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation,
                                 groups, eps, momentum, training):
    return eager.fused_conv_bn_add_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding,
                                        dilation, groups, eps, momentum, training)


# --- fused_conv_bn_add_relu ------------------------------------------------------------------------
#
# In eval ``cudnn_fused``: the folded convolution, the residual (cuDNN's ``z``, scaled by alpha 1) and
# the folded bias summed and rectified in one cuDNN call. Training takes the op's decomposition (a
# call with autograd) or ``torch`` below; under torch.compile ``torch`` is the kernel of torch's ops.


_ADD_RELU_TORCH = eager.add_relu_in_float32(eager.fused_conv_bn_add_relu)


@kernel("fused_conv_bn_add_relu", name="torch", priority=1, dtypes=FLOATS, checks=_NATIVE_CHECKS + [eager.padding_in_proportion],
        differentiable=eager.recorded_in_float64_only)
def fused_conv_bn_add_relu_torch(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups,
                                 eps, momentum, training):
    """torch's ops; half precision in float32, rounded once (:func:`hal_torch.conv.add_relu_in_float32`)."""
    with ieee_fp32(eager.compute_dtype(x)):
        return _ADD_RELU_TORCH(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups,
                               eps, momentum, training)


@kernel("fused_conv_bn_add_relu", name="cudnn_fused", priority=30, dtypes=NOT_F64, checks=[_eval_only])
def fused_conv_bn_add_relu_cudnn(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups,
                                 eps, momentum, training):
    w, b = FOLDED.get(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps)
    with ieee_fp32(x.dtype):
        return torch.cudnn_convolution_add_relu(x, w, residual, 1.0, b, stride, (padding[0], padding[2]), dilation, groups)


_ADD_RELU_BACKWARD_TORCH = eager.add_relu_backward_in_float32(eager.fused_conv_bn_add_relu_backward)


@kernel("fused_conv_bn_add_relu_backward", name="torch", priority=1, dtypes=FLOATS, checks=_NATIVE_CHECKS + [eager.padding_in_proportion])
def fused_conv_bn_add_relu_backward_torch(grad_out, out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding,
                                          dilation, groups, eps, training):
    """Autograd through torch's ops, half precision in float32 (:mod:`hal_torch.conv`): only calls
    that force a kernel of the op under autograd reach the backward op (others train through the
    op's decomposition)."""
    with ieee_fp32(eager.compute_dtype(x)):
        return _ADD_RELU_BACKWARD_TORCH(grad_out, out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding,
                                        dilation, groups, eps, training)
