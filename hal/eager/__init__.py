"""Every op of the registry written in eager PyTorch.

These are the peers of hal's kernels: the reference that cpu_ref is checked against (run on float64
CPU tensors), and the eager baseline of ``hal bench``. Each function has its op's parameters, in
order, and receives canonical arguments (as kernels do: stride as a pair, padding as (top, bottom,
left, right), dim >= 0, eps resolved ...), torch tensors in and out; in-place ops mutate in place as
the op does. Backward ops are computed with torch.autograd through the forward.

One module per op family, each listing its functions in ``__all__`` under the op's name.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

_FAMILIES = ("conv", "elementwise", "gemm", "norm", "attention", "mixed_precision", "quant")
_TABLE: dict[str, Callable[..., Any]] = {}


def _load() -> dict[str, Callable[..., Any]]:
    if not _TABLE:
        for family in _FAMILIES:
            module = importlib.import_module(f"hal.eager.{family}")
            for name in module.__all__:
                _TABLE[name] = getattr(module, name)
    return _TABLE


def eager(op: str) -> Callable[..., Any]:
    """The eager PyTorch implementation of ``op`` (KeyError when there is none)."""
    table = _load()
    if op not in table:
        raise KeyError(f"no eager PyTorch implementation of {op!r}")
    return table[op]


def has_eager(op: str) -> bool:
    return op in _load()
