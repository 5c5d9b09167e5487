"""Every op's eager PyTorch function and its capability check, gathered from the family modules:
what the ``eager`` backend registers, and what the cuda and rocm backends look up to register
torch's own implementation of an op beside (or below) their kernels."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Optional

from hal.plugin import Inputs

from . import attention, conv, elementwise, fp8, gemm, loss, mixed_precision, norm, quant, transformer

Check = Callable[[Inputs], Optional[list[str]]]

#: the family modules, in the order their functions are registered
FAMILIES: tuple[ModuleType, ...] = (conv, elementwise, gemm, norm, attention, mixed_precision, quant, fp8, transformer, loss)

#: op name -> its eager PyTorch function
FUNCTIONS: dict[str, Callable[..., Any]] = {name: getattr(module, name) for module in FAMILIES for name in module.__all__}

#: op name -> the capability check its function needs as a kernel (where torch's call needs one)
CHECKS: dict[str, Check] = {name: module.CHECKS[name] for module in FAMILIES for name in module.__all__ if name in getattr(module, "CHECKS", {})}


def eager(op: str) -> Callable[..., Any]:
    """The eager PyTorch function of ``op`` (KeyError when there is none)."""
    if op not in FUNCTIONS:
        raise KeyError(f"no eager PyTorch implementation of {op!r}")
    return FUNCTIONS[op]


def has_eager(op: str) -> bool:
    """Whether ``op`` has an eager PyTorch function here."""
    return op in FUNCTIONS
