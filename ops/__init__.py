"""hal.ops: every op of hal, declared once (this folder is installed as the package ``hal.ops``).

Each name is the public, dispatching function of an op; ``hal.ops.<name>.op`` is its declaration.
Backward ops (``<op>_backward``) are ops too. Only declarations live here: no kernel code. An op
declared elsewhere (``hal.library.declare``) is ``hal.ops.<name>`` too, read from the registry.
``import hal`` imports this package (:func:`hal.wiring.wire`), once the dispatcher can build the
public functions.
"""

from typing import Any

from hal.registry import OPS

# Declaration order is the order of API.md (and of `hal info` and the conformance reports).
from .conv import batch_norm, batch_norm_backward, conv2d, conv2d_backward, fused_conv_bn_relu, fused_conv_bn_relu_backward  # isort: skip
from .conv import fused_conv_bn_add_relu, fused_conv_bn_add_relu_backward  # isort: skip
from .elementwise import ACTIVATIONS, scale_shift_act, scale_shift_act_backward  # isort: skip
from .gemm import grouped_gemm, grouped_gemm_backward, linear, linear_backward, matmul, matmul_backward  # isort: skip
from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward  # isort: skip
from .attention import scaled_dot_product_attention, scaled_dot_product_attention_backward, softmax, softmax_backward  # isort: skip
from .mixed_precision import amp_unscale_, fused_adamw_  # isort: skip
from .quant import dequantize, fake_quantize, fake_quantize_backward, int8_linear, quantize  # isort: skip
from .fp8 import fp8_dequantize, fp8_quantize, fp8_quantize_transpose, fp8_scaled_mm  # isort: skip
from .transformer import rotary_embedding, rotary_embedding_backward, swiglu, swiglu_backward  # isort: skip
from .loss import cross_entropy, cross_entropy_backward, linear_cross_entropy, linear_cross_entropy_backward  # isort: skip

__all__ = [
    "conv2d",
    "conv2d_backward",
    "batch_norm",
    "batch_norm_backward",
    "fused_conv_bn_relu",
    "fused_conv_bn_relu_backward",
    "fused_conv_bn_add_relu",
    "fused_conv_bn_add_relu_backward",
    "scale_shift_act",
    "scale_shift_act_backward",
    "linear",
    "linear_backward",
    "matmul",
    "matmul_backward",
    "grouped_gemm",
    "grouped_gemm_backward",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
    "softmax",
    "softmax_backward",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "amp_unscale_",
    "fused_adamw_",
    "quantize",
    "dequantize",
    "fake_quantize",
    "fake_quantize_backward",
    "int8_linear",
    "fp8_quantize",
    "fp8_quantize_transpose",
    "fp8_dequantize",
    "fp8_scaled_mm",
    "rotary_embedding",
    "rotary_embedding_backward",
    "swiglu",
    "swiglu_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "linear_cross_entropy",
    "linear_cross_entropy_backward",
    "ACTIVATIONS",
]


def __getattr__(name: str) -> Any:
    """The public function of an op declared outside this package (``hal.library.declare``)."""
    decl = OPS.get(name)
    if decl is None:
        raise AttributeError(f"module 'hal.ops' has no attribute {name!r}")
    return decl.entry


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(OPS))
