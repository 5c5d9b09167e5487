"""kits/cpp's C++ kernels on AMD GPUs: batch_norm, batch_norm_backward, layer_norm_backward,
rms_norm_backward and fused_adamw_ as kernel "cpp", and fused_conv_bn_relu with its backward as
"miopen_cpp" (MIOpen convolution, then the C++ batch norm + ReLU), all registered by the kit
(:func:`hal_cpp.register`) and compiled at run time by hiprtc for the device's gcnArchName
(:mod:`.cpp_runtime`), for gfx90a and gfx942.

Priority 15 in every context (the kit's default, :data:`hal_cpp.register.EVERYWHERE`), below the
Triton kernels (20): no AMD GPU has run them, so nothing says they are
faster there. They run where the Triton kernels turn inputs down and they take them (float64
AdamW), and conformance forces every kernel in turn. Where the runtime cannot run (no device,
no hiprtc) every kernel here rejects with its reason and the dispatcher takes the next one.
"""

from __future__ import annotations

import hal_cpp
from hal_cpp.register import Convolution

from . import plugin
from ._device import gfx
from .conv import conv, conv_grads
from .cpp_runtime import HipRuntime

#: CDNA GPUs (wavefront 64) hal targets; the sources would compile for any gfx, but only these are built in CI
#: (gfx90a; Debian's hiprtc cannot target gfx942)
ARCHS = gfx("gfx90a", "gfx942")

RUNTIME = HipRuntime()
KIT = hal_cpp.register(plugin, RUNTIME, archs=ARCHS, convolution=Convolution("miopen", conv, conv_grads))
