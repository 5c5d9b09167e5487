"""hal/cpp's C++ kernels on NVIDIA GPUs: batch_norm, batch_norm_backward, layer_norm_backward,
rms_norm_backward and fused_adamw_ as kernel "cpp", and fused_conv_bn_relu with its backward as
"cudnn_cpp" (cuDNN convolution, then the C++ batch norm + ReLU), all registered by the kit
(:func:`hal.cpp.register`) and compiled at run time by NVRTC through CuPy (:mod:`.cpp_runtime`).

Priority 15, below the Triton kernels (20), until H200 measurements (benchmarks/cpp_h200.py) say
otherwise; conformance forces every kernel in turn regardless. Without CuPy every kernel here
rejects with the runtime's reason and the dispatcher takes the next one.
"""

from __future__ import annotations

import hal.cpp
from hal.cpp.register import Convolution

from . import plugin
from ._device import SM80
from .conv import conv, conv_grads
from .cpp_runtime import CupyRuntime

PRIORITY = 15

RUNTIME = CupyRuntime()
KIT = hal.cpp.register(plugin, RUNTIME, priority=PRIORITY, archs=SM80, convolution=Convolution("cudnn", conv, conv_grads))
