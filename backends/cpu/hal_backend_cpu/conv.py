"""conv2d, batch_norm, conv -> BN -> ReLU and conv -> BN -> add -> ReLU on torch's CPU kernels (oneDNN
convolutions).

fused_conv_bn_relu:

- eval, ``onednn``: the batch norm folds into the convolution (``w * gamma / sqrt(var + eps)``,
  bias ``(b - mean) * gamma / sqrt(var + eps) + beta``, computed in float32, float64 for float64,
  and rounded once), cached per parameter set (:class:`hal.plugin_sdk.fold.ParamCache`), and oneDNN runs
  convolution + bias as one primitive (``mkldnn._convolution_pointwise``), then an in-place ReLU:
  oneDNN's ReLU post-op turns NaN into 0, where torch's ReLU keeps NaN (torch 2.13's oneDNN);
- ``torch``: the same folded convolution then an in-place ReLU in eval, and in training the
  convolution, ``F.batch_norm`` with the batch statistics (running statistics updated in place) and
  an in-place ReLU; eval at eps = 0 runs unfolded, as training does, with the running statistics
  (folded weights would be infinite where the variance is 0; ``onednn`` declines it);
- ``unfused``: torch's convolution, batch norm and ReLU as three ops, for torch.compile graphs
  (never chosen by eager calls).

fused_conv_bn_add_relu has the same three kernels, the residual added before the ReLU: oneDNN's
primitive with a binary add post-op, then an in-place ReLU (eval, float32), the folded convolution or the
convolution and batch norm then an in-place add and ReLU (``torch``), and ``unfused``; half
precision computes in float32 and rounds once (the sum may cancel).

The backward ops call torch's backward kernels directly (``convolution_backward``,
``native_batch_norm_backward``), without building an autograd graph or, for conv2d, recomputing the
forward; the fused backward ops recompute the convolution output (the ops receive no saved
state).

float16 convolutions never run torch's float16 CPU convolution: they compute in float32 and round
once (:func:`convolve`, :func:`conv_grads`; see :data:`F16_IN_FLOAT32`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from hal.plugin_sdk.calls import needs_autograd
from hal.plugin import Inputs
from hal.plugin_sdk.fold import ParamCache, fold, folds_finitely
from hal_torch import conv as eager
from hal_torch.conv import (add_relu_backward_in_float32, add_relu_in_float32, compute_dtype, grad_dtypes, half_in_float32, padding_in_proportion,
                                    recorded_in_float64_only, torch_bn_eps)

from ._common import FLOATS, kernel, onednn_dtype

Pair = tuple[int, int]
Pads = tuple[int, int, int, int]
ONEDNN_DTYPES = ("float32", "bfloat16", "float16")


def _padded(x: torch.Tensor, padding: Pads) -> tuple[torch.Tensor, list[int]]:
    """x and the symmetric (h, w) padding to convolve it with: asymmetric padding applied by F.pad."""
    top, bottom, left, right = padding
    if top == bottom and left == right:
        return x, [top, left]
    return F.pad(x, (left, right, top, bottom)), [0, 0]


# --- float16 convolutions in float32 ------------------------------------------------------------
#
# Without AVX512-FP16 or AVX-NE-CONVERT (as on the project's EPYC VM) oneDNN takes no float16, and
# torch's float16 CPU convolution is its slow im2col path (slow_conv2d), whose backward rounds
# partial sums to float16: the weight gradient is accumulated image by image into a float16 buffer
# and the input gradient's taps are added back (col2im) in float16. Where the sums cancel, as a
# convolution's weight gradient does under a batch norm (the normalised output's gradient is
# orthogonal to it), that is several times the one final rounding. `hal conformance --model cnn
# --dtype float16` (seed 0) failed at call #10 (layers.1.0.conv3: x (3, 8, 2, 2), weight
# (32, 8, 1, 1)): grad conv_weight at 1.01x its budget, the call's own error 1.03x the op's
# tolerance. On that call's own inputs the float16 backward used 0.28 of conv2d_backward's
# tolerance where one rounding of the exact gradient uses 0.10 (calls #0-#10 of that run: the
# worse gradient 0.19-0.51 against 0.09-0.11; a 1x1 convolution of one image rounds once, of two
# images already not). So float16 computes in float32 throughout: the operands upcast (exactly),
# torch's float32 convolution (oneDNN), each result rounded to float16 once, as linear_backward
# does (gemm.py); call #10's own error is then 0.77 of the tolerance, the rest from the gradient
# the batch norm hands the convolution in float16. It is faster too: batch 8, 64 -> 64 channels,
# 3x3, 56x56, one thread on the EPYC VM (2026-12-08): forward 520 -> 9.4 ms (NCHW) and
# 84 -> 8.5 ms (channels_last), backward 337 -> 21 ms and 589 -> 18 ms. bfloat16 keeps oneDNN's
# bfloat16 primitives (float32 accumulation: they round once on those calls already). A CPU whose
# oneDNN takes float16 (AVX512-FP16) takes this detour too (none was measured).
F16_IN_FLOAT32 = torch.float16


def convolve(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: Pair, padding: Pads, dilation: Pair,
             groups: int) -> torch.Tensor:
    """torch's convolution; float16 in float32, rounded once (see :data:`F16_IN_FLOAT32`)."""
    if x.dtype != F16_IN_FLOAT32:
        return eager.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return eager.conv2d(x.float(), weight.float(), None if bias is None else bias.float(), stride, padding, dilation, groups).to(x.dtype)


def _recorded_unless_float16(inputs: Inputs) -> list[str]:
    """The ``differentiable`` check of conv2d's kernel: torch's autograd may record it except in
    float16, whose float32 computation a recorded backward would keep float32 copies of x and the
    weight for; hal's node keeps the float16 ones and its conv2d_backward computes in float32."""
    if inputs.dtype == "float16":
        return ["float16: computed in float32 (torch's float16 CPU convolution rounds its partial sums to float16), whose recorded "
                "backward would keep float32 copies of x and the weight; hal's conv2d_backward computes it in float32 from the float16 ones"]
    return []


def conv_grads(
    g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: Pair, padding: Pads, dilation: Pair, groups: int,
    mask: Sequence[bool] = (True, True, True),
) -> tuple:
    """(grad_x, grad_weight, grad_bias) from torch's convolution backward kernel (None where
    ``mask`` is False: not computed); float16 computed in float32 and each gradient rounded to
    float16 once (see :data:`F16_IN_FLOAT32`)."""
    if x.dtype == F16_IN_FLOAT32:
        grads = conv_grads(g.float(), x.float(), weight.float(), stride, padding, dilation, groups, mask)
        return tuple(None if t is None else t.to(F16_IN_FLOAT32) for t in grads)
    xp, pad = _padded(x, padding)
    gx, gw, gb = torch.ops.aten.convolution_backward(
        g, xp, weight, [int(weight.shape[0])], list(stride), pad, list(dilation), False, [0, 0], groups, list(mask)
    )
    if xp is not x and gx is not None:
        top, left = padding[0], padding[2]
        gx = gx[:, :, top : top + x.shape[2], left : left + x.shape[3]]
    return gx, gw, gb


kernel("conv2d", name="onednn", priority=20, dtypes=FLOATS, checks=[padding_in_proportion], differentiable=_recorded_unless_float16)(convolve)


@kernel("conv2d_backward", name="onednn", priority=20, dtypes=FLOATS, checks=[padding_in_proportion])
def conv2d_backward(grad_out, x, weight, stride, padding, dilation, groups, output_mask):
    return conv_grads(grad_out, x, weight, stride, padding, dilation, groups, output_mask)


# --- batch_norm --------------------------------------------------------------------------------
#
# torch's CPU batch norm computes the batch statistics of half-precision x with half-precision
# parameters in a way that loses the variance of data with a large mean (errors of several units in
# the last place at ResNet sizes; the weight gradient off by up to 1.5%); such calls run in float32
# and round once. Beside a float32 weight (autocast's batch norm: float32 parameters and running
# statistics) torch's kernels accumulate in float32 and are as accurate as that detour, forward and
# backward (2026-12-01: bf16 and fp16 x of mean 0, 30 and 300, both layouts, one rounding of the
# float64 result), so they run it directly: no float32 copies of x, its gradient and the output.

HALF = (torch.float16, torch.bfloat16)


def float32_beside_half(x: torch.Tensor, weight: Optional[torch.Tensor], *others: Optional[torch.Tensor]) -> bool:
    """Half-precision x with a float32 weight, and the other parameters and statistics float32 or
    absent: torch's mixed-precision batch norm, accurate as it is."""
    fp32 = lambda t: t is None or t.dtype == torch.float32  # noqa: E731
    return x.dtype in HALF and weight is not None and weight.dtype == torch.float32 and all(fp32(t) for t in others)


def _f32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.float()


def bn_forward(x, running_mean, running_var, weight, bias, training: bool, momentum: float, eps: float) -> torch.Tensor:
    """torch's batch norm; half-precision training, and half x beside float32 parameters or
    statistics, in float32 (the running statistics written back). In training the batch statistics
    are kept for the backward of this x (``hal_torch.conv.KEPT``)."""
    if x.dtype not in HALF:  # float32 and float64 (beside parameters of any dtype): torch's kernel as it is
        return eager.kept_batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    mixed = any(t is not None and t.dtype != x.dtype for t in (running_mean, running_var, weight, bias))
    if not (training or mixed) or float32_beside_half(x, weight, bias, running_mean, running_var):
        return eager.kept_batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    rm, rv = _f32(running_mean), _f32(running_var)
    if training:
        out, mean, invstd = torch.native_batch_norm(x.float(), _f32(weight), _f32(bias), rm, rv, True, momentum, eps)
        eager.KEPT.keep(x, eps, (mean, invstd), out)
    else:
        out = F.batch_norm(x.float(), rm, rv, _f32(weight), _f32(bias), training, momentum, eps)
    for dst, src in ((running_mean, rm), (running_var, rv)) if training else ():
        if dst is not None and dst is not src:
            dst.copy_(src)
    return out.to(x.dtype)


@kernel("batch_norm", name="torch", priority=20, dtypes=FLOATS, checks=[torch_bn_eps], differentiable=True)
def batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
    return bn_forward(x, running_mean, running_var, weight, bias, training, momentum, eps)


def _batch_stats(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, 1/std) of x's channels: for float32 and float64 torch's statistics kernel alone
    (``batch_norm_update_stats``, biased variance), which writes no normalised output
    (channels_last (8, 64, 56, 56) float32: 0.13 against 0.28 ms, NCHW 0.92 against 1.01 ms, 2-core
    EPYC VM, 2026-12-02); for half x the forward kernel, whose statistics come in float32."""
    if x.dtype in (torch.float32, torch.float64):
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
        return mean, torch.rsqrt(var + eps)
    return torch.native_batch_norm(x, weight, None, None, None, True, 0.0, eps)[1:]


def bn_grads(g: torch.Tensor, x: torch.Tensor, running_mean, running_var, weight, bias, training: bool, eps: float) -> tuple:
    """(grad_x, grad_weight, grad_bias) from torch's batch-norm backward kernel, the parameter
    gradients in their parameter's dtype (x's for a missing one). In training the batch statistics
    are those the forward kept for this x, else recomputed (float32 for half x); in eval the
    running statistics are constants."""
    dtype = x.dtype
    if training:
        kept = eager.KEPT.take(x, eps)
        w = weight
        if dtype in HALF and not float32_beside_half(x, weight):
            g, x, w = g.float(), x.float(), _f32(weight)
        mean, invstd = kept if kept is not None else _batch_stats(x, w, eps)
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(g, x, w, None, None, mean, invstd, True, eps, [True, True, True])
    else:  # one dtype for the kernel: float32 for half x (its statistics may be float32 beside it)
        acc = torch.float32 if dtype in HALF else dtype
        cast = [None if t is None else t.to(acc) for t in (g, x, weight, running_mean, running_var)]
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(*cast, None, None, False, eps, [True, True, True])
    return gx.to(dtype), *param_grads(gw, gb, weight, bias, dtype)


def param_grads(gw: torch.Tensor, gb: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], dtype: torch.dtype) -> tuple:
    """Parameter gradients in their parameter's dtype (``dtype`` for a missing parameter)."""
    return gw.to(dtype if weight is None else weight.dtype), gb.to(dtype if bias is None else bias.dtype)


@kernel("batch_norm_backward", name="torch", priority=20, dtypes=FLOATS, checks=[torch_bn_eps])
def batch_norm_backward(grad_out, x, running_mean, running_var, weight, training, eps):
    return bn_grads(grad_out, x, running_mean, running_var, weight, weight, training, eps)


# --- fused_conv_bn_relu --------------------------------------------------------------------------


FOLDED = ParamCache(fold)


def folded(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps, dtype: Optional[torch.dtype] = None):
    """The folded (weight, bias) in ``dtype`` (default x's), the weight in the convolution weight's
    own memory format."""
    channels_last = conv_weight.is_contiguous(memory_format=torch.channels_last) and not conv_weight.is_contiguous()
    return FOLDED.get((conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var), (eps, dtype or x.dtype, channels_last))


def _eval_only(inputs: Inputs) -> list[str]:
    return ["training mode (batch statistics cannot be folded into the weights)"] if inputs["training"] else []


@kernel("fused_conv_bn_relu", name="onednn", priority=30, dtypes=ONEDNN_DTYPES, checks=[onednn_dtype, _eval_only, folds_finitely, padding_in_proportion])
def fused_conv_bn_relu_onednn(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    w, b = folded(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps)
    xp, pad = _padded(x, padding)
    y = torch.ops.mkldnn._convolution_pointwise(xp, w, b, pad, list(stride), list(dilation), groups, "none", [], "")
    return y.relu_()  # not the ReLU post-op, which turns NaN into 0 (module docstring)


def _recorded_in_training(inputs: Inputs) -> list[str]:
    """The ``differentiable`` check of the fused ``torch`` kernels: in training their ops are those of
    the op's training decomposition (torch's convolution, bn_forward, ReLU), so a call with autograd
    runs as one entry into hal that torch's autograd records, in place of the composite and its
    steps; in eval they convolve with folded weights, which carry no gradient. Not in float16: the
    convolution computes in float32 (:func:`convolve`), and a recorded backward would keep float32
    copies of x and the weight; the training decomposition's conv2d keeps the float16 ones in hal's
    node, whose conv2d_backward computes in float32 too."""
    if not inputs["training"]:
        return ["eval: the convolution's weights are folded (no gradient reaches the parameters)"]
    return _recorded_unless_float16(inputs)


@kernel("fused_conv_bn_relu", name="torch", priority=20, dtypes=FLOATS, checks=[torch_bn_eps, padding_in_proportion],
        differentiable=_recorded_in_training)
def fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    if not training and eps != 0:  # eps = 0: not folded (folds_finitely)
        w, b = folded(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps)
        return convolve(x, w, b, stride, padding, dilation, groups).relu_()
    y = convolve(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    return bn_forward(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps).relu_()


# torch's convolution, batch norm (bn_forward: half precision as batch_norm/torch) and ReLU, below
# every other kernel: eager calls never choose it (the kernels above fold or fuse); inside a
# torch.compile graph, where an opaque node would stop Inductor from fusing the batch norm and the
# ReLU, the graph takes its ops in (hal.dispatch.Dispatcher.traced_alternative).
@kernel("fused_conv_bn_relu", name="unfused", priority=1, dtypes=FLOATS, checks=[torch_bn_eps, padding_in_proportion], differentiable=True)
def fused_conv_bn_relu_unfused(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    y = eager.conv2d(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    return F.relu(bn_forward(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps))


def _conv_bn_grads(gz, x, y, conv_weight, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training) -> tuple:
    """(grad_x, grad_conv_weight, grad_conv_bias, grad_bn_weight, grad_bn_bias) from gz, the gradient
    at the output of the batch norm of the convolution output y. In training the convolution's bias
    is absorbed by the batch mean: its gradient is exactly zero."""
    dy, g_gamma, g_beta = bn_grads(gz, y, running_mean, running_var, bn_weight, bn_bias, training, eps)
    gx, gw, gb = conv_grads(dy, x, conv_weight, stride, padding, dilation, groups)
    if training:
        gb = torch.zeros_like(gb)
    return gx, gw, gb, g_gamma, g_beta


def _recomputed_conv(x, conv_weight, conv_bias, stride, padding, dilation, groups, training) -> torch.Tensor:
    """The convolution output of a backward's forward, without its bias in training (the batch mean
    absorbs it)."""
    return eager.conv2d(x, conv_weight, None if training else conv_bias, stride, padding, dilation, groups)


@kernel("fused_conv_bn_relu_backward", name="torch", priority=20, dtypes=FLOATS, checks=[torch_bn_eps, padding_in_proportion])
def fused_conv_bn_relu_backward(grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training):
    """The convolution output is recomputed, the ReLU mask from the batch-norm output. Half
    precision runs in float32 and rounds each gradient once."""
    if x.dtype in HALF:
        tensors = (grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var)
        return half_in_float32(fused_conv_bn_relu_backward, tensors, (stride, padding, dilation, groups, eps, training),
                               grad_dtypes(x, conv_weight, conv_bias, bn_weight, bn_bias))
    y = _recomputed_conv(x, conv_weight, conv_bias, stride, padding, dilation, groups, training)
    stats = (None, None) if training else (running_mean, running_var)  # a backward never updates them
    out = bn_forward(y, *stats, bn_weight, bn_bias, training, 0.0, eps)
    gz = grad_out.masked_fill(out <= 0, 0)
    return _conv_bn_grads(gz, x, y, conv_weight, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training)


# --- fused_conv_bn_add_relu: relu(batch_norm(conv2d(x)) + residual) ---------------------------------
#
# oneDNN's convolution with a binary "add" post-op and a ReLU runs the eval call as one primitive
# (accumulated in float32, rounded once), in float32, and in bfloat16 for channels_last x and
# residual: on torch 2.13 its bfloat16 form fails an internal assert for NCHW inputs, and its float16
# form needs AVX-NE-CONVERT or AVX512-FP16 (checked on this project's CI CPU, 2026-12-02). Other half
# precision calls take ``torch``: the convolution with weights folded in float32, the add and the ReLU
# in float32, rounded once. At a ResNet tail (16, 64 -> 256, 16x16) in bfloat16: 237 us here against
# 2.7 ms for that float32 path and 341 us for eager's three bfloat16 ops (2026-12-02).


def _bf16_channels_last(inputs: Inputs) -> list[str]:
    if inputs.dtype != "bfloat16":
        return []
    if not all(inputs[n].is_contiguous(memory_format=torch.channels_last) for n in ("x", "residual")):
        return ["bfloat16 x or residual not channels_last (oneDNN's bfloat16 add post-op asserts on NCHW in torch 2.13)"]
    return []


@kernel("fused_conv_bn_add_relu", name="onednn", priority=30, dtypes=("float32", "bfloat16"),
        checks=[onednn_dtype, _eval_only, folds_finitely, padding_in_proportion, _bf16_channels_last])
def fused_conv_bn_add_relu_onednn(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups, eps,
                                  momentum, training):
    w, b = folded(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps)
    xp, pad = _padded(x, padding)
    y = torch.ops.mkldnn._convolution_pointwise.binary(xp, residual, w, b, pad, list(stride), list(dilation), groups, "add", 1.0, None, [], None)
    return y.relu_()  # not the ReLU post-op, which turns NaN into 0 (module docstring)


@kernel("fused_conv_bn_add_relu", name="torch", priority=20, dtypes=FLOATS, checks=[torch_bn_eps, padding_in_proportion])
def fused_conv_bn_add_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups, eps,
                           momentum, training):
    """Eval: the folded convolution, then the add and the ReLU in place on its result; half
    precision convolves in float32 with weights folded in float32 and rounds once (see
    :func:`hal_torch.conv.add_relu_in_float32`). Training, and eval at eps = 0: :func:`_unfolded`."""
    if training or eps == 0:  # eps = 0: not folded (folds_finitely)
        return _unfolded(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups, eps,
                         momentum, training)
    acc = compute_dtype(x)
    w, b = folded(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps, acc)
    return eager.conv2d(x.to(acc), w, b, stride, padding, dilation, groups).add_(residual).relu_().to(x.dtype)


@add_relu_in_float32
def _unfolded(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups, eps, momentum,
              training):
    """Convolution, torch's batch norm (the batch statistics in training), then the add and the ReLU in place."""
    y = eager.conv2d(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    return bn_forward(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps).add_(residual).relu_()


# torch's ops for torch.compile graphs, as fused_conv_bn_relu's ``unfused`` (never chosen by eager calls)
@kernel("fused_conv_bn_add_relu", name="unfused", priority=1, dtypes=FLOATS, checks=[torch_bn_eps, padding_in_proportion],
        differentiable=recorded_in_float64_only)
@add_relu_in_float32
def fused_conv_bn_add_relu_unfused(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups,
                                   eps, momentum, training):
    y = eager.conv2d(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    return F.relu(bn_forward(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps) + residual)


def _untrained(inputs: Inputs) -> list[str]:
    return ["a call with autograd takes the op's training decomposition (its steps join the graph one by one)"] if needs_autograd(inputs.args) else []


# half precision inference inside torch.compile graphs: torch's ops in the inputs' dtype, the
# convolution included (``unfused`` convolves in float32); Inductor fuses the batch norm, the add and
# the ReLU into one kernel that computes in float32 and rounds once, as the op asks. Before, each
# block tail of a bfloat16 ResNet's inference graph stayed an opaque oneDNN node (CPU size, interleaved:
# hal+compile 0.78x of torch.compile before, 0.95x after, 2026-12-03).
kernel("fused_conv_bn_add_relu", name="graph", priority=2, dtypes=("bfloat16", "float16"),
       checks=[torch_bn_eps, padding_in_proportion, eager.in_compiled_graphs_only("oneDNN's fused call or the torch kernel in float32")],
       differentiable=_untrained)(eager.fused_conv_bn_add_relu)


@kernel("fused_conv_bn_add_relu_backward", name="torch", priority=20, dtypes=FLOATS, checks=[torch_bn_eps, padding_in_proportion])
@add_relu_backward_in_float32
def fused_conv_bn_add_relu_backward(grad_out, out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation,
                                    groups, eps, training):
    """The ReLU's gradient from the forward's result (torch's ReLU backward), which is grad_residual;
    the convolution output is recomputed for the batch norm's gradients. Half precision in float32,
    as fused_conv_bn_relu_backward."""
    gz = torch.ops.aten.threshold_backward(grad_out, out, 0)
    y = _recomputed_conv(x, conv_weight, conv_bias, stride, padding, dilation, groups, training)
    grads = _conv_bn_grads(gz, x, y, conv_weight, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training)
    return (*grads, gz)
