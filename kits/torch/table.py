"""Every op's eager PyTorch function and its capability check, gathered from the family modules:
what the ``eager`` backend registers, and what the cuda and rocm backends look up to register
torch's own implementation of an op beside (or below) their kernels.

The family modules are found, not listed: every public module of this package, searched along its
``__path__``, but this one and the helpers of :data:`HELPERS` (a new family is a new file here). A
family names its ops' functions in ``__all__``. They are gathered in the order of the modules'
names; the order does not matter, as each op has one function (an op in two families is an error)
and a backend registers at most one kernel per op from here.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Optional

import hal_torch
from hal.plugin import Inputs, family_names

Check = Callable[[Inputs], Optional[list[str]]]

#: modules of this package that are no op family: what the families and backends build on
HELPERS = frozenset({"table", "overlap"})


def _families() -> tuple[ModuleType, ...]:
    modules = tuple(importlib.import_module(f"hal_torch.{name}") for name in family_names(hal_torch.__path__, HELPERS))
    unnamed = [m.__name__ for m in modules if not hasattr(m, "__all__")]
    if unnamed:
        raise ImportError(f"hal_torch: the op family modules {unnamed} name no functions in __all__ "
                          f"(a module that is no family belongs in hal_torch.table.HELPERS)")
    return modules


#: the family modules, by name
FAMILIES: tuple[ModuleType, ...] = _families()


def _functions() -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {}
    owner: dict[str, str] = {}
    for module in FAMILIES:
        for name in module.__all__:
            if name in out:
                raise ImportError(f"hal_torch: op {name} has a function in two families ({owner[name]} and {module.__name__})")
            out[name], owner[name] = getattr(module, name), module.__name__
    return out


#: op name -> its eager PyTorch function
FUNCTIONS: dict[str, Callable[..., Any]] = _functions()

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
