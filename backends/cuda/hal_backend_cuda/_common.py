"""What the CUDA kernel modules share: registration defaults, lazy Triton families, checks."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any, Callable, Iterable, Optional

import torch

from hal.plugin import Inputs
from hal.triton import unavailable_reason

from . import plugin
from ._device import MIN_CAPABILITY

HALF = ("float16", "bfloat16")
FLOATS = ("float16", "bfloat16", "float32", "float64")
NOT_F64 = ("float16", "bfloat16", "float32")

Check = Callable[[Inputs], Optional[list[str]]]


def kernel(op: str, *, name: str, priority: int, dtypes: Optional[Iterable[str]] = None, checks: Iterable[Check] = (),
           triton: bool = False, min_capability: tuple[int, int] = MIN_CAPABILITY) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a CUDA kernel; ``triton=True`` adds the "Triton is installed" check."""
    all_checks = ([_triton_check] if triton else []) + list(checks)

    def check(inputs: Inputs) -> list[str]:
        reasons: list[str] = []
        for c in all_checks:
            reasons.extend(c(inputs) or [])
        return reasons

    return plugin.kernel(op, name=name, priority=priority, dtypes=dtypes, min_capability=min_capability,
                         check=check if all_checks else None)


def _triton_check(inputs: Inputs) -> list[str]:
    reason = unavailable_reason()
    return [reason] if reason else []


@functools.lru_cache(maxsize=None)
def family(name: str) -> ModuleType:
    """The hal.triton kernel family ``name``, imported on first use (importing it imports Triton)."""
    return importlib.import_module(f"hal.triton.{name}")


def contiguous_lists(*names: str) -> Check:
    """A check: every tensor of the named list arguments is contiguous (multi-tensor tables address
    them as flat runs)."""

    def check(inputs: Inputs) -> list[str]:
        for name in names:
            items = inputs[name]
            if items is not None and any(not t.is_contiguous() for t in items):
                return [f"{name} holds non-contiguous tensors (the multi-tensor kernel addresses flat runs)"]
        return []

    return check


def contiguous_vectors(*names: str) -> Check:
    """A check: the named 1-D arguments, when given, have unit stride (written or read in place)."""

    def check(inputs: Inputs) -> list[str]:
        bad = [n for n in names if isinstance(inputs[n], torch.Tensor) and inputs[n].stride(-1) != 1]
        return [f"{', '.join(bad)} must have unit stride (the kernel addresses them in place)"] if bad else []

    return check


class ieee_fp32:
    """Around a cuDNN or cuBLAS call on float32 data: TensorFloat-32 off for the call.

    hal's float32 is IEEE float32 on every backend (the conformance suite holds float32 kernels to
    float32 accuracy); PyTorch lets cuDNN convolutions round float32 operands to TF32 by default.
    Users who want TF32 speed use bfloat16 or float16 data. Other dtypes pass through untouched.
    The flags are process-wide, as PyTorch's own ``torch.backends.cudnn.flags`` are.
    """

    __slots__ = ("_on", "_saved")

    def __init__(self, dtype: torch.dtype) -> None:
        self._on = dtype == torch.float32

    def __enter__(self) -> None:
        if self._on:
            self._saved = (torch._C._get_cudnn_allow_tf32(), torch._C._get_cublas_allow_tf32())
            torch._C._set_cudnn_allow_tf32(False)
            torch._C._set_cublas_allow_tf32(False)

    def __exit__(self, *exc: object) -> None:
        if self._on:
            torch._C._set_cudnn_allow_tf32(self._saved[0])
            torch._C._set_cublas_allow_tf32(self._saved[1])


def numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
