"""conv2d, batch_norm, conv -> batch-norm -> ReLU and conv -> batch-norm -> add -> ReLU, and their
gradients, in eager PyTorch.

Padding arrives canonical, (top, bottom, left, right). F.conv2d takes symmetric padding only, so an
asymmetric one (padding="same" with an even kernel) is applied with F.pad first, which is what
PyTorch itself does for such a "same" convolution.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from hal.plugin_sdk.kept import KeptForBackward
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
    """A check of kernels built on torch's batch norm: off the CPU they decline eval at eps = 0,
    where a zero running variance gives other infinities and NaN from torch's GPU formula than the
    op's (ops/conv.py: batch_norm); torch's CPU kernel computes the op's formula."""
    device = getattr(getattr(inputs["x"], "device", None), "type", "cpu")  # NumPy arrays are the CPU's
    if not inputs["training"] and inputs["eps"] == 0 and device != "cpu":
        return [f"eps = 0 in eval on {device} (torch's kernels there divide by a zero variance with another formula than the op's)"]
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
    same x (hal.plugin_sdk.kept), unless torch's autograd recorded the call (its node saves them itself)."""
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
    return _conv_bn_grads(F.relu, grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding,
                          dilation, groups, eps, training)


def fused_conv_bn_add_relu(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    bn_weight: Optional[torch.Tensor],
    bn_bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    residual: torch.Tensor,
    stride: Pair,
    padding: Pads,
    dilation: Pair,
    groups: int,
    eps: float,
    momentum: float,
    training: bool,
) -> torch.Tensor:
    y = conv2d(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    return F.relu(F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps) + residual)


def fused_conv_bn_add_relu_backward(
    grad_out: torch.Tensor,
    out: torch.Tensor,
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
    """(grad_x, grad_conv_weight, grad_conv_bias, grad_bn_weight, grad_bn_bias, grad_residual): the
    ReLU's gradient from the forward's result ``out`` (torch's own ReLU backward), which is
    grad_residual, then autograd through conv2d -> batch_norm."""
    g = torch.ops.aten.threshold_backward(grad_out, out, 0)
    grads = _conv_bn_grads(lambda y: y, g, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding,
                           dilation, groups, eps, training)
    return (*grads, g)


def _conv_bn_grads(
    tail: Callable[[torch.Tensor], torch.Tensor],
    grad: torch.Tensor,
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
    """Autograd's gradients of ``tail(batch_norm(conv2d(x)))`` for x and the five parameters (missing
    ones stand in as zeros and ones); a backward never updates the running statistics."""
    rm, rv = (None, None) if training else (running_mean, running_var)
    cout = conv_weight.shape[0]
    with torch.enable_grad():
        xg, wg = leaf(x), leaf(conv_weight)
        cb = leaf(conv_bias) if conv_bias is not None else filled_leaf(cout, 0.0, x)
        gamma = leaf(bn_weight) if bn_weight is not None else filled_leaf(cout, 1.0, x)
        beta = leaf(bn_bias) if bn_bias is not None else filled_leaf(cout, 0.0, x)
        y = F.batch_norm(conv2d(xg, wg, cb, stride, padding, dilation, groups), rm, rv, gamma, beta, training, 0.0, eps)
        return torch.autograd.grad(tail(y), (xg, wg, cb, gamma, beta), grad)


# --- half precision computed in float32 ---------------------------------------------------------


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision x, else x's own dtype."""
    return torch.float32 if x.dtype in _HALF else x.dtype


def _f32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.float()


def add_relu_in_float32(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A fused_conv_bn_add_relu kernel of torch's ops whose half-precision calls run in float32 and
    round once. torch's ops round the batch norm's output to half precision before the residual is
    added; where the two cancel (the sum is small beside them) that rounding is most of the sum's
    error, beyond the op's tolerance (eager PyTorch's own error; cuDNN's and oneDNN's fused calls
    round once). Running statistics of another dtype get the float32 update written back."""

    @functools.wraps(kernel)
    def run(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups, eps, momentum,
            training):
        if x.dtype not in _HALF:
            return kernel(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups, eps,
                          momentum, training)
        rm, rv = _f32(running_mean), _f32(running_var)
        out = kernel(x.float(), conv_weight.float(), _f32(conv_bias), _f32(bn_weight), _f32(bn_bias), rm, rv, residual.float(), stride, padding,
                     dilation, groups, eps, momentum, training)
        for dst, src in ((running_mean, rm), (running_var, rv)) if training else ():
            if dst is not None and dst is not src:
                dst.copy_(src)
        return out.to(x.dtype)

    return run


def in_compiled_graphs_only(eagerly: str) -> Callable[[Inputs], list[str]]:
    """The check of a backend's ``graph`` kernel of a fused convolution (torch's ops in the inputs'
    half precision): it runs only inside torch.compile graphs, where Inductor fuses what follows the
    convolution into one kernel that rounds once; ``eagerly`` names what does that in eager calls."""
    reason = ("runs only inside torch.compile graphs, where Inductor computes the batch norm, the residual add and the ReLU in float32 "
              f"and rounds once (eagerly {eagerly} do)")

    def check(inputs: Inputs) -> list[str]:
        return [] if inputs.traced else [reason]

    return check


def recorded_in_float64_only(inputs: Inputs) -> list[str]:
    """The ``differentiable`` check of an :func:`add_relu_in_float32` kernel: torch's autograd may
    record it for float64 calls only. A half-precision call runs its convolution and batch norm in
    float32 (its backward would too, and keep float32 copies of the activations); a float32 call's
    cuDNN steps need the IEEE float32 guard in the backward. Calls with autograd take the op's
    training decomposition instead, in the inputs' dtype (on the H200 the float32 kernel in ResNet-50's
    16 block tails made a bf16 training step 6 ms slower, 2026-12-02)."""
    return [] if inputs.dtype == "float64" else [f"{inputs.dtype}: computed in float32, which a recorded backward would repeat"]


def grad_dtypes(x: torch.Tensor, conv_weight: torch.Tensor, *params: Optional[torch.Tensor]) -> tuple[torch.dtype, ...]:
    """The dtypes of the gradients of x, the convolution's weight and the given parameters (conv_bias,
    bn_weight, bn_bias): each its input's, x's for a missing parameter."""
    return (x.dtype, conv_weight.dtype, *(x.dtype if p is None else p.dtype for p in params))


def half_in_float32(backward: Callable[..., tuple], tensors: Sequence[Optional[torch.Tensor]], static: tuple,
                    dtypes: Sequence[torch.dtype]) -> tuple:
    """``backward(*tensors in float32, *static)`` of a fused convolution op, each gradient rounded
    once to its dtype of ``dtypes``: a half-precision recomputation would move a ReLU mask where
    outputs are within a rounding of zero, and round the convolution output the batch norm's
    gradients read."""
    grads = backward(*(_f32(t) for t in tensors), *static)
    return tuple(g.to(d) for g, d in zip(grads, dtypes))


def add_relu_backward_in_float32(backward: Callable[..., tuple]) -> Callable[..., tuple]:
    """A fused_conv_bn_add_relu_backward kernel whose half-precision calls run in float32
    (:func:`half_in_float32`), grad_residual in x's dtype."""

    @functools.wraps(backward)
    def run(grad_out, out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training):
        tensors = (grad_out, out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var)
        static = (stride, padding, dilation, groups, eps, training)
        if x.dtype not in _HALF:
            return backward(*tensors, *static)
        return half_in_float32(backward, tensors, static, (*grad_dtypes(x, conv_weight, conv_bias, bn_weight, bn_bias), x.dtype))

    return run


__all__ = [
    "conv2d",
    "conv2d_backward",
    "batch_norm",
    "batch_norm_backward",
    "fused_conv_bn_relu",
    "fused_conv_bn_relu_backward",
    "fused_conv_bn_add_relu",
    "fused_conv_bn_add_relu_backward",
]

#: capability checks of these functions as kernels (hal_torch.table.CHECKS): torch would allocate the
#: padded input of a huge padding, far beyond the call's arrays.
CHECKS = {op: padding_in_proportion for op in ("conv2d", "conv2d_backward", "fused_conv_bn_relu", "fused_conv_bn_relu_backward",
                                               "fused_conv_bn_add_relu", "fused_conv_bn_add_relu_backward")}
