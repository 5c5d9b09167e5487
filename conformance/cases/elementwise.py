"""Cases of scale_shift_act and its backward: every activation with scalar, per-channel and
per-feature (transformer row) affine parameters, a residual shift of x's own shape, plus layouts,
magnitudes and special values.

NaN and infinities: NaN propagates through every activation, and +inf maps to +inf or the
activation's limit. -inf is drawn only for the activations whose limit PyTorch computes (none, relu,
sigmoid, tanh); gelu and silu give NaN there (``-inf * 0``), which no contract fixes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from hal.ops import ACTIVATIONS

from . import Call, Draw, backward_call, case

DEFINED_AT_NEG_INF = ("none", "relu", "sigmoid", "tanh")


def ssa_args(
    d: Draw,
    shape: tuple[int, ...],
    act: str,
    params: str = "scalar",
    layout: str = "contiguous",
    values: str = "unit",
    specials: bool = False,
    shift_layout: Optional[str] = None,
) -> Call:
    """``params``: "scalar" (Python numbers), "identity" (scale 1, shift 0: the activation alone),
    "channel" (shape (C, 1, 1) for dim 1 of 4-D x), "row" (the last dimension's size, broadcast
    over rows) or "residual" (scale 1, shift of x's own shape in ``shift_layout``, default x's:
    ``relu(y + residual)``, the last step of fused_conv_bn_add_relu's training decomposition)."""
    mag = d.magnitude(values)
    raw = mag * d.rng.standard_normal(shape)
    if specials:  # a few NaN and infinities at random places
        flat = raw.reshape(-1)
        picks = d.rng.choice(flat.size, size=min(flat.size, 12), replace=False)
        pool = [np.nan, np.inf, -np.inf] if act in DEFINED_AT_NEG_INF else [np.nan, np.inf]
        flat[picks] = [pool[i % len(pool)] for i in range(len(picks))]
    x = d.tensor(raw, layout=layout)
    if params == "scalar":
        scale, shift = d.scalar(0.5, 1.5), d.scalar(-0.5, 0.5) * mag
    elif params == "identity":  # the activation alone (kernels may skip the affine pass)
        scale, shift = 1.0, 0.0
    elif params == "channel":
        scale, shift = d.uniform(shape[1], 1, 1, low=0.5, high=1.5), d.normal(shape[1], 1, 1, std=0.5 * mag)
    elif params == "row":
        scale, shift = d.uniform(shape[-1], low=0.5, high=1.5), d.normal(shape[-1], std=0.5 * mag)
    elif params == "residual":
        scale, shift = 1.0, d.normal(*shape, std=mag, layout=shift_layout or layout)
    else:
        raise ValueError(f"unknown params kind {params!r}")
    saturates = act in ("sigmoid", "tanh")
    return Call({"x": x, "scale": scale, "shift": shift, "act": act}, scale=1.0 if saturates else mag)


def _backward(d: Draw, output_mask: Optional[tuple] = None, **kw: Any) -> Call:
    """The backward call; with ``output_mask``, only those gradients asked for (the others must
    come back None), as the autograd node asks when scale or shift is a number."""
    fwd = ssa_args(d, **kw)
    call = backward_call("scale_shift_act_backward", d, fwd, tuple(fwd.args["x"].shape))
    return call if output_mask is None else dataclasses.replace(call, args={**call.args, "output_mask": output_mask})


FORWARD = []
BACKWARD = []
for _act in ACTIVATIONS:
    FORWARD += [
        case(f"{_act}_scalar", ssa_args, quick=True, shape=(2, 16, 9, 9), act=_act),
        case(f"{_act}_per_channel", ssa_args, shape=(2, 16, 5, 7), act=_act, params="channel"),
        case(f"{_act}_transformer_row", ssa_args, shape=(2, 32, 768), act=_act, params="row"),
        case(f"{_act}_nan_inf", ssa_args, shape=(4, 5, 6), act=_act, specials=True),
    ]
    BACKWARD += [
        case(f"{_act}_scalar", _backward, quick=True, shape=(2, 8, 6, 7), act=_act),
        case(f"{_act}_per_channel", _backward, shape=(2, 16, 5, 7), act=_act, params="channel"),
    ]
FORWARD += [
    case("identity_relu_channels_last", ssa_args, quick=True, shape=(2, 8, 6, 6), act="relu", params="identity", layout="channels_last"),
    case("identity_none", ssa_args, shape=(3, 50), act="none", params="identity"),
    case("identity_relu_nan_inf", ssa_args, shape=(4, 5, 6), act="relu", params="identity", specials=True),
    case("odd_prime_shape", ssa_args, shape=(7, 13, 3), act="gelu_tanh", params="row"),
    case("noncontig_silu", ssa_args, shape=(4, 33, 10), act="silu", params="row", layout="noncontig"),
    case("channels_last_relu", ssa_args, shape=(2, 8, 6, 6), act="relu", params="channel", layout="channels_last"),
    case("vector_1d", ssa_args, shape=(1001,), act="gelu", params="row"),
    case("relu_residual", ssa_args, shape=(2, 8, 6, 7), act="relu", params="residual"),
    case("relu_residual_channels_last", ssa_args, shape=(2, 8, 6, 6), act="relu", params="residual", layout="channels_last"),
    case("relu_residual_mixed_layouts", ssa_args, shape=(2, 8, 5, 6), act="relu", params="residual", layout="channels_last",
         shift_layout="contiguous"),
]
FORWARD += [case(f"large_values_{a}", ssa_args, shape=(3, 50), act=a, values="big") for a in ("none", "relu", "gelu", "tanh")]
FORWARD += [case(f"fp16_underflow_{a}", ssa_args, shape=(3, 50), act=a, values="tiny", dtypes=("float16",)) for a in ("none", "relu", "gelu", "silu")]
BACKWARD += [
    case("relu_grad_x_only", _backward, quick=True, shape=(2, 8, 6, 7), act="relu", output_mask=(True, False, False)),
    case("identity_relu_grad_x_only", _backward, quick=True, shape=(2, 8, 6, 7), act="relu", params="identity",
         layout="channels_last", output_mask=(True, False, False)),
    case("identity_none_grad_x_only", _backward, shape=(3, 50), act="none", params="identity", output_mask=(True, False, False)),
    case("identity_relu_all_grads", _backward, shape=(2, 8, 6, 7), act="relu", params="identity"),
    case("gelu_bias_no_scale_grad", _backward, shape=(2, 16, 96), act="gelu", params="row", output_mask=(True, False, True)),
    case("silu_param_grads_only", _backward, shape=(2, 16, 5, 7), act="silu", params="channel", output_mask=(False, True, True)),
    case("gelu_transformer_row", _backward, shape=(2, 16, 768), act="gelu", params="row"),
    case("odd_prime_shape", _backward, shape=(7, 13, 3), act="silu", params="row"),
    case("noncontig_tanh", _backward, shape=(4, 33, 10), act="tanh", params="row", layout="noncontig"),
    case("channels_last_sigmoid", _backward, shape=(2, 8, 6, 6), act="sigmoid", params="channel", layout="channels_last"),
    # fused_conv_bn_add_relu's training decomposition: autograd asks for the gradients of y and the residual
    case("relu_residual_grads", _backward, shape=(2, 8, 6, 7), act="relu", params="residual", output_mask=(True, False, True)),
    case("relu_residual_channels_last_grads", _backward, shape=(2, 8, 6, 6), act="relu", params="residual", layout="channels_last",
         output_mask=(True, False, True)),
]

# zero-size dimensions: an empty batch (per-channel parameters), rows of no features (per-feature
# parameters of no elements)
for _cases, _build in ((FORWARD, ssa_args), (BACKWARD, _backward)):
    _cases += [
        case("empty_batch_per_channel", _build, quick=True, shape=(0, 4, 3, 3), act="gelu", params="channel"),
        case("empty_features_row", _build, shape=(3, 0), act="silu", params="row"),
        case("empty_scalar_params", _build, shape=(2, 0, 5), act="sigmoid"),
    ]

CASES = {"scale_shift_act": FORWARD, "scale_shift_act_backward": BACKWARD}
