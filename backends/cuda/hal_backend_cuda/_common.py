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


def numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
