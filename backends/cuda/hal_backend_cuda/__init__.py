"""hal's NVIDIA backend: every op of hal on CUDA GPUs (compute capability 8.0 and newer).

Vendor libraries through torch where they are the best tool (cuDNN convolution and its fused
conv + bias + ReLU, cuBLAS/cuBLASLt GEMMs with epilogues, ``torch._int_mm``, ``torch._grouped_mm``, the SDPA backends);
the shared Triton kernels of :mod:`hal_triton` for the fusions (batch norm + ReLU, scale_shift_act,
norms, softmax, grouped GEMM, multi-tensor AdamW, quantisation), registered by
:func:`hal_triton.kernels.register` with this plugin's NVIDIA launch tables
(:mod:`hal_backend_cuda.launch`); autotuned tiles are cached per device model. Where torch's own
kernel costs less host time than a Triton launch and does the same passes (the training batch
norm, a bare ReLU, SwiGLU, RMS norm below 16M elements: :mod:`.conv`, :mod:`.elementwise`,
:mod:`.transformer`, :mod:`.norm`), that one ranks first, and calls with autograd let torch's
autograd record it (kernels registered ``differentiable``); the modules' comments and
PERF_NOTES.md have the measurements.

Importing the plugin registers kernels only: Triton is imported, and kernels are compiled, on first
use. Every kernel keeps the device asynchronous (nothing is read back to the host), so sequences of
ops can be captured in CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

from hal.plugin import Plugin

__version__ = "0.1.0"

plugin = Plugin(name="cuda", version=__version__, summary="NVIDIA GPUs: cuDNN/cuBLAS through torch, Triton fusions")

from hal_triton.kernels import VendorLibs, register  # noqa: E402

from ._device import SM80, arch, devices, probe  # noqa: E402
from .launch import TABLES  # noqa: E402

# kernel choices measured on the project's machines (hal tune --export): they seed each device's tune cache
_SEEDS = Path(__file__).parent / "tuned" / "dispatch"
plugin.define_backend(priority=100, device_types=("cuda",), probe=probe, devices=devices, arch=arch, array_api="torch", tuning_seeds=_SEEDS)

# The vendor-library kernels register themselves on `plugin` when their modules are imported; the
# shared Triton kernels are registered by the kit with this plugin's tables and libraries.
from . import attention, conv, elementwise, gemm, losses, mixed_precision, norm, transformer  # noqa: E402,F401

TRITON_KERNELS = register(plugin, TABLES, archs=SM80,
                          vendor=VendorLibs("cudnn", conv.conv, conv.conv_grads, "cublas", gemm.blas_linear, gemm.gemm_f32))

from . import cpp_kernels, grouped, quant  # noqa: E402,F401  (build on the Triton kernels and the C++ kit)
from . import fp8  # noqa: E402,F401  (cuBLASLt's FP8 GEMM; before eager_kernels: it registers the checked emulation)
from . import eager_kernels  # noqa: E402,F401  (last: torch's own kernel for every op, a measured candidate)
