"""Building the results of calls with zero-size inputs (the ``_empty_<op>`` rules of ``ops/``).

A call in which an input array has a zero-size dimension computes nothing, so no kernel needs to
run: each op states its results for such calls as a rule of its canonical arguments (a mapping by
parameter name, as kernels receive them), next to its declaration, named ``_empty_<op>``. A rule
returns what torch returns there: empty results of the right shape and dtype, zeros where a sum
runs over nothing (a matmul with K = 0, the gradient of a weight that saw no rows), NaN where a
mean does, and in-place ops leave their arguments as they are.

The helpers below build arrays of the inputs' kind: NumPy arrays for NumPy inputs, torch tensors on
the inputs' device for torch inputs, in a hal dtype name (bfloat16 through ml_dtypes for NumPy).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from hal.arrays import dtype_name, numpy_dtype, torch_dtype


def has_empty(*arrays: Any) -> bool:
    """Whether any of the given arrays (None and non-arrays ignored) has no elements."""
    return any(hasattr(a, "shape") and any(int(s) == 0 for s in a.shape) for a in arrays)


def full(like: Any, shape: Sequence[int], value: float = 0.0, dtype: Optional[str] = None) -> Any:
    """A new array of ``shape`` filled with ``value``, of ``like``'s kind and device, in ``dtype``
    (default: like's dtype)."""
    name = dtype or dtype_name(like)
    shape = tuple(int(s) for s in shape)
    if isinstance(like, torch.Tensor):
        return torch.full(shape, value, dtype=torch_dtype(name), device=like.device)
    return np.full(shape, value, dtype=numpy_dtype(name))


def zeros(like: Any, shape: Sequence[int], dtype: Optional[str] = None) -> Any:
    return full(like, shape, 0.0, dtype)


def masked(values: tuple, mask: Sequence[bool]) -> tuple:
    """``values`` with None where ``mask`` is False (gradients a backward op was not asked for)."""
    return tuple(v if m else None for v, m in zip(values, mask))


def zeros_like(a: Any) -> Any:
    return zeros(a, a.shape)


def broadcast_copy(a: Any, shape: Sequence[int]) -> Any:
    """A fresh array of ``shape`` holding ``a`` broadcast to it."""
    if isinstance(a, torch.Tensor):
        return a.expand(tuple(shape)).clone(memory_format=torch.contiguous_format)
    return np.broadcast_to(a, tuple(shape)).copy()


def cast(a: Any, dtype: str) -> Any:
    """``a`` converted to the hal dtype ``dtype`` (a new array)."""
    if isinstance(a, torch.Tensor):
        return a.to(torch_dtype(dtype), copy=True)
    return np.asarray(a).astype(numpy_dtype(dtype))


def dtype_of(param: Any, fallback: Any) -> str:
    """The dtype of an optional parameter, else of ``fallback`` (the gradient of a parameter has
    the parameter's dtype; of a missing one, the input's)."""
    return dtype_name(param if param is not None else fallback)
