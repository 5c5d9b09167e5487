"""Transformer pieces: rotary position embeddings and the SwiGLU gate (and swiglu_amax, the gate
reducing its result's amax), forward and backward, where
the arrays' layout lets one program walk rows (:mod:`hal_triton.layouts`). Launch configuration:
the plugin's ``elementwise`` blocks (for rotary, as rows of the embedding's width per block)."""

from __future__ import annotations

from typing import Any

import torch

from ..checks import Check
from ..layouts import rotary_geometry, swiglu_geometry
from .kit import FIRST, Kit, family


def _rotary_layout(inputs: Any) -> list[str]:
    x = inputs["x"] if "x" in inputs.op.param_names else inputs["grad_out"]
    if rotary_geometry(x, inputs["cos"], inputs["sin"]) is None:
        return ["x has more than two leading dimensions that do not merge in memory (the torch kernel runs it)"]
    return []


def _swiglu_layout(*names: str) -> Check:
    def check(inputs: Any) -> list[str]:
        if swiglu_geometry(*(inputs[n] for n in names)) is not None:
            return []
        return [f"{', '.join(names)} broadcast, or are neither dense in one layout nor rows of their last dimension "
                "(the torch kernel runs them)"]

    return check


def register(kit: Kit) -> None:
    tables = kit.tables

    def rotary_launch(x: torch.Tensor) -> dict[str, int]:
        cfg = tables.elementwise(x)
        rows = max(1, cfg["block_elems"] // max(1, int(x.shape[-1])))
        return {"block_r": 1 << (rows.bit_length() - 1), "num_warps": cfg["num_warps"]}  # a power of two

    @kit.kernel("rotary_embedding", "triton", FIRST, checks=(_rotary_layout,))
    def rotary_embedding(x, cos, sin, interleaved):
        return family("transformer").rotary(x, cos, sin, interleaved, False, **rotary_launch(x))

    @kit.kernel("rotary_embedding_backward", "triton", FIRST, checks=(_rotary_layout,))
    def rotary_embedding_backward(grad_out, cos, sin, interleaved):
        return family("transformer").rotary(grad_out, cos, sin, interleaved, True, **rotary_launch(grad_out))

    @kit.kernel("swiglu", "triton", FIRST, checks=(_swiglu_layout("gate", "up"),))
    def swiglu(gate, up):
        return family("transformer").swiglu(gate, up, **tables.elementwise(gate))

    @kit.kernel("swiglu_amax", "triton", FIRST, checks=(_swiglu_layout("gate", "up"),))
    def swiglu_amax(gate, up):
        return family("transformer").swiglu(gate, up, amax=True, **tables.elementwise(gate))

    @kit.kernel("swiglu_backward", "triton", FIRST, checks=(_swiglu_layout("grad_out", "gate", "up"),))
    def swiglu_backward(grad_out, gate, up):
        return family("transformer").swiglu_backward(grad_out, gate, up, **tables.elementwise(gate))
