"""Tolerance presets, per dtype, of kernels against the float64 reference.

``|out - ref| <= atol + rtol * |ref|`` elementwise. Presets marked ``per_sqrt_k`` are for ops that
accumulate over a reduction of length K (GEMM, convolution, normalisation): their atol grows with
sqrt(K), the growth of a random-walk rounding error. Half-precision rtols are a couple of units in
the last place (fp16: 2^-10, bf16: 2^-7), since kernels round their fp32 result once.
"""

from __future__ import annotations

from hal.registry import Tolerance

#: elementwise maps: one rounding of the result, plus the rounding of intermediate fp32 math.
ELEMENTWISE = {
    "float64": Tolerance(1e-12, 1e-12),
    "float32": Tolerance(1e-6, 1e-5),
    "float16": Tolerance(1e-4, 2e-3),
    "bfloat16": Tolerance(1e-3, 1.6e-2),
}

#: activations: elementwise, but gelu's ``1 + erf(x / sqrt 2)`` cancels in the negative tail, where an
#: fp32 erf good to a few ulps of 1 leaves an absolute error of ~1e-6. Measured: torch 2.13's fp32
#: CPU ``gelu`` lands up to 1.13e-6 from the float64 value near x = -3.5 (2M points over [-6, 0]).
ACTIVATION = {**ELEMENTWISE, "float32": Tolerance(2e-6, 1e-5)}

#: ops accumulating K products or terms (matmul, conv, norms, softmax, attention).
REDUCTION = {
    "float64": Tolerance(1e-12, 1e-10, per_sqrt_k=True),
    # 1e-5 * sqrt(K): a float32 sum of K unit terms that cancels to ~0 (a training-mode BN's bias
    # gradient over N*H*W = 6272 positions) lands ~1e-4 from the exact value in PyTorch's own kernels.
    "float32": Tolerance(1e-5, 2e-5, per_sqrt_k=True),
    "float16": Tolerance(2e-4, 4e-3, per_sqrt_k=True),
    "bfloat16": Tolerance(2e-3, 2.4e-2, per_sqrt_k=True),
}

#: integer results (quantize): equal, up to one step where the float math sits on a rounding tie.
INTEGER = {t: Tolerance(1.0, 0.0) for t in ("float64", "float32", "float16", "bfloat16", "int8", "uint8")}

#: ops specified in float32 arithmetic (fake_quantize, dequantize): reproducible bit for bit, up to
#: one quantisation step where x / scale lands on a rounding tie.
QUANTIZED = {
    "float64": Tolerance(1e-6, 1e-6),
    "float32": Tolerance(1e-6, 1e-6),
    "float16": Tolerance(1e-4, 1e-3),
    "bfloat16": Tolerance(1e-3, 8e-3),
    "int8": Tolerance(1e-6, 1e-6),
    "uint8": Tolerance(1e-6, 1e-6),
}
