"""kits/cpp's C++ kernels on NVIDIA GPUs: batch_norm, batch_norm_backward, layer_norm_backward,
rms_norm_backward and fused_adamw_ as kernel "cpp", and fused_conv_bn_relu with its backward as
"cudnn_cpp" (cuDNN convolution, then the C++ batch norm + ReLU), all registered by the kit
(:func:`hal_cpp.register`) and compiled at run time by NVRTC through CuPy (:mod:`.cpp_runtime`).

Priority 15, below the Triton kernels (20) and torch's (25): their launches cost more host time
than torch's. In steps replayed from a CUDA graph (hal.graphs), where only device time counts, the
batch norm's forward and backward rank first (graph priority 30): in the decomposition of
fused_conv_bn_relu they made ResNet-50's graphed training step 15.47 -> 13.66 ms on the H200
(benchmarks/graph_ab.py, 2026-12-02; Triton's fused kernels with the convolution recomputed in the
backward: 19.18 ms). The multi-tensor AdamW ranks first there too: in the graphed Llama training step
(bf16 weights, float32 masters, 168 M parameters) it took 1.20 ms against Triton's 1.57 ms, 98% of
the copy bandwidth for the 30 bytes each parameter moves, and the step 10.86 -> 10.51 ms with the
same losses (graph_ab.py on the H200, 2026-12-02). Conformance forces every kernel in turn regardless. Without CuPy every kernel
here rejects with the runtime's reason and the dispatcher takes the next one.
"""

from __future__ import annotations

import hal_cpp
from hal_cpp.register import EVERYWHERE, Convolution

from . import plugin
from ._device import SM80
from .conv import conv, conv_grads
from .cpp_runtime import CupyRuntime

RUNTIME = CupyRuntime()
#: 15 in every context, but measured first in graph replays (module docstring)
GRAPH_FIRST = {**EVERYWHERE, "graph": 30}
OP_CONTEXTS = {"batch_norm": GRAPH_FIRST, "batch_norm_backward": GRAPH_FIRST, "fused_adamw_": GRAPH_FIRST}

KIT = hal_cpp.register(plugin, RUNTIME, archs=SM80, convolution=Convolution("cudnn", conv, conv_grads), op_contexts=OP_CONTEXTS)
