"""hal_cpp: portable C++ kernels (the common subset of CUDA and HIP C++), compiled at run time.

For the places where a hand-written kernel beats Triton: batch norm over NHWC and NCHW with Welford
reductions in one pass (``kernels/batchnorm.cu``), multi-tensor AdamW with 16-byte accesses
(``kernels/adamw.cu``). ``include/hal_cpp.cuh`` is the portability header (``WARP_SIZE``, warp
shuffles, vector access, half-precision storage types without vendor headers).

The kit is vendor-neutral. A GPU plugin brings a runtime (see :class:`Runtime`: compile a source for
an architecture string, load a code object, launch on the current stream, and a few device facts):
the CUDA plugin's uses CuPy and NVRTC, the ROCm plugin's hiprtc; :class:`host.HostRuntime` runs
the same sources on CPU threads for the tests. Then:

- :class:`KernelModule` / :class:`Kit`: "compile these sources for this architecture and give me
  launchable functions", code objects cached on disk per runtime and architecture in
  ``$HAL_CPP_CACHE_DIR`` (default ``~/.cache/hal/cpp``);
- :func:`register`: registers the kernels as ``"cpp"`` onto a plugin;
- :func:`compile_source` and :data:`VARIANTS`: what CI compiles without a device.

``import hal_cpp`` imports no vendor package and compiles nothing; modules compile on first launch.
"""

from __future__ import annotations

from .kit import (
    C_TYPES,
    DTYPE_CODES,
    SOURCES,
    VARIANTS,
    CompileError,
    Kernel,
    KernelModule,
    KernelSig,
    Kit,
    Runtime,
    Source,
    cache_dir,
    compile_source,
)
from .register import register

__all__ = [
    "C_TYPES",
    "DTYPE_CODES",
    "SOURCES",
    "VARIANTS",
    "CompileError",
    "Kernel",
    "KernelModule",
    "KernelSig",
    "Kit",
    "Runtime",
    "Source",
    "cache_dir",
    "compile_source",
    "register",
]
