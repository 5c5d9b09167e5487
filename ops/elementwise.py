"""Elementwise affine + activation: the epilogue of most fusions (bias + act, BN folded + ReLU)."""

from __future__ import annotations

from typing import Any, Mapping

from hal.arrays import FLOAT_DTYPES, is_array
from hal.registry import declare
from hal.types import OutputMask, ScalarOrTensor, Tensor

from . import _checks as c
from . import _empty as e
from ._fake import like, number_grad
from ._tolerances import ACTIVATION, REDUCTION

#: where this family's ops stand among hal's (hal.ops: the order of API.md and docs/ops.md)
ORDER = 20

#: activations of scale_shift_act and linear: names as in PyTorch (gelu_tanh = gelu(approximate="tanh")).
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh")


def check_affine(op: str, x, scale, shift, act) -> dict[str, float]:
    """Validate the affine parameters; numbers come back as floats (kernels receive those: an int
    beyond a float's range is refused here, not by a library's conversion)."""
    c.float_dtype(op, "x", x)
    canon = {}
    for name, v in (("scale", scale), ("shift", shift)):
        if is_array(v):
            c.float_dtype(op, name, v)
            c.broadcasts_to(op, name, v, c.shape_of(x), "x")
        else:
            canon[name] = c.number(op, name, v)
    c.choice(op, "act", act, ACTIVATIONS)
    return canon


@declare(dtypes=FLOAT_DTYPES, tolerances=ACTIVATION, backward="scale_shift_act_backward", gradients=("x", "scale", "shift"))
def scale_shift_act(x: Tensor, scale: ScalarOrTensor = 1.0, shift: ScalarOrTensor = 0.0, act: str = "relu") -> Tensor:
    """``act(x * scale + shift)``: scale and shift are numbers or arrays broadcastable to x.

    act is one of none, relu, gelu, gelu_tanh, silu, sigmoid, tanh. The result has x's shape and
    dtype; kernels compute in at least float32.
    """


@scale_shift_act.checker
def _check_scale_shift_act(x, scale, shift, act):
    return check_affine("scale_shift_act", x, scale, shift, act)


def _empty_scale_shift_act(a: Mapping[str, Any]) -> Any:
    return e.zeros_like(a["x"])


def _broadcast_reduction(a: Mapping[str, Any]) -> int:
    """Elements of x summed into one element of grad_scale or grad_shift (the larger of the two)."""
    sizes = [c.numel(v) if is_array(v) else 1 for v in (a["scale"], a["shift"])]
    return c.numel(a["x"]) // max(1, min(sizes))


# grad_scale and grad_shift sum over the broadcast dimensions: reduction tolerances.
@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="scale_shift_act", reduction=_broadcast_reduction)
def scale_shift_act_backward(
    grad_out: Tensor,
    x: Tensor,
    scale: ScalarOrTensor = 1.0,
    shift: ScalarOrTensor = 0.0,
    act: str = "relu",
    output_mask: OutputMask = (True, True, True),
) -> tuple:
    """Gradients of scale_shift_act: (grad_x, grad_scale, grad_shift).

    grad_scale and grad_shift have the shape of scale and shift (summed over broadcast dimensions;
    0-d for Python numbers) and x's dtype. ``output_mask`` says which of the three to compute; the
    others come back None (the autograd node asks for no gradient of a number, so a ReLU or a
    bias-free activation costs no reduction).
    """


@scale_shift_act_backward.checker
def _check_scale_shift_act_backward(grad_out, x, scale, shift, act, output_mask):
    op = "scale_shift_act_backward"
    canon = check_affine(op, x, scale, shift, act)
    c.same_dtype(op, "grad_out", grad_out, "x", x)
    c.shape_is(op, "grad_out", grad_out, c.shape_of(x), "(the shape of x)")
    return {**canon, "output_mask": c.bool_tuple(op, "output_mask", output_mask, 3)}


@scale_shift_act.fake
def _fake_scale_shift_act(a):
    return like(a["x"])


@scale_shift_act_backward.fake
def _fake_scale_shift_act_backward(a):
    x = a["x"]
    return e.masked((like(x), number_grad(a["scale"], x), number_grad(a["shift"], x)), a["output_mask"])


def _empty_scale_shift_act_backward(a: Mapping[str, Any]) -> tuple:
    """Zero gradients: grad_scale and grad_shift of their parameter's shape (0-d for numbers)."""
    x = a["x"]
    grads = (e.zeros_like(x), *(e.zeros(x, a[n].shape if is_array(a[n]) else ()) for n in ("scale", "shift")))
    return e.masked(grads, a["output_mask"])


# zero-size inputs: each op's empty rule (the dispatcher answers such calls with it, no kernel runs)
scale_shift_act.empty(_empty_scale_shift_act)
scale_shift_act_backward.empty(_empty_scale_shift_act_backward)


__all__ = ["scale_shift_act", "scale_shift_act_backward", "ACTIVATIONS"]
