"""What the ROCm plugin's own kernel modules share: registration defaults, dtype sets, and the IEEE
float32 guard around MIOpen and hipBLASLt calls."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional

import torch

from hal.plugin import Archs, Inputs
from hal_torch.table import eager

from . import plugin
from ._device import ANY_GFX, XF32, arch

HALF = ("float16", "bfloat16")
FLOATS = ("float16", "bfloat16", "float32", "float64")
NOT_F64 = ("float16", "bfloat16", "float32")

Check = Callable[[Inputs], Optional[list[str]]]


def kernel(op: str, *, name: str, priority: int, dtypes: Optional[Iterable[str]] = None, checks: Iterable[Check] = (),
           archs: Archs = ANY_GFX) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a kernel of the rocm backend (any AMD GPU torch supports unless ``archs`` narrows it)."""
    all_checks = list(checks)

    def check(inputs: Inputs) -> list[str]:
        return [r for c in all_checks for r in (c(inputs) or [])]

    return plugin.kernel(op, name=name, priority=priority, dtypes=dtypes, archs=archs, check=check if all_checks else None)


def eager_kernel(op: str, *, name: str, priority: int, dtypes: Optional[Iterable[str]] = None, checks: Iterable[Check] = (),
                 archs: Archs = ANY_GFX, wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda fn: fn) -> Callable[..., Any]:
    """Register torch's own implementation of ``op`` (:mod:`hal_torch`; on a ROCm build it runs
    MIOpen, hipBLAS(Lt), AOTriton and torch's HIP kernels), ``wrap``-ped, as a kernel of the rocm
    backend with float32 kept IEEE; returns the registered function."""
    fn = wrap(eager(op))

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        with ieee_fp32(_first_tensor(args)):
            return fn(*args)

    return kernel(op, name=name, priority=priority, dtypes=dtypes, checks=checks, archs=archs)(run)


def _first_tensor(args: tuple) -> Optional[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]
    return None


class ieee_fp32:
    """Around a MIOpen or hipBLASLt call on float32 data of a device whose matrix cores have xf32
    (gfx942): TF32/XF32 off for the call.

    hal's float32 is IEEE float32 on every backend. On ROCm builds torch's ``allow_tf32`` flags let
    hipBLASLt and MIOpen round float32 operands to xf32 where the hardware has it; elsewhere
    (gfx90a) there is nothing to turn off and the flags are left alone. The flags are process-wide,
    as PyTorch's own ``torch.backends.cudnn.flags`` are.
    """

    __slots__ = ("_on", "_saved")

    def __init__(self, x: Optional[torch.Tensor]) -> None:
        self._on = x is not None and x.dtype == torch.float32 and XF32.accepts(arch(x.device) or "")

    def __enter__(self) -> None:
        if self._on:
            self._saved = [get() for get, _ in _TF32_FLAGS]
            for _, set_flag in _TF32_FLAGS:
                set_flag(False)

    def __exit__(self, *exc: object) -> None:
        if self._on:
            for (_, set_flag), value in zip(_TF32_FLAGS, self._saved):
                set_flag(value)


#: (get, set) of torch's TF32 switches: MIOpen convolutions, then hipBLAS(Lt) GEMMs
_TF32_FLAGS = (
    (torch._C._get_cudnn_allow_tf32, torch._C._set_cudnn_allow_tf32),
    (torch._C._get_cublas_allow_tf32, torch._C._set_cublas_allow_tf32),
)
