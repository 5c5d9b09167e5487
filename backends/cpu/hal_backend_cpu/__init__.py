"""hal's fast CPU backend: every op of hal, forward and backward, on the CPU.

Two kinds of kernels:

- ``torch`` / ``onednn``: torch's CPU kernels on torch tensors (oneDNN convolutions, also with a
  fused ReLU post-op; MKL/oneDNN GEMMs, also with activation epilogues; native norms, softmax,
  SDPA, fused AdamW). NumPy arrays reach them as zero-copy tensor views (the dispatcher's adapter).
- ``numba``: one-pass fusions torch's CPU kernels lack (scale + shift + ReLU, RMS norm and its
  backward, which torch 2.13 decomposes into several passes on the CPU), compiled by numba
  (``@njit(parallel=True, cache=True)``) on first use. They take NumPy arrays; torch tensors reach
  them as zero-copy views.

Importing the plugin registers kernels only: numba is imported when a dispatch decision first asks
whether a numba kernel can run, and each kernel compiles on its first call (cached on disk, in
``HAL_CPU_NUMBA_CACHE_DIR`` when set). Without numba, or with one that fails to import, the numba
kernels decline with that reason and the torch kernels serve every op.
"""

from __future__ import annotations

from hal.plugin import Plugin

__version__ = "0.1.0"

plugin = Plugin(name="cpu", version=__version__, summary="CPU: torch's oneDNN/MKL kernels, numba fusions")

from ._device import devices  # noqa: E402

from ._numba import unavailable_reason as _numba_reason  # noqa: E402


def _notes() -> list[str]:
    """Without a working numba the backend serves everything through torch's kernels; say so."""
    reason = _numba_reason()
    return [] if reason is None else [f"numba kernels off: {reason} (torch's kernels run those ops)"]


plugin.define_backend(priority=50, device_types=("cpu",), devices=devices, array_api="torch", notes=_notes)

# Importing the families registers their kernels on `plugin`.
from . import attention, conv, elementwise, fp8, gemm, loss, mixed_precision, norm, quant, rotary, transformer  # noqa: E402,F401
