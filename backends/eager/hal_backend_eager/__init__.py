"""The ``eager`` backend: every op of the registry in eager PyTorch.

Its kernels are the functions of the ``hal_torch`` kit (kits/torch, shipped with hal), registered
here as kernels named ``torch`` with the kit's capability checks. They are the reference cpu_ref is
checked against (run on float64 CPU tensors), the eager baseline of ``hal bench``, and a
lower-priority backend on any torch device (CPU, CUDA, ROCm): below the device's own backend and
below cpu_ref on the CPU, so the dispatcher picks it only when forced (``hal.use(backend="eager")``)
or as a counted fallback. The cpu, cuda and rocm backends build on the same kit, not on this
backend (no backend imports another).

Entry point ``eager`` of the ``hal-backend-eager`` distribution (backends/eager).
"""

from __future__ import annotations

from hal.plugin import Plugin
from hal_torch.table import CHECKS, FUNCTIONS

__version__ = "0.1.0"

#: the backend's priority: below cpu_ref (0) on the CPU and below any vendor backend on a GPU.
PRIORITY = -10

plugin = Plugin("eager", __version__, summary="every op in eager PyTorch: the reference of cpu_ref, the benchmark baseline")
plugin.define_backend(priority=PRIORITY, device_types=("cpu", "cuda", "rocm"), array_api="torch")

for _op, _fn in FUNCTIONS.items():
    plugin.kernel(_op, name="torch", fused=False, check=CHECKS.get(_op))(_fn)
