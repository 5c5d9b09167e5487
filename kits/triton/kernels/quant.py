"""Quantisation: quantize, dequantize, fake_quantize and its backward, and int8_linear's epilogue
after a library int8 GEMM (:func:`int32_dequant`). Launch configuration: the plugin's
``elementwise`` blocks for the array read."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..tables import LaunchTables
from .kit import FIRST, Kit, OUT_DTYPES, family

QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}
QDTYPES = {"int8": torch.int8, "uint8": torch.uint8}


def register(kit: Kit) -> None:
    tables = kit.tables

    @kit.kernel("quantize", "triton", FIRST)
    def quantize(x, scale, zero_point, axis, dtype):
        qmin, qmax = QRANGE[dtype]
        return family("quant").quantize(x, scale, zero_point, axis, QDTYPES[dtype], qmin, qmax, **tables.elementwise(x))

    @kit.kernel("dequantize", "triton", FIRST, dtypes=("int8", "uint8"))
    def dequantize(q, scale, zero_point, axis):
        out = scale.dtype if isinstance(scale, torch.Tensor) else torch.float32
        return family("quant").dequantize(q, scale, zero_point, axis, out, **tables.elementwise(q))

    @kit.kernel("fake_quantize", "triton", FIRST)
    def fake_quantize(x, scale, zero_point, quant_min, quant_max, axis):
        return family("quant").fake_quantize(x, scale, zero_point, quant_min, quant_max, axis, **tables.elementwise(x))

    @kit.kernel("fake_quantize_backward", "triton", FIRST)
    def fake_quantize_backward(grad_out, x, scale, zero_point, quant_min, quant_max, axis):
        return family("quant").fake_quantize_backward(grad_out, x, scale, zero_point, quant_min, quant_max, axis, **tables.elementwise(x))


def int32_dequant(tables: LaunchTables, acc: torch.Tensor, x_scale: Any, w_scale: Any, bias: Optional[torch.Tensor], out_dtype: str) -> torch.Tensor:
    """int8_linear's epilogue after a library int8 GEMM: ``acc * x_scale * w_scale[n] + bias``."""
    return family("quant").int32_dequant(acc, x_scale, w_scale, bias, OUT_DTYPES[out_dtype], **tables.elementwise(acc))
