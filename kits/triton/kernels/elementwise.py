"""scale_shift_act and its backward: ``act(x * scale + shift)`` in one Triton pass. Launch
configuration: the plugin's ``elementwise`` blocks for x."""

from __future__ import annotations

from .kit import FIRST, Kit, family


def register(kit: Kit) -> None:
    tables = kit.tables

    @kit.kernel("scale_shift_act", "triton", FIRST)
    def scale_shift_act(x, scale, shift, act):
        return family("elementwise").affine_act(x, scale, shift, act, **tables.elementwise(x))

    @kit.kernel("scale_shift_act_backward", "triton", FIRST)
    def scale_shift_act_backward(grad_out, x, scale, shift, act, output_mask):
        return family("elementwise").affine_act_backward(grad_out, x, scale, shift, act, output_mask, **tables.elementwise(x))
