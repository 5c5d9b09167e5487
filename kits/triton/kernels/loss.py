"""Losses: cross-entropy rows (online log-sum-exp), and the LM head with it, ``<blas>_triton``
(blocks of rows through the vendor's float32 GEMM, never all logits at once). Launch configuration:
the plugin's ``rows`` blocks for rows of the class count, and :data:`LCE_BLOCK_ELEMENTS`."""

from __future__ import annotations

from typing import Any

import torch

from ..tables import interpreted
from .kit import FIRST, Kit, family

#: logits linear_cross_entropy holds at once on a GPU (float32: 1 GiB). Each block of rows adds its
#: part of grad_weight (vocab x hidden, float32) into the accumulator, so fewer, larger blocks move
#: less: at 2^26 a Llama-3 LM head (4096 tokens, vocab 128256, d 2048) took 8 blocks and 24.9 ms
#: forward + backward on an H100 against torch.compile's 10.1 (benchmarks/levers40.py, 2026-12-07)
LCE_BLOCK_ELEMENTS = 1 << 28
#: the same under the Triton interpreter (CPU tensors): several blocks on tiny inputs
INTERPRETED_LCE_BLOCK_ELEMENTS = 64


def register(kit: Kit) -> None:
    tables, gemm_f32 = kit.tables, kit.vendor.gemm_f32

    def ce_launch(z: torch.Tensor) -> dict[str, int]:
        cfg = tables.rows(z, int(z.shape[-1]))
        return {"block_c": cfg["block_n"], "num_warps": cfg["num_warps"]}

    def lce_launch(x: torch.Tensor, weight: torch.Tensor) -> dict[str, Any]:
        cfg = tables.rows(x, int(weight.shape[0]))
        return {"block_c": cfg["block_n"], "num_warps": cfg["num_warps"], "gemm_f32": gemm_f32,
                "block_elements": INTERPRETED_LCE_BLOCK_ELEMENTS if interpreted(x) else LCE_BLOCK_ELEMENTS}

    @kit.kernel("cross_entropy", "triton", FIRST)
    def cross_entropy(logits, target, ignore_index, label_smoothing, reduction):
        return family("loss").cross_entropy(logits, target, ignore_index, label_smoothing, reduction, **ce_launch(logits))

    @kit.kernel("cross_entropy_backward", "triton", FIRST)
    def cross_entropy_backward(grad_out, logits, target, ignore_index, label_smoothing, reduction):
        return family("loss").cross_entropy_backward(grad_out, logits, target, ignore_index, label_smoothing, reduction, **ce_launch(logits))

    @kit.kernel("linear_cross_entropy", f"{kit.vendor.blas_name}_triton", FIRST)
    def linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, reduction):
        return family("loss").linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, reduction, **lce_launch(x, weight))

    @kit.kernel("linear_cross_entropy_backward", f"{kit.vendor.blas_name}_triton", FIRST)
    def linear_cross_entropy_backward(grad_out, x, weight, target, bias, ignore_index, label_smoothing, reduction):
        return family("loss").linear_cross_entropy_backward(grad_out, x, weight, target, bias, ignore_index, label_smoothing, reduction,
                                                            **lce_launch(x, weight))
