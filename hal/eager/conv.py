"""conv2d, batch_norm and conv -> batch-norm -> ReLU, and their gradients, in eager PyTorch.

Padding arrives canonical, (top, bottom, left, right). F.conv2d takes symmetric padding only, so an
asymmetric one (padding="same" with an even kernel) is applied with F.pad first, which is what
PyTorch itself does for such a "same" convolution.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from hal.kept import KeptForBackward
from hal.plugin import Inputs

from .elementwise import detached, filled_leaf, leaf, masked_grads

Pair = tuple[int, int]
Pads = tuple[int, int, int, int]


#: how much larger than its input and output a padded input may be before these kernels decline
#: (torch's convolutions materialise it; cpu_ref computes only the taps that land on the input)
PADDING_RATIO = 4


def padding_in_proportion(inputs: Inputs) -> list[str]:
    """A check: the padded input torch would build stays within PADDING_RATIO of the call's own
    arrays (huge padding or dilation around a small input would allocate far beyond them)."""
    x = inputs["x"]
    top, bottom, left, right = inputs["padding"]
    n, c, h, w = (int(s) for s in x.shape)
    padded = n * c * (h + top + bottom) * (w + left + right)
    own = sum(int(a.numel()) for a in inputs.args if isinstance(a, torch.Tensor))
    if padded > PADDING_RATIO * own + (1 << 20):
        return [f"the padding makes a padded input of {padded} elements, {padded // max(1, own)}x the call's arrays "
                "(torch would allocate it; cpu_ref computes only the taps that land on the input)"]
    columns = _im2col_elements(inputs, n, c, h + top + bottom, w + left + right)
    if columns > WORKSPACE_RATIO * own + (1 << 24):
        return [f"torch's {x.dtype} CPU convolution would unfold the input into {columns} elements, "
                f"{columns // max(1, own)}x the call's arrays (cpu_ref computes it in proportion to them)"]
    return []


#: how much larger than the call's arrays the unfolded input (im2col) of torch's CPU convolutions
#: without oneDNN may be before these kernels decline: a 3x3 convolution unfolds to 9x its input
WORKSPACE_RATIO = 16
#: the CPU dtypes whose convolutions unfold the whole batch (slow_conv2d, slow_conv_dilated2d): float64
#: always, float16 where oneDNN lacks AVX512-FP16 (as on the project's CI machine)
_UNFOLDED = (torch.float64, torch.float16)


def _im2col_elements(inputs: Inputs, n: int, c: int, hp: int, wp: int) -> int:
    """Elements of the unfolded input torch's CPU convolution builds for these inputs (0 where it
    builds none: other devices, oneDNN's dtypes): batch x C/groups*kh*kw x out_h*out_w."""
    x = inputs["x"]
    if x.device.type != "cpu" or x.dtype not in _UNFOLDED:
        return 0
    weight = inputs["weight"] if "weight" in inputs.op.param_names else inputs["conv_weight"]
    kh, kw = int(weight.shape[2]), int(weight.shape[3])
    (sh, sw), (dh, dw) = inputs["stride"], inputs["dilation"]
    out_h, out_w = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    return n * (c // max(1, int(inputs["groups"]))) * kh * kw * max(0, out_h) * max(0, out_w)


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: Pair, padding: Pads, dilation: Pair, groups: int) -> torch.Tensor:
    top, bottom, left, right = padding
    if top == bottom and left == right:
        return F.conv2d(x, weight, bias, stride, (top, left), dilation, groups)
    return F.conv2d(F.pad(x, (left, right, top, bottom)), weight, bias, stride, 0, dilation, groups)


def conv2d_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: Pair, padding: Pads, dilation: Pair, groups: int,
    output_mask: Sequence[bool] = (True, True, True),
) -> tuple:
    want_x, want_w, want_b = output_mask
    with torch.enable_grad():
        xg = leaf(x) if want_x else detached(x)
        wg = leaf(weight) if want_w else detached(weight)
        b = filled_leaf(weight.shape[0], 0.0, x) if want_b else None
        return masked_grads(lambda: conv2d(xg, wg, b, stride, padding, dilation, groups), (xg, wg, b), output_mask, grad_out)


def torch_bn_eps(inputs: Inputs) -> list[str]:
    """A check of kernels built on torch's batch norm: its kernels refuse eps = 0 in training (the
    op allows it)."""
    if inputs["training"] and inputs["eps"] == 0:
        return ["eps = 0 in training (torch's batch-norm kernels require eps > 0 there)"]
    return []


def batch_norm(
    x: torch.Tensor,
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    training: bool,
    momentum: float,
    eps: float,
) -> torch.Tensor:
    return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


def batch_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    training: bool,
    eps: float,
) -> tuple:
    """(grad_x, grad_weight, grad_bias) by autograd; in training the running stats are not passed
    (they are not read, and must not be updated by a backward)."""
    rm, rv = (None, None) if training else (running_mean, running_var)
    if x.shape[1] == 0:  # no channels: F.batch_norm cannot take the 0-element weight to differentiate
        p = x if weight is None else weight
        return torch.zeros_like(x), p.new_zeros((0,)), p.new_zeros((0,))
    with torch.enable_grad():
        xg = leaf(x)
        w = leaf(weight) if weight is not None else filled_leaf(x.shape[1], 1.0, x)
        b = torch.zeros_like(w, requires_grad=True)  # in the weight's dtype, as a real bias would be
        return torch.autograd.grad(F.batch_norm(xg, rm, rv, w, b, training, 0.0, eps), (xg, w, b), grad_out)


#: the batch statistics (mean, 1/std) of kept_batch_norm's training forwards, for the backward of the same x
KEPT = KeptForBackward()
_HALF = (torch.float16, torch.bfloat16)


def kept_batch_norm(
    x: torch.Tensor,
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    training: bool,
    momentum: float,
    eps: float,
) -> torch.Tensor:
    """torch's own batch norm (``torch.native_batch_norm``: torch's kernels, as an eager model runs
    them); in training its batch statistics are kept for :func:`kept_batch_norm_backward` of the
    same x (hal.kept), unless torch's autograd recorded the call (its node saves them itself)."""
    if not training:
        return batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    out, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)
    KEPT.keep(x, eps, (mean, invstd), out)
    return out


def kept_batch_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    training: bool,
    eps: float,
) -> tuple:
    """(grad_x, grad_weight, grad_bias) by torch's batch-norm backward kernel, from the statistics
    :func:`kept_batch_norm` kept for this x (else recomputed; in eval the running ones). The
    parameter gradients come in the weight's dtype (x's without a weight)."""
    acc = torch.float32 if x.dtype in _HALF else x.dtype
    if training:
        kept = KEPT.take(x, eps)
        mean, invstd = kept if kept is not None else torch.native_batch_norm(x, weight, None, None, None, True, 0.0, eps)[1:]
        stats = (None, None)
    else:  # the running statistics, also as the "saved" ones (torch's CUDA kernel for 2-D x requires them)
        mean, invstd = running_mean.to(acc), torch.rsqrt(running_var.to(acc) + eps)
        stats = (running_mean, running_var)
    w = weight if weight is not None else x.new_ones(x.shape[1], dtype=acc)
    gx, gw, gb = torch.ops.aten.native_batch_norm_backward(grad_out, x, w, *stats, mean, invstd, training, eps, [True, True, True])
    if weight is None:
        gw, gb = gw.to(x.dtype), gb.to(x.dtype)
    return gx, gw, gb


def torch_bn_dtypes(inputs: Inputs) -> list[str]:
    """A check of kernels built on torch's batch norm: its parameters and statistics have x's
    dtype, or all float32 beside half-precision x (torch's mixed-precision batch norm)."""
    x = inputs["x"]
    names = [n for n in ("running_mean", "running_var", "weight", "bias") if n in inputs.op.param_names]
    params = [p for p in map(inputs.__getitem__, names) if p is not None]
    dtypes = {p.dtype for p in params}
    if dtypes <= {x.dtype} or (x.dtype in _HALF and dtypes == {torch.float32}):
        return []
    return [f"parameters in {sorted(str(d) for d in dtypes)} beside {x.dtype} x (torch's batch norm takes x's dtype, or float32 with half x)"]


def fused_conv_bn_relu(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    bn_weight: Optional[torch.Tensor],
    bn_bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    stride: Pair,
    padding: Pads,
    dilation: Pair,
    groups: int,
    eps: float,
    momentum: float,
    training: bool,
) -> torch.Tensor:
    y = conv2d(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    return F.relu(F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps))


def fused_conv_bn_relu_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    bn_weight: Optional[torch.Tensor],
    bn_bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    stride: Pair,
    padding: Pads,
    dilation: Pair,
    groups: int,
    eps: float,
    training: bool,
) -> tuple:
    """(grad_x, grad_conv_weight, grad_conv_bias, grad_bn_weight, grad_bn_bias) by autograd."""
    rm, rv = (None, None) if training else (running_mean, running_var)
    cout = conv_weight.shape[0]
    with torch.enable_grad():
        xg, wg = leaf(x), leaf(conv_weight)
        cb = leaf(conv_bias) if conv_bias is not None else filled_leaf(cout, 0.0, x)
        gamma = leaf(bn_weight) if bn_weight is not None else filled_leaf(cout, 1.0, x)
        beta = leaf(bn_bias) if bn_bias is not None else filled_leaf(cout, 0.0, x)
        y = fused_conv_bn_relu(xg, wg, cb, gamma, beta, rm, rv, stride, padding, dilation, groups, eps, 0.0, training)
        return torch.autograd.grad(y, (xg, wg, cb, gamma, beta), grad_out)


__all__ = [
    "conv2d",
    "conv2d_backward",
    "batch_norm",
    "batch_norm_backward",
    "fused_conv_bn_relu",
    "fused_conv_bn_relu_backward",
]

#: capability checks of these functions as kernels of the eager backend: torch would allocate the
#: padded input of a huge padding, far beyond the call's arrays.
CHECKS = {op: padding_in_proportion for op in ("conv2d", "conv2d_backward", "fused_conv_bn_relu", "fused_conv_bn_relu_backward")}
