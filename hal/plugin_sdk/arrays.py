"""The array helpers kernels use: hal's dtype names as torch's and NumPy's dtypes, a Python
number rounded to float32, and the memory-layout tests torch's multi-tensor kernels need.

They are defined in :mod:`hal.arrays`, which the dispatcher runs on every call; this module names
the part of it that backends and kits rely on, so that a backend imports them from the plugin SDK
(what a backend imports from hal besides ``hal.ops``, ``hal.types`` and ``hal.errors``) and the core
may rearrange the rest of :mod:`hal.arrays` without breaking a plugin.
"""

from __future__ import annotations

from hal.arrays import FLOAT_DTYPES, dense_alike, flat_runs, float32_value, numpy_dtype, torch_dtype

__all__ = ["FLOAT_DTYPES", "dense_alike", "flat_runs", "float32_value", "numpy_dtype", "torch_dtype"]
