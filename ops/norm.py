"""Normalisation over trailing dimensions: layer_norm and rms_norm (and rms_norm_amax, which also
reduces its result's amax for an FP8 cast)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from hal.arrays import FLOAT_DTYPES, dtype_name
from hal.registry import Autocast, declare
from hal.types import OptionalTensor, ShapeLike, Tensor

from . import _checks as c
from . import _empty as e
from ._fake import like, param_like
from ._tolerances import REDUCTION

#: where this family's ops stand among hal's (hal.ops: the order of API.md and docs/ops.md)
ORDER = 40


def _check_norm(op: str, x: Any, normalized_shape: Any, params: dict[str, Any]) -> tuple[int, ...]:
    c.float_dtype(op, "x", x)
    shape = c.int_tuple(op, "normalized_shape", normalized_shape, low=0)
    if not shape or c.shape_of(x)[-len(shape):] != shape or x.ndim < len(shape):
        raise c.fail(op, "x", f"an array whose trailing dimensions are normalized_shape {shape}", x)
    for name, a in params.items():
        if a is not None:
            c.shape_is(op, name, a, shape, "(normalized_shape)")
            c.same_dtype(op, name, a, "x", x)
    return shape


def _norm_k(a: dict) -> int:
    k = 1
    for s in a["normalized_shape"]:
        k *= int(s)
    return k


def default_rms_eps(x: Any) -> float:
    """torch's default eps of rms_norm: the machine epsilon of the dtype torch computes x in (its
    "opmath" type): float64's for float64 x, float32's for every other dtype. Half-precision x is
    upcast to float32 before the mean of squares, so its eps is float32's (1.19e-7), not float16's
    (9.8e-4) or bfloat16's (7.8e-3), which would dominate mean(x^2) for inputs of magnitude 1e-3."""
    return float(torch.finfo(torch.float64 if dtype_name(x) == "float64" else torch.float32).eps)


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="layer_norm_backward", gradients=("x", "weight", "bias"), reduction=_norm_k,
         autocast=Autocast("fp32", devices=("cuda",)))  # torch's CUDA list; not on the CPU's
def layer_norm(
    x: Tensor,
    normalized_shape: ShapeLike,
    weight: OptionalTensor = None,
    bias: OptionalTensor = None,
    eps: float = 1e-5,
) -> Tensor:
    """Layer normalisation over the trailing ``normalized_shape`` dimensions, as ``F.layer_norm``
    (biased variance). Kernels receive normalized_shape as a tuple."""


@layer_norm.checker
def _check_layer_norm(x, normalized_shape, weight, bias, eps):
    shape = _check_norm("layer_norm", x, normalized_shape, {"weight": weight, "bias": bias})
    return {"normalized_shape": shape, "eps": c.number("layer_norm", "eps", eps, low=0.0)}


def _empty_layer_norm(a: Mapping[str, Any]) -> Any:
    return e.zeros_like(a["x"])


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="layer_norm", reduction=_norm_k)
def layer_norm_backward(grad_out: Tensor, x: Tensor, normalized_shape: ShapeLike, weight: OptionalTensor = None, eps: float = 1e-5) -> tuple:
    """Gradients of layer_norm: (grad_x, grad_weight, grad_bias); statistics recomputed from x.

    grad_weight and grad_bias have shape normalized_shape whether or not the forward had them.
    """


@layer_norm_backward.checker
def _check_layer_norm_backward(grad_out, x, normalized_shape, weight, eps):
    op = "layer_norm_backward"
    shape = _check_norm(op, x, normalized_shape, {"weight": weight})
    c.same_dtype(op, "grad_out", grad_out, "x", x)
    c.shape_is(op, "grad_out", grad_out, c.shape_of(x), "(the shape of x)")
    return {"normalized_shape": shape, "eps": c.number(op, "eps", eps, low=0.0)}


def _empty_layer_norm_backward(a: Mapping[str, Any]) -> tuple:
    """Zero gradients; grad_weight and grad_bias sum over no rows (or are empty)."""
    x, shape = a["x"], a["normalized_shape"]
    return e.zeros_like(x), e.zeros(x, shape), e.zeros(x, shape)


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="rms_norm_backward", gradients=("x", "weight"), reduction=_norm_k)
def rms_norm(x: Tensor, normalized_shape: ShapeLike, weight: OptionalTensor = None, eps: Optional[float] = None) -> Tensor:
    """RMS normalisation ``x / sqrt(mean(x^2) + eps) * weight`` over the trailing dimensions, as
    ``F.rms_norm``; eps None means torch's default, the machine epsilon of float32 (of float64 for
    float64 x), half-precision x included (kernels receive a float)."""


def _rms_eps(op: str, x: Any, eps: Any) -> float:
    return default_rms_eps(x) if eps is None else c.number(op, "eps", eps, low=0.0)


@rms_norm.checker
def _check_rms_norm(x, normalized_shape, weight, eps):
    shape = _check_norm("rms_norm", x, normalized_shape, {"weight": weight})
    return {"normalized_shape": shape, "eps": _rms_eps("rms_norm", x, eps)}


def _empty_rms_norm(a: Mapping[str, Any]) -> Any:
    return e.zeros_like(a["x"])


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="rms_norm", reduction=_norm_k)
def rms_norm_backward(grad_out: Tensor, x: Tensor, normalized_shape: ShapeLike, weight: OptionalTensor = None, eps: Optional[float] = None) -> tuple:
    """Gradients of rms_norm: (grad_x, grad_weight), grad_weight of shape normalized_shape."""


@rms_norm_backward.checker
def _check_rms_norm_backward(grad_out, x, normalized_shape, weight, eps):
    op = "rms_norm_backward"
    shape = _check_norm(op, x, normalized_shape, {"weight": weight})
    c.same_dtype(op, "grad_out", grad_out, "x", x)
    c.shape_is(op, "grad_out", grad_out, c.shape_of(x), "(the shape of x)")
    return {"normalized_shape": shape, "eps": _rms_eps(op, x, eps)}


# rms_norm with the amax of its result: the FP8 cast of y under per-tensor current scaling needs
# max |y| before it can encode; reduced as y is written, that pass over y is saved. Its gradients are
# rms_norm's, by the same backward op (the amax has none).
@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="rms_norm_backward", gradients=("x", "weight"), reduction=_norm_k,
         nondifferentiable_results=1)
def rms_norm_amax(x: Tensor, normalized_shape: ShapeLike, weight: OptionalTensor = None,
                  eps: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """rms_norm that also returns the amax of its result, ``(y, amax)``: y is ``rms_norm(x,
    normalized_shape, weight, eps)``, amax ``max |float32(y)|`` over all of y, of the values as
    written in y's dtype (a 0-d float32; NaN propagates, as ``torch.amax``; 0 for an empty y),
    reduced while y is written. What an FP8 cast of y with one current scale per tensor needs
    first (``hal.fp8``: a pass over y saved). Gradients are rms_norm's (rms_norm_backward); the
    amax has none."""


@rms_norm_amax.checker
def _check_rms_norm_amax(x, normalized_shape, weight, eps):
    shape = _check_norm("rms_norm_amax", x, normalized_shape, {"weight": weight})
    return {"normalized_shape": shape, "eps": _rms_eps("rms_norm_amax", x, eps)}


def _norm_param_grad(a) -> object:
    """grad_weight (or grad_bias) of layer_norm / rms_norm: normalized_shape, the weight's dtype."""
    return param_like(a["weight"], a["x"], a["normalized_shape"])


@layer_norm.fake
def _fake_layer_norm(a):
    return like(a["x"])


@layer_norm_backward.fake
def _fake_layer_norm_backward(a):
    return like(a["x"]), _norm_param_grad(a), _norm_param_grad(a)


@rms_norm.fake
def _fake_rms_norm(a):
    return like(a["x"])


@rms_norm_backward.fake
def _fake_rms_norm_backward(a):
    return like(a["x"]), _norm_param_grad(a)


@rms_norm_amax.fake
def _fake_rms_norm_amax(a):
    return like(a["x"]), like(a["x"], (), torch.float32)


def _empty_rms_norm_backward(a: Mapping[str, Any]) -> tuple:
    x = a["x"]
    return e.zeros_like(x), e.zeros(x, a["normalized_shape"])


def _empty_rms_norm_amax(a: Mapping[str, Any]) -> tuple:
    """rms_norm's empty result, and amax 0 (the max of nothing, as fp8_quantize_amax's)."""
    x = a["x"]
    return e.zeros_like(x), e.zeros(x, (), "float32")


# zero-size inputs: each op's empty rule (the dispatcher answers such calls with it, no kernel runs)
layer_norm.empty(_empty_layer_norm)
layer_norm_backward.empty(_empty_layer_norm_backward)
rms_norm.empty(_empty_rms_norm)
rms_norm_backward.empty(_empty_rms_norm_backward)
rms_norm_amax.empty(_empty_rms_norm_amax)


__all__ = ["layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward", "rms_norm_amax"]
