"""scale_shift_act and its backward: one Triton pass each (see hal.triton.elementwise)."""

from __future__ import annotations

from . import launch
from ._common import FLOATS, family, kernel


@kernel("scale_shift_act", name="triton", priority=20, dtypes=FLOATS, triton=True)
def scale_shift_act(x, scale, shift, act):
    return family("elementwise").affine_act(x, scale, shift, act, **launch.elementwise(x))


@kernel("scale_shift_act_backward", name="triton", priority=20, dtypes=FLOATS, triton=True)
def scale_shift_act_backward(grad_out, x, scale, shift, act):
    return family("elementwise").affine_act_backward(grad_out, x, scale, shift, act, **launch.elementwise(x))
