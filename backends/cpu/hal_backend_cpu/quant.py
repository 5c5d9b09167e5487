"""quantize, dequantize, fake_quantize (+ backward) and int8_linear: torch's CPU kernels
(``fake_quantize_per_*_affine``, the int8 GEMM ``torch._int_mm``), and one-pass numba kernels for
QuantizeLinear / DequantizeLinear and the int8 GEMM's dequantising epilogue."""

from __future__ import annotations

from hal.eager import quant as eager

from ._common import FLOATS, kernel

kernel("quantize", name="torch", priority=20, dtypes=FLOATS)(eager.quantize)
kernel("dequantize", name="torch", priority=20, dtypes=("int8", "uint8"))(eager.dequantize)
kernel("fake_quantize", name="torch", priority=20, dtypes=FLOATS)(eager.fake_quantize)
kernel("fake_quantize_backward", name="torch", priority=20, dtypes=FLOATS)(eager.fake_quantize_backward)
kernel("int8_linear", name="torch", priority=20)(eager.int8_linear)
