"""Cases of conv2d, batch_norm, fused_conv_bn_relu, fused_conv_bn_add_relu and their backward ops.

Convolutions use ResNet-50's layers at their real sizes (batch 1 or 2; the float64 reference takes
well under a second for each), and edge geometries: batch 1, odd and prime sizes, rectangular kernels, stride larger than the kernel,
dilation, asymmetric and string padding, groups (depthwise too), unbatched input, non-contiguous
and channels_last inputs, long reductions. Weights are drawn with std 1/sqrt(fan_in) so results are
of unit scale whatever the geometry.

ReLU gradients depend on the sign of the pre-activation, which a half-precision kernel may round
differently from the float64 reference near zero; the backward cases of fused_conv_bn_relu keep the
pre-activations mostly away from zero (bn_bias around +2), and their grad_out is zero where the
float64 pre-activation lies within a few roundings of zero (``KINK_BAND``).
"""

from __future__ import annotations

import dataclasses

import math
from typing import Any, Union

import torch

from hal.arrays import dtype_name
from hal.ops.conv import conv_geometry

from . import Call, Draw, Table, backward_call, case, from_table

Pair = Union[int, tuple[int, int]]
HALF = ("float16", "bfloat16")


def _pair(v: Pair) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else v


def conv_args(
    d: Draw,
    n: int,
    cin: int,
    h: int,
    w: int,
    cout: int,
    k: Pair,
    stride: Pair = 1,
    padding: Any = 0,
    dilation: Pair = 1,
    groups: int = 1,
    bias: bool = True,
    layout: str = "contiguous",
    w_layout: str = "contiguous",
    unbatched: bool = False,
    values: str = "unit",
) -> Call:
    kh, kw = _pair(k)
    fan_in = max(1, cin // groups * kh * kw)
    mag = d.magnitude(values)
    shape = (cin, h, w) if unbatched else (n, cin, h, w)
    args = {
        "x": d.normal(*shape, std=mag, layout=layout),
        "weight": d.normal(cout, cin // groups, kh, kw, std=1 / math.sqrt(fan_in), layout=w_layout),
        "bias": d.normal(cout, std=mag) if bias else None,
        "stride": stride,
        "padding": padding,
        "dilation": dilation,
        "groups": groups,
    }
    return Call(args, scale=mag)


def conv_out_shape(args: dict[str, Any], x: str = "x", weight: str = "weight") -> tuple[int, ...]:
    geo = conv_geometry("conv2d", args[x], args[weight], x, weight, args["stride"], args["padding"], args["dilation"], args["groups"])
    return geo["out_shape"]


GEOMETRIES: Table = {
    # ResNet-50 (torchvision v1.5) layers at their real sizes, batch 1 or 2
    "resnet50_conv1_7x7s2": (dict(n=1, cin=3, h=224, w=224, cout=64, k=7, stride=2, padding=3), False, True),
    "resnet50_conv3x3_b1": (dict(n=1, cin=64, h=56, w=56, cout=64, k=3, padding=1), False, True),
    "resnet50_conv1x1_reduce_b2": (dict(n=2, cin=256, h=56, w=56, cout=64, k=1), False, True),
    "resnet50_conv1x1_expand": (dict(n=1, cin=64, h=56, w=56, cout=256, k=1), False, False),
    "resnet50_conv3x3s2": (dict(n=1, cin=128, h=56, w=56, cout=128, k=3, stride=2, padding=1), False, True),
    "resnet50_downsample_1x1s2": (dict(n=1, cin=512, h=28, w=28, cout=1024, k=1, stride=2), False, False),
    "resnet50_stage4_conv3x3": (dict(n=1, cin=512, h=7, w=7, cout=512, k=3, padding=1), False, False),
    # edge geometries
    "batch1_odd_prime": (dict(n=1, cin=3, h=13, w=11, cout=5, k=3, padding=1), True, True),
    "odd_sizes_rect_kernel": (dict(n=3, cin=7, h=9, w=7, cout=11, k=(3, 5), padding=(1, 2)), False, True),
    "stride_gt_kernel": (dict(n=2, cin=4, h=17, w=16, cout=6, k=2, stride=3), False, True),
    "dilation2": (dict(n=2, cin=4, h=15, w=16, cout=8, k=3, dilation=2, padding=2), False, True),
    "dilation_stride_asym_pad": (dict(n=2, cin=5, h=12, w=13, cout=7, k=3, stride=2, dilation=(2, 3), padding=(1, 2, 3, 0)), False, True),
    "groups4": (dict(n=2, cin=8, h=10, w=9, cout=12, k=3, padding=1, groups=4), True, True),
    "depthwise": (dict(n=2, cin=16, h=9, w=9, cout=16, k=3, padding=1, groups=16), False, True),
    "depthwise_multiplier2": (dict(n=1, cin=8, h=7, w=8, cout=16, k=5, padding=2, groups=8), False, False),
    "padding_same_even_kernel": (dict(n=2, cin=3, h=9, w=10, cout=4, k=4, padding="same"), False, True),
    "padding_valid": (dict(n=1, cin=3, h=8, w=8, cout=4, k=3, padding="valid"), False, False),
    "noncontig_input": (dict(n=2, cin=6, h=9, w=11, cout=8, k=3, padding=1, layout="noncontig"), True, True),
    "channels_last": (dict(n=2, cin=16, h=8, w=8, cout=16, k=3, padding=1, layout="channels_last", w_layout="channels_last"), False, True),
    "no_bias": (dict(n=2, cin=4, h=8, w=8, cout=6, k=3, bias=False), False, False),
    "unbatched": (dict(n=1, cin=3, h=10, w=10, cout=4, k=3, padding=1, unbatched=True), False, False),
    "long_reduction": (dict(n=1, cin=256, h=5, w=5, cout=8, k=3, padding=1), False, True),
    "large_values": (dict(n=1, cin=8, h=8, w=8, cout=8, k=3, padding=1, values="big"), False, False),
    "fp16_underflow": (dict(n=1, cin=8, h=8, w=8, cout=8, k=3, padding=1, values="tiny", dtypes=("float16",)), False, False),
    # zero-size dimensions torch accepts: an empty batch, an input without channels (torch gives an
    # output without channels then)
    "empty_batch": (dict(n=0, cin=3, h=8, w=8, cout=4, k=3, padding=1), True, True),
    "empty_channels": (dict(n=2, cin=0, h=6, w=5, cout=4, k=3, stride=2), False, True),
}


def _conv2d_backward(d: Draw, **geo: Any) -> Call:
    fwd = conv_args(d, **geo)
    return backward_call("conv2d_backward", d, fwd, conv_out_shape(fwd.args))


def _conv2d_backward_masked(d: Draw, output_mask: tuple, **geo: Any) -> Call:
    """Only some gradients asked for (as the autograd node asks): the others must come back None."""
    call = _conv2d_backward(d, **geo)
    return dataclasses.replace(call, args={**call.args, "output_mask": output_mask})


CONV2D = from_table(GEOMETRIES, conv_args)
CONV2D_BACKWARD = from_table(GEOMETRIES, _conv2d_backward, backward=True) + [
    # a network's input image needs no gradient; most convolutions have no bias
    case("stem_weight_only", _conv2d_backward_masked, quick=True, output_mask=(False, True, False), **GEOMETRIES["batch1_odd_prime"][0]),
    case("no_bias_gradient", _conv2d_backward_masked, output_mask=(True, True, False), **GEOMETRIES["dilation_stride_asym_pad"][0]),
    case("input_only", _conv2d_backward_masked, output_mask=(True, False, False), **GEOMETRIES["groups4"][0]),
    case("nothing_asked", _conv2d_backward_masked, output_mask=(False, False, False), **GEOMETRIES["stride_gt_kernel"][0]),
]


# --- batch_norm -------------------------------------------------------------------------------


def bn_args(
    d: Draw,
    shape: tuple[int, ...],
    training: bool,
    stats: bool = True,
    affine: bool = True,
    param_dtype: Any = None,
    momentum: float = 0.1,
    eps: float = 1e-5,
    layout: str = "contiguous",
    offset: float = 0.0,
    values: str = "unit",
) -> Call:
    c = shape[1]
    args = {
        "x": d.normal(*shape, std=d.magnitude(values), mean=offset, layout=layout),
        "running_mean": d.normal(c, std=0.5, mean=offset, dtype=param_dtype) if stats else None,
        "running_var": d.uniform(c, low=0.5, high=1.5, dtype=param_dtype) if stats else None,
        "weight": d.uniform(c, low=0.5, high=1.5, dtype=param_dtype) if affine else None,
        "bias": d.normal(c, std=0.5, dtype=param_dtype) if affine else None,
        "training": training,
        "momentum": momentum,
        "eps": eps,
    }
    return Call(args)


BN_CASES: Table = {
    "eval_resnet50_conv1_out": (dict(shape=(1, 64, 112, 112), training=False), False, True),
    "train_resnet50_stage3_b2": (dict(shape=(2, 256, 14, 14), training=True), False, True),
    "train_no_running_stats": (dict(shape=(3, 8, 5, 5), training=True, stats=False), False, False),
    "train_no_affine": (dict(shape=(2, 16, 4, 4), training=True, affine=False), True, True),
    "eval_2d": (dict(shape=(16, 48), training=False), True, True),
    "train_3d_odd": (dict(shape=(3, 7, 11), training=True, momentum=0.3, eps=1e-3), False, True),
    "batch1_train": (dict(shape=(1, 8, 3, 3), training=True), False, False),
    "channels_last_train": (dict(shape=(2, 16, 5, 5), training=True, layout="channels_last"), False, True),
    "noncontig_eval": (dict(shape=(4, 6, 5, 7), training=False, layout="noncontig"), False, True),
    # mean 100, unit spread: E[x^2] - E[x]^2 cancels catastrophically (see cases/norm.py)
    "large_offset_train": (dict(shape=(4, 8, 6, 6), training=True, offset=100.0), False, True),
    # batch statistics of values whose squares overflow fp16 (running stats would overflow too)
    "large_values_train": (dict(shape=(4, 8, 6, 6), training=True, stats=False, values="big"), False, False),
    # zero-size dimensions: nothing to normalise, running statistics left as they are
    "empty_batch_train": (dict(shape=(0, 4, 3, 3), training=True), True, True),
    "empty_batch_eval": (dict(shape=(0, 4, 3), training=False), False, True),
    "empty_spatial_train": (dict(shape=(2, 4, 0), training=True), False, True),
    "empty_channels_train": (dict(shape=(3, 0, 5), training=True, affine=False), False, True),  # torch fails with 0-element weights
}


def _bn_mixed(d: Draw, training: bool, offset: float = 0.0, layout: str = "contiguous") -> Call:
    """Half x beside float32 parameters and statistics: autocast's batch norm."""
    return bn_args(d, (4, 16, 5, 5), training, param_dtype="float32", offset=offset, layout=layout)


def _bn_backward(d: Draw, **kw: Any) -> Call:
    fwd = bn_args(d, **kw)
    return backward_call("batch_norm_backward", d, fwd, tuple(fwd.args["x"].shape))


def _bn_mixed_backward(d: Draw, **kw: Any) -> Call:
    """grad_x in x's dtype, grad_weight and grad_bias in the weight's (float32)."""
    fwd = _bn_mixed(d, **kw)
    call = backward_call("batch_norm_backward", d, fwd, tuple(fwd.args["x"].shape))
    return dataclasses.replace(call, result_dtypes=(dtype_name(fwd.args["x"]), "float32", "float32"))


_MIXED = [("mixed_fp32_params_train", dict(training=True)), ("mixed_fp32_params_eval", dict(training=False)),
          ("mixed_fp32_params_large_offset_train", dict(training=True, offset=30.0)),
          ("mixed_fp32_params_channels_last_train", dict(training=True, layout="channels_last"))]
BATCH_NORM = from_table(BN_CASES, bn_args) + [case(name, _bn_mixed, dtypes=HALF, **kw) for name, kw in _MIXED]
BATCH_NORM_BACKWARD = from_table(BN_CASES, _bn_backward, backward=True) + [
    case(name, _bn_mixed_backward, dtypes=HALF, **kw) for name, kw in _MIXED if kw["training"]]


# --- fused_conv_bn_relu -------------------------------------------------------------------------


def fused_args(
    d: Draw,
    training: bool,
    stats: bool = True,
    conv_bias: bool = False,
    bn_affine: bool = True,
    param_dtype: Any = None,
    positive_bias: bool = False,
    **geo: Any,
) -> Call:
    conv = conv_args(d, bias=conv_bias, **geo)
    cout = int(conv.args["weight"].shape[0])
    mag = d.magnitude(geo.get("values", "unit"))
    a = conv.args
    args = {
        "x": a["x"],
        "conv_weight": a["weight"],
        "conv_bias": a["bias"],
        "bn_weight": d.uniform(cout, low=0.5, high=1.5, dtype=param_dtype) if bn_affine else None,
        "bn_bias": (d.uniform(cout, low=1.5, high=2.5, dtype=param_dtype) if positive_bias else d.normal(cout, std=0.5, dtype=param_dtype)) if bn_affine else None,
        "running_mean": d.normal(cout, std=0.2 * mag, dtype=param_dtype) if stats else None,
        "running_var": d.uniform(cout, low=0.8, high=1.2, dtype=param_dtype) if stats else None,
        "stride": a["stride"],
        "padding": a["padding"],
        "dilation": a["dilation"],
        "groups": a["groups"],
        "eps": 1e-5,
        "momentum": 0.1,
        "training": training,
    }
    return Call(args, scale=1.0 if training else mag)  # training normalises with batch statistics


FUSED_CASES: Table = {
    "resnet50_eval_3x3": (dict(training=False, n=1, cin=64, h=56, w=56, cout=64, k=3, padding=1), False, True),
    "resnet50_train_3x3_b2": (dict(training=True, n=2, cin=64, h=28, w=28, cout=64, k=3, padding=1), False, True),
    "small_eval_3x3": (dict(training=False, n=1, cin=16, h=8, w=8, cout=16, k=3, padding=1), True, True),
    "small_train_3x3": (dict(training=True, n=2, cin=8, h=6, w=6, cout=8, k=3, padding=1), True, True),
    "train_no_running_stats": (dict(training=True, stats=False, n=2, cin=8, h=7, w=7, cout=8, k=3, padding=1), False, True),
    "eval_conv_bias_no_affine": (dict(training=False, conv_bias=True, bn_affine=False, n=2, cin=6, h=7, w=7, cout=10, k=3, padding=1), False, False),
    "stride2_odd_train": (dict(training=True, n=3, cin=5, h=11, w=9, cout=7, k=3, stride=2, padding=1), False, True),
    "groups4_eval": (dict(training=False, n=2, cin=8, h=7, w=7, cout=8, k=3, padding=1, groups=4), False, True),
    "depthwise_train": (dict(training=True, n=2, cin=8, h=6, w=6, cout=8, k=3, padding=1, groups=8), False, False),
    "dilation_asym_pad_eval": (dict(training=False, n=2, cin=4, h=10, w=11, cout=6, k=3, dilation=2, padding=(1, 2, 0, 1)), False, False),
    "batch1_eval": (dict(training=False, n=1, cin=3, h=9, w=9, cout=8, k=3), False, False),
    "channels_last_train": (dict(training=True, n=2, cin=16, h=6, w=6, cout=16, k=3, padding=1, layout="channels_last", w_layout="channels_last"), False, True),
    "noncontig_eval": (dict(training=False, n=2, cin=6, h=7, w=9, cout=8, k=3, padding=1, layout="noncontig"), False, True),
    "large_values_eval": (dict(training=False, n=1, cin=8, h=6, w=6, cout=8, k=3, padding=1, values="big"), False, False),
    "empty_batch_train": (dict(training=True, n=0, cin=4, h=6, w=6, cout=8, k=3, padding=1), True, True),
    "empty_batch_eval": (dict(training=False, n=0, cin=4, h=6, w=6, cout=8, k=3, padding=1), False, True),
}


#: Half width of the band around the ReLU's kink, relative to the pre-activation's scale, inside
#: which a kernel computing the forward in the case dtype may land on the other side of zero than the
#: float64 reference (a few roundings of the dtype, with margin).
KINK_BAND = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-4, "float64": 0.0}


def _fused_backward(d: Draw, **kw: Any) -> Call:
    """grad_out is zero where the float64 pre-activation lies within the kink band: there the
    ReLU's mask of a correct half-precision kernel may differ from the reference's, and one flipped
    mask entry moves a whole window of grad_x (by |grad_out|, far beyond any tolerance)."""
    fwd = fused_args(d, positive_bias=True, **kw)
    call = backward_call("fused_conv_bn_relu_backward", d, fwd, conv_out_shape(fwd.args, "x", "conv_weight"))
    band = KINK_BAND[d.float_dtype] * fwd.scale
    if band:
        away = _pre_activation(fwd.args).abs() > band
        call.args["grad_out"] = call.args["grad_out"] * away.to(call.args["grad_out"].device)
    return call


def _pre_activation(a: dict[str, Any]) -> torch.Tensor:
    """conv -> batch norm of the forward arguments in float64 on the CPU (cpu_ref), before the ReLU."""
    import hal

    def f64(t: Any) -> Any:
        return None if t is None else t.detach().to("cpu", torch.float64)

    rm, rv = f64(a["running_mean"]), f64(a["running_var"])  # copies: training mode updates them
    with hal.use(backend="cpu_ref"):
        y = hal.ops.conv2d(f64(a["x"]), f64(a["conv_weight"]), f64(a["conv_bias"]), a["stride"], a["padding"], a["dilation"], a["groups"])
        z = hal.ops.batch_norm(y, rm, rv, f64(a["bn_weight"]), f64(a["bn_bias"]), a["training"], a.get("momentum", 0.1), a["eps"])
    return torch.as_tensor(z)


def _mixed_cases(build: Any) -> list:
    """Half x beside float32 batch-norm parameters and statistics (autocast's batch norm), in
    training and eval."""
    return [case(f"mixed_fp32_bn_{'train' if t else 'eval'}", build, dtypes=HALF, training=t, param_dtype="float32", n=2, cin=8, h=6, w=6,
                 cout=8, k=3, padding=1) for t in (True, False)]


FUSED = from_table(FUSED_CASES, fused_args) + _mixed_cases(fused_args)
FUSED_BACKWARD = from_table(FUSED_CASES, _fused_backward, backward=True)


# --- fused_conv_bn_add_relu ---------------------------------------------------------------------


def fused_add_args(d: Draw, residual_layout: Any = None, **kw: Any) -> Call:
    """fused_conv_bn_relu's arguments plus a residual of the convolution output's shape and of the
    result's scale, laid out as x unless ``residual_layout`` says otherwise."""
    call = fused_args(d, **kw)
    shape = conv_out_shape(call.args, "x", "conv_weight")
    residual = d.normal(*shape, std=call.scale, layout=residual_layout or kw.get("layout", "contiguous"))
    return dataclasses.replace(call, args={**call.args, "residual": residual})


FUSED_ADD_CASES: Table = {
    # ResNet-50's block tail (conv3: 1x1 expanding 64 -> 256 channels) and a downsampling one
    "resnet50_eval_1x1_expand": (dict(training=False, n=1, cin=64, h=56, w=56, cout=256, k=1), False, True),
    "resnet50_train_1x1_expand_b2": (dict(training=True, n=2, cin=64, h=28, w=28, cout=256, k=1), False, True),
    "small_eval_3x3": (dict(training=False, n=1, cin=16, h=8, w=8, cout=16, k=3, padding=1), True, True),
    "small_train_3x3": (dict(training=True, n=2, cin=8, h=6, w=6, cout=8, k=3, padding=1), True, True),
    "train_no_running_stats": (dict(training=True, stats=False, n=2, cin=8, h=7, w=7, cout=8, k=3, padding=1), False, True),
    "eval_conv_bias_no_affine": (dict(training=False, conv_bias=True, bn_affine=False, n=2, cin=6, h=7, w=7, cout=10, k=3, padding=1), False, False),
    "stride2_odd_train": (dict(training=True, n=3, cin=5, h=11, w=9, cout=7, k=3, stride=2, padding=1), False, True),
    "stride2_1x1_eval": (dict(training=False, n=2, cin=8, h=9, w=11, cout=12, k=1, stride=2), False, True),
    "groups4_eval": (dict(training=False, n=2, cin=8, h=7, w=7, cout=8, k=3, padding=1, groups=4), False, True),
    "depthwise_train": (dict(training=True, n=2, cin=8, h=6, w=6, cout=8, k=3, padding=1, groups=8), False, False),
    "dilation_asym_pad_eval": (dict(training=False, n=2, cin=4, h=10, w=11, cout=6, k=3, dilation=2, padding=(1, 2, 0, 1)), False, False),
    "batch1_eval": (dict(training=False, n=1, cin=4, h=9, w=9, cout=8, k=3), False, False),
    "batch1_train": (dict(training=True, n=1, cin=4, h=5, w=5, cout=8, k=3, padding=1), False, True),
    "channels_last_train": (dict(training=True, n=2, cin=16, h=6, w=6, cout=16, k=3, padding=1, layout="channels_last", w_layout="channels_last"), False, True),
    "channels_last_eval": (dict(training=False, n=2, cin=16, h=6, w=6, cout=32, k=1, layout="channels_last", w_layout="channels_last"), False, True),
    # a stage's downsampling tail, and a 3x3 with a conv bias, channels_last (oneDNN's bfloat16 fused call on the CPU)
    "channels_last_stride2_eval": (dict(training=False, n=2, cin=16, h=9, w=9, cout=32, k=1, stride=2, layout="channels_last",
                                        w_layout="channels_last"), False, False),
    "channels_last_3x3_bias_eval": (dict(training=False, conv_bias=True, n=2, cin=8, h=7, w=7, cout=16, k=3, padding=1, layout="channels_last",
                                         w_layout="channels_last"), False, False),
    "channels_last_x_contiguous_residual_eval": (dict(training=False, n=2, cin=8, h=6, w=6, cout=16, k=3, padding=1, layout="channels_last",
                                                      w_layout="channels_last", residual_layout="contiguous"), False, False),
    "noncontig_eval": (dict(training=False, n=2, cin=6, h=7, w=9, cout=8, k=3, padding=1, layout="noncontig"), False, True),
    "noncontig_residual_train": (dict(training=True, n=2, cin=6, h=7, w=9, cout=8, k=3, padding=1, residual_layout="noncontig"), False, True),
    "large_values_eval": (dict(training=False, n=1, cin=8, h=6, w=6, cout=8, k=3, padding=1, values="big"), False, False),
    "empty_batch_train": (dict(training=True, n=0, cin=4, h=6, w=6, cout=8, k=3, padding=1), True, True),
    "empty_batch_eval": (dict(training=False, n=0, cin=4, h=6, w=6, cout=8, k=3, padding=1), False, True),
}


def _fused_add_backward(d: Draw, **kw: Any) -> Call:
    """The backward call with ``out``, the forward's result (float64 reference, rounded to the case
    dtype and laid out as x): the ReLU's mask is read from it, so a kernel and the reference see the
    same mask whatever the dtype (no kink band needed)."""
    fwd = fused_add_args(d, **kw)
    a = fwd.args
    call = backward_call("fused_conv_bn_add_relu_backward", d, fwd, tuple(a["residual"].shape))
    out = (_pre_activation(a) + a["residual"].detach().to("cpu", torch.float64)).clamp_min(0.0)
    call.args["out"] = d.tensor(out.numpy(), layout=kw.get("layout", "contiguous"))
    x, gamma = dtype_name(a["x"]), dtype_name(a["bn_weight"] if a["bn_weight"] is not None else a["x"])
    return dataclasses.replace(call, result_dtypes=(x, x, x, gamma, gamma, x))  # the batch norm's gradients in its parameters' dtype


FUSED_ADD = from_table(FUSED_ADD_CASES, fused_add_args) + _mixed_cases(fused_add_args)
FUSED_ADD_BACKWARD = from_table(FUSED_ADD_CASES, _fused_add_backward, backward=True) + _mixed_cases(_fused_add_backward)

CASES = {
    "conv2d": CONV2D,
    "conv2d_backward": CONV2D_BACKWARD,
    "batch_norm": BATCH_NORM,
    "batch_norm_backward": BATCH_NORM_BACKWARD,
    "fused_conv_bn_relu": FUSED,
    "fused_conv_bn_relu_backward": FUSED_BACKWARD,
    "fused_conv_bn_add_relu": FUSED_ADD,
    "fused_conv_bn_add_relu_backward": FUSED_ADD_BACKWARD,
}
