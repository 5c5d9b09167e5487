"""FP8 on the CPU: the CPU has no FP8 arithmetic, so these kernels emulate it with
the torch casts and ``torch._scaled_mm`` of :mod:`hal_torch.fp8` (see that module), vectorised by torch."""

from __future__ import annotations

from hal.plugin_sdk.arrays import FLOAT_DTYPES
from hal_torch import fp8 as eager

from ._common import kernel

kernel("fp8_quantize", name="torch", priority=20, dtypes=FLOAT_DTYPES)(eager.fp8_quantize)
kernel("fp8_quantize_transpose", name="torch", priority=20, dtypes=FLOAT_DTYPES)(eager.fp8_quantize_transpose)
kernel("fp8_quantize_amax", name="torch", priority=20, dtypes=FLOAT_DTYPES)(eager.fp8_quantize_amax)
kernel("fp8_quantize_transpose_amax", name="torch", priority=20, dtypes=FLOAT_DTYPES)(eager.fp8_quantize_transpose_amax)
kernel("fp8_quantize_from_amax", name="torch", priority=20, dtypes=FLOAT_DTYPES)(eager.fp8_quantize_from_amax)
kernel("fp8_quantize_transpose_from_amax", name="torch", priority=20, dtypes=FLOAT_DTYPES)(eager.fp8_quantize_transpose_from_amax)
kernel("fp8_dequantize", name="torch", priority=20, dtypes=("uint8",))(eager.fp8_dequantize)
kernel("fp8_scaled_mm", name="torch", priority=20, dtypes=("uint8",))(eager.fp8_scaled_mm)
