"""hal's NVIDIA backend: every op of hal on CUDA GPUs (compute capability 8.0 and newer).

Vendor libraries through torch where they are the best tool (cuDNN convolution and its fused
conv + bias + ReLU, cuBLAS/cuBLASLt GEMMs with epilogues, ``torch._int_mm``, the SDPA backends);
Triton kernels from :mod:`hal.triton` for the fusions (batch norm + ReLU, scale_shift_act, norms,
softmax, grouped GEMM, multi-tensor AdamW, quantisation), launched with this plugin's NVIDIA
configurations (:mod:`hal_backend_cuda.launch`) and autotuned tiles cached per device
(:mod:`hal_backend_cuda.autotune`).

Importing the plugin registers kernels only: Triton is imported, and kernels are compiled, on first
use. Every kernel keeps the device asynchronous (nothing is read back to the host), so sequences of
ops can be captured in CUDA graphs.
"""

from __future__ import annotations

from hal.plugin import Plugin

__version__ = "0.1.0"

plugin = Plugin(name="cuda", version=__version__, summary="NVIDIA GPUs: cuDNN/cuBLAS through torch, Triton fusions")

from ._device import capability, devices, probe  # noqa: E402

plugin.define_backend(priority=100, device_types=("cuda",), probe=probe, devices=devices, capability=capability, array_api="torch")

# Importing the families registers their kernels on `plugin`.
from . import attention, conv, cpp_kernels, elementwise, gemm, mixed_precision, norm, quant  # noqa: E402,F401
