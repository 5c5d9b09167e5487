"""hal's AMD backend: every op of hal on AMD GPUs through a ROCm build of torch.

Vendor libraries through torch where they are the best tool (MIOpen convolution and its fused
conv + bias + ReLU, hipBLASLt GEMMs with epilogues, ``torch._int_mm``, the SDPA backends of
AOTriton); the shared Triton kernels of :mod:`hal_triton` for the fusions (batch norm + ReLU,
scale_shift_act, norms, softmax, grouped GEMM, multi-tensor AdamW, quantisation), registered by
:func:`hal_triton.kernels.register` with this plugin's AMD launch tables
(:mod:`hal_backend_rocm.launch`: 64-lane wavefronts, ``waves_per_eu``, ``matrix_instr_nonkdim``,
``kpack``) for gfx90a (MI200) and gfx942 (MI300); torch's own kernels for the rest and for other
AMD GPUs (:mod:`hal_backend_rocm.fallbacks`). Hand-written HIP C++ compiles at run time with
hiprtc (:mod:`hal_backend_rocm.hiprtc`).

torch names ROCm devices "cuda"; hal sends them here when ``torch.version.hip`` is set. Importing
the plugin registers kernels only: no HIP call, no Triton import, no compilation.
"""

from __future__ import annotations

from hal.plugin import Plugin

__version__ = "0.1.0"

plugin = Plugin(name="rocm", version=__version__, summary="AMD GPUs: MIOpen/hipBLASLt through torch, Triton fusions")

from hal_triton.kernels import VendorLibs, register  # noqa: E402

from ._device import TRITON_ARCHS, arch, devices, probe  # noqa: E402
from .launch import TABLES  # noqa: E402

plugin.define_backend(priority=100, device_types=("rocm",), probe=probe, devices=devices, arch=arch, array_api="torch")

# The vendor-library kernels register themselves on `plugin` when their modules are imported; the
# shared Triton kernels are registered by the kit with this plugin's tables and libraries.
from . import attention, conv, gemm  # noqa: E402,F401

VENDOR = VendorLibs("miopen", conv.conv, conv.conv_grads, "hipblas", gemm.blas_linear, gemm.gemm_f32)
TRITON_KERNELS = register(plugin, TABLES, archs=TRITON_ARCHS, vendor=VENDOR)

from . import quant  # noqa: E402,F401  (builds on the Triton int8 GEMM)
from . import fp8  # noqa: E402,F401  (hipBLASLt's FP8 GEMM)
from . import cpp_kernels  # noqa: E402,F401  (kits/cpp's C++ kernels, compiled by hiprtc)
from . import fallbacks  # noqa: E402,F401  (last: it reads what the others registered)
