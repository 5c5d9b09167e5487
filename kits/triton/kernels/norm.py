"""layer_norm and rms_norm, forward and backward, and rms_norm_amax (the forward reducing its
result's amax). Launch configuration: the plugin's ``rows`` blocks for rows of the normalised
length; for the backward the fastest of the plugin's ``norm_backward_candidates`` measured on this
device per problem (cached by :mod:`hal_triton.autotune`), the first (``rows`` with
``persistent_programs`` programs) wherever tuning does not happen."""

from __future__ import annotations

from typing import Any

import torch

from .. import autotune
from .kit import FIRST, Kit, family


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _backward_key(x: torch.Tensor, n: int, has_weight: bool, rms: bool) -> str:
    """The autotune key of a norm backward: rows bucketed, the row length exact."""
    rows = x.numel() // n if n else 0
    return f"{'rms' if rms else 'layer'}_norm_backward/{x.dtype}/m{autotune.bucket(rows)}/n{n}/{'w' if has_weight else 'no_w'}"


def _backward_bytes(x: torch.Tensor) -> int:
    """The bytes a norm backward must move: x and grad_out read, grad_x written."""
    return 3 * x.numel() * x.element_size()


def register(kit: Kit) -> None:
    tables = kit.tables

    def norm_forward(x, normalized_shape, weight, bias, eps, rms, amax=False):
        n = _numel(normalized_shape)
        return family("norm").norm_forward(x, n, weight, bias, eps, rms, amax=amax, **tables.rows(x, n))

    def norm_backward(grad_out, x, normalized_shape, weight, eps, rms):
        n = _numel(normalized_shape)
        norm = family("norm")

        def run(cfg):  # fresh grad_x and partial sums each run: timing candidates on the call's inputs is safe
            return norm.norm_backward(grad_out, x, n, weight, eps, rms, **vars(cfg))

        cfg = autotune.choose(tables, x.device, _backward_key(x, n, weight is not None, rms), lambda: tables.norm_backward_candidates(x, n), run,
                              autotune.streaming_work(_backward_bytes(x)))
        return run(cfg)

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
