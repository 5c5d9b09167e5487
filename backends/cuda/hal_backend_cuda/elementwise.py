"""A bare ReLU (or identity) through torch's own kernel: scale_shift_act with scale 1 and shift 0
as numbers, the last op of fused_conv_bn_relu's training decomposition.

Above the Triton kernel (20) for these calls only: measured on the H200 on 2026-12-01
(benchmarks/host_training.py), torch's ReLU costs 11-12 us of host time against 26-36 us for the
Triton launch, and its backward (threshold_backward) 13 us against 34-39 us; both are one pass
over memory. A residual added before the ReLU (``torch_residual``) runs as torch's add and ReLU for
the same reasons. Every other scale_shift_act (an affine, a transcendental activation, parameter
gradients) stays with Triton, where the fusion saves passes.
"""

from __future__ import annotations

from hal.plugin import Inputs
from hal_torch.elementwise import (EXACT_ACTS, exact_activation, exact_activation_grad, identity_affine, residual_activation,
                                           residual_activation_reasons)

from ._common import FLOATS, kernel


def _bare(inputs: Inputs) -> list[str]:
    if inputs["act"] not in EXACT_ACTS or not identity_affine(inputs["scale"], inputs["shift"]):
        return ["not a bare activation (this kernel runs act none or relu with scale 1 and shift 0 as numbers)"]
    return []


def _grad_x_only(inputs: Inputs) -> list[str]:
    _, want_scale, want_shift = inputs["output_mask"]
    return ["gradients of scale or shift asked for"] if want_scale or want_shift else []


@kernel("scale_shift_act", name="torch", priority=25, dtypes=FLOATS, checks=[_bare], differentiable=True)
def bare_activation(x, scale, shift, act):
    return exact_activation(x, act)


# relu(x + residual), the last step of fused_conv_bn_add_relu's training decomposition: torch's add
# and in-place ReLU, as eager ResNet code runs them, recorded by torch's autograd. Triton's fused
# kernel (20) reads and writes less in the forward (3 against 5 activation-sized passes) but more in
# the backward (grad_x and grad_shift written apart: 5 against threshold_backward's 3, whose one
# result autograd hands to both addends), and costs more host time per call.
kernel("scale_shift_act", name="torch_residual", priority=25, dtypes=FLOATS, checks=[residual_activation_reasons],
       differentiable=True)(residual_activation)


@kernel("scale_shift_act_backward", name="torch", priority=25, dtypes=FLOATS, checks=[_bare, _grad_x_only])
def bare_activation_backward(grad_out, x, scale, shift, act, output_mask):
    return exact_activation_grad(grad_out, x, act) if output_mask[0] else None, None, None
