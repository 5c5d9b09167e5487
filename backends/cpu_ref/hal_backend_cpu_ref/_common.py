"""Helpers shared by the reference kernels."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import plugin

#: Register a reference kernel: ``@reference("softmax")``. Every cpu_ref kernel is named "numpy".
reference = functools.partial(plugin.kernel, name="numpy", fused=False)


def f64(a: Any) -> np.ndarray:
    """An array (or number) as float64: the precision every reference kernel computes in."""
    return np.asarray(a, dtype=np.float64)


def like(result: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``result`` rounded to x's dtype, as a fresh contiguous array."""
    return np.array(result, dtype=x.dtype, order="C")  # a copy; keeps 0-d (ascontiguousarray makes it 1-d)
