"""The ``eager`` backend: every op of the registry written in eager PyTorch.

These are the peers of hal's kernels: the reference that cpu_ref is checked against (run on float64
CPU tensors), the eager baseline of ``hal bench``, what a fast CPU backend builds on for torch
tensors, and a lower-priority backend on GPUs (any torch device: CPU, CUDA, ROCm), below the device's
own backend and below cpu_ref on the CPU, so the dispatcher only picks it when forced
(``hal.use(backend="eager")``) or as a counted fallback. Each function has its op's parameters, in
order, and receives canonical arguments (as kernels do: stride as a pair, padding as (top, bottom,
left, right), dim >= 0, eps resolved ...), torch tensors in and out; in-place ops mutate in place as
the op does. Backward ops are computed with torch.autograd through the forward.

One module per op family, each listing its functions in ``__all__`` under the op's name; importing
this package registers them all as kernels named ``torch`` (entry point ``eager`` of the
``hal-backend-eager`` distribution, backends/eager; the cpu, cuda and rocm plugins build on its
functions and depend on it).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from hal.plugin import Plugin

__version__ = "0.1.0"

FAMILIES = ("conv", "elementwise", "gemm", "norm", "attention", "mixed_precision", "quant", "fp8", "transformer", "loss")

#: the backend's priority: below cpu_ref (0) on the CPU and below any vendor backend on a GPU.
PRIORITY = -10

plugin = Plugin("eager", __version__, summary="every op in eager PyTorch: the reference of cpu_ref, the benchmark baseline")
plugin.define_backend(priority=PRIORITY, device_types=("cpu", "cuda", "rocm"), array_api="torch")

_TABLE: dict[str, Callable[..., Any]] = {}
for _family in FAMILIES:
    _module = importlib.import_module(f"hal_backend_eager.{_family}")
    _checks = getattr(_module, "CHECKS", {})  # an op's capability check, where torch's call needs one
    for _name in _module.__all__:
        _fn = getattr(_module, _name)
        _TABLE[_name] = _fn
        plugin.kernel(_name, name="torch", fused=False, check=_checks.get(_name))(_fn)


def eager(op: str) -> Callable[..., Any]:
    """The eager PyTorch implementation of ``op`` (KeyError when there is none)."""
    if op not in _TABLE:
        raise KeyError(f"no eager PyTorch implementation of {op!r}")
    return _TABLE[op]


def has_eager(op: str) -> bool:
    return op in _TABLE
