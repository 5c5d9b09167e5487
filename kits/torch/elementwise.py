"""scale_shift_act and its gradients in eager PyTorch (the activations are shared with linear)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from hal.plugin import Inputs
from hal.plugin_sdk.activations import TORCH_ACTIVATIONS

Scalar = Union[float, torch.Tensor]

#: activation name (ops.elementwise.ACTIVATIONS) -> the PyTorch function computing it
ACTIVATION_FNS = TORCH_ACTIVATIONS


def leaf(v: Scalar, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A fresh autograd leaf of ``v``: a tensor detached from its graph, or a number as a 0-d tensor
    of ``like``'s dtype and device."""
    if isinstance(v, torch.Tensor):
        return v.detach().requires_grad_(True)
    assert like is not None, "a number needs a tensor to take its dtype and device from"
    return torch.tensor(v, dtype=like.dtype, device=like.device, requires_grad=True)


def filled_leaf(n: int, value: float, like: torch.Tensor) -> torch.Tensor:
    """An (n,) leaf of ``value`` in ``like``'s dtype, standing in for a missing parameter (a zero
    bias, a batch-norm weight of ones) so that autograd gives its gradient."""
    return like.new_full((n,), value).requires_grad_(True)


def scale_shift_act(x: torch.Tensor, scale: Scalar, shift: Scalar, act: str) -> torch.Tensor:
    """act(x * scale + shift) computed in x's dtype (scale and shift are cast to it)."""
    s = scale.to(x.dtype) if isinstance(scale, torch.Tensor) else scale
    b = shift.to(x.dtype) if isinstance(shift, torch.Tensor) else shift
    return ACTIVATION_FNS[act](x * s + b)


def detached(v: Scalar) -> Scalar:
    """A tensor cut from its graph (a number as it is): an input whose gradient is not asked for."""
    return v.detach() if isinstance(v, torch.Tensor) else v


def masked_grads(forward: Callable[[], torch.Tensor], leaves: Sequence[Any], mask: Sequence[bool], grad_out: torch.Tensor) -> tuple:
    """Autograd's gradients of ``forward()`` for the leaves ``mask`` asks for, None for the others
    (``forward`` not run when none is asked): the tail of the eager backward ops that take an
    output mask. Call it under ``torch.enable_grad()``."""
    wanted = [t for t, m in zip(leaves, mask) if m]
    if not wanted:
        return (None,) * len(mask)
    grads = iter(torch.autograd.grad(forward(), wanted, grad_out))
    return tuple(next(grads) if m else None for m in mask)


def scale_shift_act_backward(
    grad_out: torch.Tensor, x: torch.Tensor, scale: Scalar, shift: Scalar, act: str, output_mask: Sequence[bool] = (True, True, True)
) -> tuple:
    """(grad_x, grad_scale, grad_shift) by autograd; grad_scale/grad_shift in x's dtype, 0-d for
    numbers; None where ``output_mask`` is False."""
    with torch.enable_grad():
        leaves = [leaf(v, x) if m else detached(v) for v, m in zip((x, scale, shift), output_mask)]
        grads = masked_grads(lambda: scale_shift_act(*leaves, act), leaves, output_mask, grad_out)
    return tuple(None if g is None else g.to(x.dtype) for g in grads)


__all__ = ["scale_shift_act", "scale_shift_act_backward"]


#: activations that round nothing: after an identity affine they run in x's own dtype, in one pass
EXACT_ACTS = ("none", "relu")


def identity_affine(scale: Scalar, shift: Scalar) -> bool:
    """scale 1 and shift 0 as numbers: a bare activation (the training decomposition of
    fused_conv_bn_relu ends with a ReLU on its own)."""
    return not isinstance(scale, torch.Tensor) and not isinstance(shift, torch.Tensor) and scale == 1.0 and shift == 0.0


def exact_activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(x) for an act of EXACT_ACTS: one torch kernel in x's dtype."""
    return torch.relu(x) if act == "relu" else x.clone()


def residual_activation_reasons(inputs: Inputs) -> list[str]:
    """Why :func:`residual_activation` cannot run a scale_shift_act call (empty: it can)."""
    x, scale, shift = inputs["x"], inputs["scale"], inputs["shift"]
    if inputs["act"] not in EXACT_ACTS or isinstance(scale, torch.Tensor) or scale != 1.0:
        return ["not an add and bare activation (this kernel runs act none or relu, scale 1 as a number)"]
    if not isinstance(shift, torch.Tensor) or shift.shape != x.shape or shift.dtype != x.dtype:
        return ["shift is not a tensor of x's shape and dtype (a residual)"]
    return []


def residual_activation(x: torch.Tensor, scale: Scalar, shift: torch.Tensor, act: str) -> torch.Tensor:
    """``act(x + shift)`` for a residual ``shift`` of x's shape and dtype (fused_conv_bn_add_relu's
    training decomposition ends with it): torch's add and in-place ReLU in x's dtype, the kernels
    eager ResNet code runs, one rounding of the sum. Recorded by torch's autograd, whose ReLU
    backward is one pass and whose add hands that gradient to both addends."""
    y = torch.add(x, shift)
    return torch.relu_(y) if act == "relu" else y


def exact_activation_grad(grad_out: torch.Tensor, x: torch.Tensor, act: str) -> torch.Tensor:
    """grad_x of :func:`exact_activation`: one torch kernel."""
    return torch.ops.aten.threshold_backward(grad_out, x, 0) if act == "relu" else grad_out.clone()
