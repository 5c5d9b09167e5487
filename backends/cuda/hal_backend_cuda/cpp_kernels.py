"""hal/cpp's C++ kernels on NVIDIA GPUs: batch_norm, batch_norm_backward and fused_adamw_ as kernel
"cpp" (registered by the kit), and fused_conv_bn_relu with its backward as "cudnn_cpp" (cuDNN
convolution, then the C++ batch norm + ReLU), all compiled at run time by NVRTC through CuPy
(:mod:`.cpp_runtime`).

Priority 15, below the Triton kernels (20), until H200 measurements (benchmarks/cpp_h200.py) say
otherwise; conformance forces every kernel in turn regardless. Without CuPy every kernel here
rejects with the runtime's reason and the dispatcher takes the next one.
"""

from __future__ import annotations

import torch

import hal.cpp
from hal.cpp import batchnorm as bn
from hal.cpp.register import runtime_check

from . import plugin
from hal.triton.checks import contiguous_vectors

from ._common import FLOATS, kernel
from ._device import SM80
from .conv import conv, conv_grads
from .cpp_runtime import CupyRuntime

PRIORITY = 15

RUNTIME = CupyRuntime()
KIT = hal.cpp.register(plugin, RUNTIME, priority=PRIORITY, archs=SM80)


_runtime = runtime_check(RUNTIME)
_vectors = contiguous_vectors("running_mean", "running_var", "bn_weight", "bn_bias", "conv_bias")


@kernel("fused_conv_bn_relu", name="cudnn_cpp", priority=PRIORITY, dtypes=FLOATS, checks=[_runtime, _vectors])
def fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    y = conv(x, conv_weight, None, stride, padding, dilation, groups)
    return bn.batch_norm_forward(KIT, y, bn_weight, bn_bias, running_mean, running_var, training, momentum, eps, True, conv_bias=conv_bias)


@kernel("fused_conv_bn_relu_backward", name="cudnn_cpp", priority=PRIORITY, dtypes=FLOATS, checks=[_runtime, _vectors])
def fused_conv_bn_relu_backward(grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training):
    y = conv(x, conv_weight, None, stride, padding, dilation, groups)
    dtypes = (bn.grad_dtype(bn_weight, x), bn.grad_dtype(bn_bias, x))
    dy, g_gamma, g_beta = bn.batch_norm_backward(KIT, grad_out, y, bn_weight, bn_bias, running_mean, running_var, training, eps, True,
                                                 dtypes, conv_bias=conv_bias)
    gx, gw, gb = conv_grads(dy, x, conv_weight, stride, padding, dilation, groups)
    if training:  # the batch mean absorbs the convolution bias: its gradient is exactly zero
        gb = torch.zeros_like(gb)
    return gx, gw, gb, g_gamma, g_beta
