"""layer_norm and rms_norm, forward and backward, and rms_norm_amax (the forward reducing its
result's amax). Launch configuration: the plugin's ``rows`` blocks
for rows of the normalised length, and its ``persistent_programs`` for the backward (each program
keeps partial parameter gradients)."""

from __future__ import annotations

from typing import Any

from .kit import FIRST, Kit, family


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def register(kit: Kit) -> None:
    tables = kit.tables

    def norm_forward(x, normalized_shape, weight, bias, eps, rms, amax=False):
        n = _numel(normalized_shape)
        return family("norm").norm_forward(x, n, weight, bias, eps, rms, amax=amax, **tables.rows(x, n))

    def norm_backward(grad_out, x, normalized_shape, weight, eps, rms):
        n = _numel(normalized_shape)
        return family("norm").norm_backward(grad_out, x, n, weight, eps, rms, programs=tables.persistent_programs(x), **tables.rows(x, n))

    @kit.kernel("layer_norm", "triton", FIRST)
    def layer_norm(x, normalized_shape, weight, bias, eps):
        return norm_forward(x, normalized_shape, weight, bias, eps, False)

    @kit.kernel("layer_norm_backward", "triton", FIRST)
    def layer_norm_backward(grad_out, x, normalized_shape, weight, eps):
        dx, dw, db = norm_backward(grad_out, x, normalized_shape, weight, eps, False)
        return dx, dw.view(normalized_shape), db.view(normalized_shape)

    @kit.kernel("rms_norm", "triton", FIRST)
    def rms_norm(x, normalized_shape, weight, eps):
        return norm_forward(x, normalized_shape, weight, None, eps, True)

    @kit.kernel("rms_norm_amax", "triton", FIRST)
    def rms_norm_amax(x, normalized_shape, weight, eps):
        return norm_forward(x, normalized_shape, weight, None, eps, True, amax=True)

    @kit.kernel("rms_norm_backward", "triton", FIRST)
    def rms_norm_backward(grad_out, x, normalized_shape, weight, eps):
        dx, dw, _ = norm_backward(grad_out, x, normalized_shape, weight, eps, True)
        return dx, dw.view(normalized_shape)
