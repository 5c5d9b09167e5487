"""softmax and its backward along any dimension. Launch configuration: the plugin's ``rows`` blocks
for rows of the softmax's length, and its ``columns`` (neighbouring columns per program where the
softmax reduces another dimension than the last)."""

from __future__ import annotations

from typing import Any

import torch

from .kit import FIRST, Kit, family


def _has_rows(inputs: Any) -> list[str]:
    x = inputs["x"] if "x" in inputs.op.param_names else inputs["out"]
    return [] if x.ndim else ["0-d input (a softmax over one value: the torch kernel runs it)"]


def register(kit: Kit) -> None:
    tables = kit.tables

    def launch(x: torch.Tensor, dim: int) -> dict[str, int]:
        return {**tables.rows(x, int(x.shape[dim])), "block_i": tables.columns(x)}

    @kit.kernel("softmax", "triton", FIRST, checks=(_has_rows,))
    def softmax(x, dim):
        return family("softmax").softmax(x, dim, **launch(x, dim))

    @kit.kernel("softmax_backward", "triton", FIRST, checks=(_has_rows,))
    def softmax_backward(grad_out, out, dim):
        return family("softmax").softmax_backward(grad_out, out, dim, **launch(out, dim))
