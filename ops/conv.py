"""Convolution and batch normalisation, and their vertical fusions conv -> batch-norm -> ReLU and
conv -> batch-norm -> add residual -> ReLU (a ResNet block's head and tail)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from hal.arrays import FLOAT_DTYPES, dtype_name
from hal.registry import Autocast, declare
from hal.types import IntPair, OptionalTensor, OutputMask, Padding, Tensor

from . import _checks as c
from . import _empty as e
from ._fake import conv_out, like, param_like
from ._tolerances import REDUCTION

#: where this family's ops stand among hal's (hal.ops: the order of API.md and docs/ops.md)
ORDER = 10

TensorTuple = tuple  # backward ops return a tuple of tensors


def _conv_k(a: Mapping[str, Any]) -> int:
    w = a.get("weight", a.get("conv_weight"))
    return int(w.shape[1] * w.shape[2] * w.shape[3])


def _conv_backward_k(a: Mapping[str, Any]) -> int:
    """Longest sum of a convolution's gradients: grad_weight and grad_bias sum over the N * Ho * Wo
    output positions, grad_x over (out_channels / groups) * kH * kW taps; a recomputed forward
    sums over the forward's K."""
    w = a.get("weight", a.get("conv_weight"))
    cout, _, kh, kw = (int(s) for s in w.shape)
    positions = c.numel(a["grad_out"]) // cout
    return max(positions, cout // int(a["groups"]) * kh * kw, _conv_k(a))


def _spatial_count(x: Any) -> int:
    """Elements per channel of an (N, C, ...) array or shape: the reduction length of batch statistics."""
    n = 1
    for i, s in enumerate(getattr(x, "shape", x)):
        if i != 1:
            n *= int(s)
    return n


def conv_geometry(
    op: str,
    x: Any,
    weight: Any,
    x_name: str,
    w_name: str,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: Any,
) -> dict[str, Any]:
    """Check a 2-D convolution's inputs and return canonical stride, padding (top, bottom, left,
    right), dilation and groups, plus the output shape under ``"out_shape"``."""
    c.rank(op, x_name, x, (3, 4), "(N, C, H, W) or (C, H, W)")
    if any(int(s) == 0 for s in x.shape[-2:]):
        raise c.fail(op, x_name, "an array of height and width >= 1 (as torch, only the batch and the channels may be empty)", x)
    c.float_dtype(op, x_name, x)
    c.rank(op, w_name, weight, (4,), "(out_channels, in_channels / groups, kH, kW)")
    if int(weight.shape[0]) == 0 or int(weight.shape[2]) == 0 or int(weight.shape[3]) == 0:
        raise c.fail(op, w_name, "an array with out_channels, kH and kW >= 1 (as torch)", weight)
    c.same_dtype(op, w_name, weight, x_name, x)
    g = c.integer(op, "groups", groups, low=1)
    sh, sw = c.int_pair(op, "stride", stride)
    dh, dw = c.int_pair(op, "dilation", dilation)
    cin = int(x.shape[-3])
    cout, cin_g, kh, kw = c.shape_of(weight)
    if cin % g or cout % g:
        raise c.fail(op, "groups", f"a divisor of in_channels ({cin}) and out_channels ({cout})", repr(g))
    if cin_g * g != cin:
        raise c.fail(op, w_name, f"of shape ({cout}, {cin // g}, kH, kW) for {cin} input channels and groups={g}", weight)
    if isinstance(padding, str):
        mode = c.choice(op, "padding", padding, ("same", "valid"))
        if mode == "valid":
            pads = (0, 0, 0, 0)
        else:
            if (sh, sw) != (1, 1):
                raise c.fail(op, "padding", "an int or pair when stride != 1 ('same' needs stride 1, as in torch)", repr(padding))
            th, tw = dh * (kh - 1), dw * (kw - 1)
            pads = (th // 2, th - th // 2, tw // 2, tw - tw // 2)
    elif isinstance(padding, (tuple, list)) and len(padding) == 4:
        pads = tuple(c.integer(op, "padding", p, low=0) for p in padding)
    else:
        ph, pw = c.int_pair(op, "padding", padding, low=0)
        pads = (ph, ph, pw, pw)
    batch = (int(x.shape[0]),) if x.ndim == 4 else ()
    out_shape = batch + conv_out_shape(c.shape_of(x)[-3:], c.shape_of(weight), (sh, sw), pads, (dh, dw))
    if out_shape[-2] < 1 or out_shape[-1] < 1:
        raise c.fail(
            op,
            x_name,
            f"at least as large as the dilated kernel ({dh * (kh - 1) + 1}x{dw * (kw - 1) + 1}) after padding",
            x,
        )
    c.result_fits(op, "padding" if any(pads) else x_name, out_shape, c.itemsize(x), "convolution output")
    return {"stride": (sh, sw), "padding": pads, "dilation": (dh, dw), "groups": g, "out_shape": out_shape}


def conv_out_shape(chw: tuple[int, ...], weight_shape: tuple[int, ...], stride, padding, dilation) -> tuple[int, int, int]:
    """(channels, Ho, Wo) of a convolution of a (C, H, W) input with canonical stride, padding and
    dilation. As torch, an input with zero channels gives an output with zero channels."""
    (sh, sw), (top, bottom, left, right), (dh, dw) = stride, padding, dilation
    cin, h, w = (int(s) for s in chw)
    kh, kw = int(weight_shape[2]), int(weight_shape[3])
    ho = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
    wo = (w + left + right - dw * (kw - 1) - 1) // sw + 1
    return (int(weight_shape[0]) if cin else 0, ho, wo)


def check_per_channel(op: str, name: str, a: Any, channels: Optional[int], x_name: str, x: Any) -> None:
    """A (C,) parameter of a normalisation: x's dtype, or float32 beside half-precision x. With
    ``channels`` None (an empty 1-D x: :func:`bn_channels`) of any length, as torch."""
    if a is None:
        return
    c.rank(op, name, a, (1,), "of one dimension" if channels is None else f"of length {channels}")
    if channels is not None:
        c.shape_is(op, name, a, (channels,), "(one value per channel)")
    allowed = {dtype_name(x)} | ({"float32"} if dtype_name(x) in ("float16", "bfloat16") else set())
    c.dtype_in(op, name, a, sorted(allowed), f"the dtype of '{x_name}', or float32 beside half precision")


def bn_channels(op: str, x: Any) -> Optional[int]:
    """The channel count of a batch norm's x (N, C, ...); None for an empty 1-D x, which
    ``F.batch_norm`` takes too (it normalises nothing and reads no parameter, whatever their length)."""
    if x.ndim == 1 and int(x.shape[0]) == 0:
        return None
    c.min_rank(op, "x", x, 2, "(N, C, ...), or an empty 1-D array")
    return int(x.shape[1])


def check_bn_options(
    op: str, per_channel: int, running_mean: Any, running_var: Any, training: Any, momentum: Any, eps: Any, write: bool = True
) -> None:
    """Batch norm's options; ``per_channel`` is the count of normalised values per channel (batch
    statistics need more than one); ``write``: the op updates the running statistics in training
    (the forward ops; backward ops only read them)."""
    c.boolean(op, "training", training)
    c.number(op, "momentum", momentum, low=0.0, high=1.0)
    # eps >= 0 in eval, where a zero running variance then divides by zero (batch_norm's docstring)
    if c.number(op, "eps", eps, low=0.0) == 0 and training:
        raise c.fail(op, "eps", "a number > 0 when training (as F.batch_norm: a channel of equal values has a batch variance of 0)", repr(eps))
    if (running_mean is None) != (running_var is None):
        raise c.fail(op, "running_var" if running_var is None else "running_mean", "given together with its twin (both or neither)", "only one of the two")
    if running_mean is None and not training:
        raise c.fail(op, "running_mean", "an array when training=False (eval mode normalises with the running statistics)", "None")
    if training and running_mean is not None and write:
        c.writable(op, "running_mean", running_mean)
        c.writable(op, "running_var", running_var)
    if training and per_channel == 1:  # as torch: none (an empty batch) is fine, one is not
        raise c.fail(op, "x", "large enough for more than one normalised value per channel when training (batch statistics)", f"{per_channel} value per channel")


# --- conv2d ---------------------------------------------------------------------------------


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="conv2d_backward", gradients=("x", "weight", "bias"), unbatched=("x", 3),
         reduction=_conv_k, autocast=Autocast("lower"))
def conv2d(
    x: Tensor,
    weight: Tensor,
    bias: OptionalTensor = None,
    stride: IntPair = 1,
    padding: Padding = 0,
    dilation: IntPair = 1,
    groups: int = 1,
) -> Tensor:
    """2-D convolution (cross-correlation) as ``torch.nn.functional.conv2d``.

    x is (N, C, H, W) or unbatched (C, H, W); weight (out_channels, C / groups, kH, kW); padding an
    int, a pair, the strings "same" / "valid", or (top, bottom, left, right). Kernels receive stride
    and dilation as pairs, padding as (top, bottom, left, right) and a batched x.
    """


@conv2d.checker
def _check_conv2d(x, weight, bias, stride, padding, dilation, groups):
    geo = conv_geometry("conv2d", x, weight, "x", "weight", stride, padding, dilation, groups)
    if bias is not None:
        c.rank("conv2d", "bias", bias, (1,))
        c.shape_is("conv2d", "bias", bias, (int(weight.shape[0]),), "(out_channels,)")
        c.same_dtype("conv2d", "bias", bias, "x", x)
    geo.pop("out_shape")
    return geo


@conv2d.fake
def _fake_conv2d(a):
    return like(a["x"], conv_out(a, "x", "weight"))


def _conv_out(a: Mapping[str, Any], w_name: str) -> tuple[int, ...]:
    x = a["x"]
    return (int(x.shape[0]),) + conv_out_shape(c.shape_of(x)[1:], c.shape_of(a[w_name]), a["stride"], a["padding"], a["dilation"])


def _empty_conv2d(a: Mapping[str, Any]) -> Any:
    """An empty batch or zero input channels: an empty output (zero channels for the latter)."""
    return e.zeros(a["x"], _conv_out(a, "weight"))


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="conv2d", reduction=_conv_backward_k)
def conv2d_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    stride: IntPair = 1,
    padding: Padding = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    output_mask: OutputMask = (True, True, True),
) -> TensorTuple:
    """Gradients of conv2d: returns (grad_x, grad_weight, grad_bias) for batched (N, C, H, W) x.

    grad_bias is the sum of grad_out over (N, H, W), whether or not the forward had a bias.
    ``output_mask`` says which of the three to compute; the others come back None (the autograd
    node passes which of x, weight and bias need a gradient: a network's input image, a
    convolution without bias).
    """


@conv2d_backward.checker
def _check_conv2d_backward(grad_out, x, weight, stride, padding, dilation, groups, output_mask):
    op = "conv2d_backward"
    mask = c.bool_tuple(op, "output_mask", output_mask, 3)
    c.rank(op, "x", x, (4,), "(N, C, H, W)")
    geo = conv_geometry(op, x, weight, "x", "weight", stride, padding, dilation, groups)
    c.same_dtype(op, "grad_out", grad_out, "x", x)
    c.shape_is(op, "grad_out", grad_out, geo.pop("out_shape"), "(the forward output's shape)")
    return {**geo, "output_mask": mask}


@conv2d_backward.fake
def _fake_conv2d_backward(a):
    return e.masked((like(a["x"]), like(a["weight"]), like(a["x"], (a["weight"].shape[0],))), a["output_mask"])


def _empty_conv2d_backward(a: Mapping[str, Any]) -> tuple:
    """Sums over no positions: zero gradients of x, weight and bias (bias of out_channels)."""
    x, w = a["x"], a["weight"]
    return e.masked((e.zeros_like(x), e.zeros(x, w.shape), e.zeros(x, (int(w.shape[0]),))), a["output_mask"])


# --- batch_norm -------------------------------------------------------------------------------


def _bn_reduction(a: Mapping[str, Any]) -> int:
    return _spatial_count(a["x"])


@declare(
    dtypes=FLOAT_DTYPES,
    tolerances=REDUCTION,
    backward="batch_norm_backward",
    gradients=("x", "weight", "bias"),
    mutates=("running_mean", "running_var"),
    mutates_when="training",
    mutates_statistics=True,
    reduction=_bn_reduction,
)
def batch_norm(
    x: Tensor,
    running_mean: OptionalTensor,
    running_var: OptionalTensor,
    weight: OptionalTensor = None,
    bias: OptionalTensor = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Batch normalisation over the channel dimension 1 of an (N, C, ...) input, as ``F.batch_norm``.

    In training, normalises with the batch statistics (biased variance) and, when running stats are
    given, updates them in place: ``r = (1 - momentum) * r + momentum * stat`` with the unbiased
    variance for ``running_var``. In eval, normalises with the running statistics as torch's CPU
    kernel computes it, ``x * a + (bias - running_mean * a)`` with ``a = (1 / sqrt(running_var +
    eps)) * weight`` per channel: for a finite ``a`` the textbook formula up to rounding; where eps =
    0 meets a zero running variance, ``a`` is infinite (NaN for a zero weight) and each element is
    what IEEE arithmetic gives for that expression (+-inf, or NaN where ``x * a`` and the shift are
    infinities of opposite signs or x is 0). torch's CUDA kernels compute ``(x - mean) * (1 / sqrt(var + eps)) * weight +
    bias`` instead, whose infinities differ there; hal's kernels on every device give the CPU's.
    eps must be positive in training (as F.batch_norm). An empty 1-D x is taken, as torch takes it:
    the result is empty and the parameters, of any length, are not read.
    """


@batch_norm.checker
def _check_batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
    op = "batch_norm"
    ch = bn_channels(op, x)
    c.float_dtype(op, "x", x)
    for name, a in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        check_per_channel(op, name, a, ch, "x", x)
    check_bn_options(op, _spatial_count(x), running_mean, running_var, training, momentum, eps)
    return {"momentum": float(momentum), "eps": float(eps), "training": bool(training)}


@batch_norm.fake
def _fake_batch_norm(a):
    return like(a["x"])


def _empty_batch_norm(a: Mapping[str, Any]) -> Any:
    """An empty output; the running statistics stay as they are (torch updates nothing from an
    empty batch)."""
    return e.zeros_like(a["x"])


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="batch_norm", reduction=_bn_reduction)
def batch_norm_backward(
    grad_out: Tensor,
    x: Tensor,
    running_mean: OptionalTensor,
    running_var: OptionalTensor,
    weight: OptionalTensor = None,
    training: bool = False,
    eps: float = 1e-5,
) -> TensorTuple:
    """Gradients of batch_norm: (grad_x, grad_weight, grad_bias), each grad of a parameter of shape (C,).

    In training the batch statistics are recomputed from x (running stats are not read); in eval the
    running statistics are constants. A missing weight counts as ones.
    """


@batch_norm_backward.checker
def _check_batch_norm_backward(grad_out, x, running_mean, running_var, weight, training, eps):
    op = "batch_norm_backward"
    ch = bn_channels(op, x)
    c.float_dtype(op, "x", x)
    c.same_dtype(op, "grad_out", grad_out, "x", x)
    c.shape_is(op, "grad_out", grad_out, c.shape_of(x), "(the shape of x)")
    for name, a in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight)):
        check_per_channel(op, name, a, ch, "x", x)
    check_bn_options(op, _spatial_count(x), running_mean, running_var, training, 0.1, eps, write=False)
    return {"eps": float(eps), "training": bool(training)}


@batch_norm_backward.fake
def _fake_batch_norm_backward(a):
    x, w = a["x"], a["weight"]
    ch = (_param_count(x, w),)
    return like(x), param_like(w, x, ch), param_like(None, x, ch, fallback=w)


def _param_count(x: Any, weight: Any) -> int:
    """The length of batch norm's parameter gradients: x's channels; an empty 1-D x has none, and
    its gradients take the weight's length (0 without one)."""
    if x.ndim > 1:
        return int(x.shape[1])
    return 0 if weight is None else int(weight.shape[0])


def _empty_batch_norm_backward(a: Mapping[str, Any]) -> tuple:
    """Zero gradients; those of weight and bias in the weight's dtype (x's when there is none)."""
    x = a["x"]
    ch = (_param_count(x, a["weight"]),)
    p = e.dtype_of(a["weight"], x)
    return e.zeros_like(x), e.zeros(x, ch, p), e.zeros(x, ch, p)


# --- fused_conv_bn_relu -----------------------------------------------------------------------


def _fused_checks(op, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training, write=True):
    c.rank(op, "x", x, (4,), "(N, C, H, W)")
    if int(x.shape[1]) == 0:  # conv2d gives zero channels then, which the per-channel parameters cannot take
        raise c.fail(op, "x", "an array with channels (torch's conv2d of a zero-channel input has no output channels for batch_norm)", x)
    geo = conv_geometry(op, x, conv_weight, "x", "conv_weight", stride, padding, dilation, groups)
    out_shape = geo.pop("out_shape")
    cout = int(conv_weight.shape[0])
    if conv_bias is not None:
        c.rank(op, "conv_bias", conv_bias, (1,))
        c.shape_is(op, "conv_bias", conv_bias, (cout,), "(out_channels,)")
        c.same_dtype(op, "conv_bias", conv_bias, "x", x)
    for name, a in (("bn_weight", bn_weight), ("bn_bias", bn_bias), ("running_mean", running_mean), ("running_var", running_var)):
        check_per_channel(op, name, a, cout, "x", x)
    check_bn_options(op, _spatial_count(out_shape), running_mean, running_var, training, momentum, eps, write)
    return geo, out_shape


def _fused_k(a: Mapping[str, Any]) -> int:
    w, x = a["conv_weight"], a["x"]
    return int(w.shape[1] * w.shape[2] * w.shape[3]) * max(1, int(x.shape[0]))


@declare(
    dtypes=FLOAT_DTYPES,
    tolerances=REDUCTION,
    backward="fused_conv_bn_relu_backward",
    gradients=("x", "conv_weight", "conv_bias", "bn_weight", "bn_bias"),
    mutates=("running_mean", "running_var"),
    mutates_when="training",
    mutates_statistics=True,
    reduction=_fused_k,
    autocast=Autocast("lower", args=("x", "conv_weight", "conv_bias")),  # conv2d's cast; batch norm is on no list
)
def fused_conv_bn_relu(
    x: Tensor,
    conv_weight: Tensor,
    conv_bias: OptionalTensor,
    bn_weight: OptionalTensor,
    bn_bias: OptionalTensor,
    running_mean: OptionalTensor,
    running_var: OptionalTensor,
    stride: IntPair = 1,
    padding: Padding = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    eps: float = 1e-5,
    momentum: float = 0.1,
    training: bool = False,
) -> Tensor:
    """``relu(batch_norm(conv2d(x, ...)))`` in one op (vertical fusion of a ResNet block's head).

    In eval the batch norm folds into the convolution (``w * gamma / sqrt(var + eps)``); in
    training it uses the batch statistics of the convolution output and updates the running stats
    in place, as :func:`batch_norm` does.

    Where eps = 0 meets a zero running variance (eval; training refuses eps = 0, as F.batch_norm),
    the result is that of torch's composite on the CPU, ``relu(F.batch_norm(F.conv2d(...)))``:
    :func:`batch_norm`'s eval formula applied to the convolution output (bias included), whose
    +-inf and NaN the ReLU passes as torch's does (NaN stays NaN, -inf gives 0). Folded weights
    would be infinite there, so kernels that fold do not take eps = 0.
    """


@fused_conv_bn_relu.checker
def _check_fused(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    geo, _ = _fused_checks("fused_conv_bn_relu", x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training)
    return {**geo, "eps": float(eps), "momentum": float(momentum), "training": bool(training)}


@fused_conv_bn_relu.fake
def _fake_fused(a):
    return like(a["x"], conv_out(a, "x", "conv_weight"))




def _empty_fused_conv_bn_relu(a: Mapping[str, Any]) -> Any:
    """An empty batch: an empty output, running statistics untouched (as batch_norm)."""
    return e.zeros(a["x"], _conv_out(a, "conv_weight"))


@fused_conv_bn_relu.composite(training=True)
def _fused_composite(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    """conv2d -> batch_norm -> ReLU: the fallback, and the training route (each op saves its own
    input, so the backward does not recompute the convolution as the fused backward does)."""
    from hal.ops import batch_norm, conv2d, scale_shift_act

    y = conv2d(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    y = batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
    return scale_shift_act(y, 1.0, 0.0, "relu")


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="fused_conv_bn_relu", reduction=_conv_backward_k)
def fused_conv_bn_relu_backward(
    grad_out: Tensor,
    x: Tensor,
    conv_weight: Tensor,
    conv_bias: OptionalTensor,
    bn_weight: OptionalTensor,
    bn_bias: OptionalTensor,
    running_mean: OptionalTensor,
    running_var: OptionalTensor,
    stride: IntPair = 1,
    padding: Padding = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    eps: float = 1e-5,
    training: bool = False,
) -> TensorTuple:
    """Gradients of fused_conv_bn_relu: (grad_x, grad_conv_weight, grad_conv_bias, grad_bn_weight,
    grad_bn_bias). The convolution output is recomputed from x (it is not saved by the forward).
    """


@fused_conv_bn_relu_backward.checker
def _check_fused_backward(grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training):
    op = "fused_conv_bn_relu_backward"
    geo, out_shape = _fused_checks(op, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, 0.1, training, write=False)
    c.same_dtype(op, "grad_out", grad_out, "x", x)
    c.shape_is(op, "grad_out", grad_out, out_shape, "(the forward output's shape)")
    return {**geo, "eps": float(eps), "training": bool(training)}


@fused_conv_bn_relu_backward.fake
def _fake_fused_backward(a):
    x, cw = a["x"], a["conv_weight"]
    cout = (cw.shape[0],)
    return like(x), like(cw, dtype=x.dtype), like(x, cout), param_like(a["bn_weight"], x, cout), param_like(a["bn_bias"], x, cout)


def _empty_fused_conv_bn_relu_backward(a: Mapping[str, Any]) -> tuple:
    """Zero gradients of x, the convolution's weight and bias, and the batch norm's weight and
    bias (each in its parameter's dtype, x's where the parameter is None)."""
    x, w = a["x"], a["conv_weight"]
    cout = (int(w.shape[0]),)
    return (
        e.zeros_like(x),
        e.zeros(x, w.shape),
        e.zeros(x, cout),
        e.zeros(x, cout, e.dtype_of(a["bn_weight"], x)),
        e.zeros(x, cout, e.dtype_of(a["bn_bias"], x)),
    )


# --- fused_conv_bn_add_relu: the residual tail of a ResNet block --------------------------------


def _check_residual(op: str, residual: Any, out_shape: tuple[int, ...], x: Any) -> None:
    """The residual added before the ReLU: an array of the convolution output's shape in x's dtype."""
    c.shape_is(op, "residual", residual, out_shape, "(the convolution output's shape)")
    c.same_dtype(op, "residual", residual, "x", x)


@declare(
    dtypes=FLOAT_DTYPES,
    tolerances=REDUCTION,
    backward="fused_conv_bn_add_relu_backward",
    gradients=("x", "conv_weight", "conv_bias", "bn_weight", "bn_bias", "residual"),
    mutates=("running_mean", "running_var"),
    mutates_when="training",
    mutates_statistics=True,
    reduction=_fused_k,
    # conv2d's cast, and the residual with x: the op adds in x's dtype (a float32 residual, which
    # torch's unfused add would promote the sum to, is rounded to the autocast dtype first)
    autocast=Autocast("lower", args=("x", "conv_weight", "conv_bias", "residual")),
)
def fused_conv_bn_add_relu(
    x: Tensor,
    conv_weight: Tensor,
    conv_bias: OptionalTensor,
    bn_weight: OptionalTensor,
    bn_bias: OptionalTensor,
    running_mean: OptionalTensor,
    running_var: OptionalTensor,
    residual: Tensor,
    stride: IntPair = 1,
    padding: Padding = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    eps: float = 1e-5,
    momentum: float = 0.1,
    training: bool = False,
) -> Tensor:
    """``relu(batch_norm(conv2d(x, ...)) + residual)`` in one op: the tail of a ResNet block
    (``relu(bn3(conv3(y)) + identity)``), with ``residual`` of the convolution output's shape and
    x's dtype.

    Batch norm as in :func:`fused_conv_bn_relu`: folded into the convolution in eval, batch
    statistics and running statistics updated in place in training.

    Training needs no fused backward: a call needing autograd runs the op's training
    decomposition, conv2d -> batch_norm -> ``scale_shift_act(y, 1.0, residual, "relu")``, in which
    each op saves its own input and runs its own tuned backward; a fused backward would recompute
    the convolution for the batch norm's gradients, and the vendor calls that fuse this chain
    (cuDNN's and MIOpen's convolution + add + ReLU) are forward-only. The backward op exists
    because a trainable op names one: it serves calls that force a kernel of the op under
    autograd, and it takes the forward's result (its sign is the ReLU's mask) instead of the
    residual, so nothing but what torch's ReLU saves is kept.
    """


@fused_conv_bn_add_relu.checker
def _check_fused_add(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups, eps, momentum, training):
    op = "fused_conv_bn_add_relu"
    geo, out_shape = _fused_checks(op, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training)
    _check_residual(op, residual, out_shape, x)
    return {**geo, "eps": float(eps), "momentum": float(momentum), "training": bool(training)}


def _bn_of_conv(a: Mapping[str, Any]) -> Any:
    """batch_norm(conv2d(x)) of a call, which the decomposition rounds to the op's dtype before the
    add (conformance allows its result that one rounding more). Training normalises with the batch
    statistics and leaves the running ones alone here (this runs beside the call, not as it)."""
    from hal.ops import batch_norm, conv2d

    y = conv2d(a["x"], a["conv_weight"], a["conv_bias"], a["stride"], a["padding"], a["dilation"], a["groups"])
    stats = (None, None) if a["training"] else (a["running_mean"], a["running_var"])
    return batch_norm(y, *stats, a["bn_weight"], a["bn_bias"], a["training"], 0.0, a["eps"])


@fused_conv_bn_add_relu.composite(training=True, rounds=_bn_of_conv)
def _fused_add_composite(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, residual, stride, padding, dilation, groups, eps, momentum, training):
    """conv2d -> batch_norm -> ``relu(y + residual)`` as scale_shift_act with the residual as its
    shift: the fallback, and the training route (see the op's docstring)."""
    from hal.ops import batch_norm, conv2d, scale_shift_act

    y = conv2d(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    y = batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
    return scale_shift_act(y, 1.0, residual, "relu")


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="fused_conv_bn_add_relu", reduction=_conv_backward_k)
def fused_conv_bn_add_relu_backward(
    grad_out: Tensor,
    out: Tensor,
    x: Tensor,
    conv_weight: Tensor,
    conv_bias: OptionalTensor,
    bn_weight: OptionalTensor,
    bn_bias: OptionalTensor,
    running_mean: OptionalTensor,
    running_var: OptionalTensor,
    stride: IntPair = 1,
    padding: Padding = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    eps: float = 1e-5,
    training: bool = False,
) -> TensorTuple:
    """Gradients of fused_conv_bn_add_relu: (grad_x, grad_conv_weight, grad_conv_bias,
    grad_bn_weight, grad_bn_bias, grad_residual).

    ``out`` is the forward's result: the ReLU passes grad_out where ``out > 0``, and that masked
    gradient is grad_residual; the convolution output is recomputed from x for the batch norm's
    gradients, as in :func:`fused_conv_bn_relu_backward`.
    """


@fused_conv_bn_add_relu_backward.checker
def _check_fused_add_backward(grad_out, out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training):
    op = "fused_conv_bn_add_relu_backward"
    geo, out_shape = _fused_checks(op, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, 0.1, training, write=False)
    for name, a in (("out", out), ("grad_out", grad_out)):
        c.shape_is(op, name, a, out_shape, "(the forward output's shape)")
        c.same_dtype(op, name, a, "x", x)
    return {**geo, "eps": float(eps), "training": bool(training)}


@fused_conv_bn_add_relu_backward.fake
def _fake_fused_add_backward(a):
    return (*_fake_fused_backward(a), like(a["out"]))


def _empty_fused_conv_bn_add_relu_backward(a: Mapping[str, Any]) -> tuple:
    """The zero gradients of fused_conv_bn_relu_backward, and a zero (empty) grad_residual."""
    return (*_empty_fused_conv_bn_relu_backward(a), e.zeros_like(a["out"]))


# zero-size inputs: each op's empty rule (the dispatcher answers such calls with it, no kernel runs)
conv2d.empty(_empty_conv2d)
conv2d_backward.empty(_empty_conv2d_backward)
batch_norm.empty(_empty_batch_norm)
batch_norm_backward.empty(_empty_batch_norm_backward)
fused_conv_bn_relu.empty(_empty_fused_conv_bn_relu)
fused_conv_bn_relu_backward.empty(_empty_fused_conv_bn_relu_backward)
fused_conv_bn_add_relu.fake(_fake_fused)  # the conv2d output's shape, as fused_conv_bn_relu's
fused_conv_bn_add_relu.empty(_empty_fused_conv_bn_relu)  # an empty batch: the same empty output
fused_conv_bn_add_relu_backward.empty(_empty_fused_conv_bn_add_relu_backward)


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
