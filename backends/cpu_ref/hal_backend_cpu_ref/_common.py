"""Helpers shared by the reference kernels: registration, float64 conversion, memory limits.

Every kernel is registered through :func:`reference`, the one place that sets what all of them
share:

- NumPy's floating-point error state is "ignore" inside kernels: the reference computes through
  overflow, division by zero and NaN as IEEE arithmetic does (as torch does), whatever
  ``np.seterr`` another library set; a ``FloatingPointError`` never escapes.
- The float64 working set a call needs is estimated before it runs (the kernel's capability
  check), and a call that cannot fit in the memory this process can still get is declined with a
  reason naming the size, so the dispatcher raises ``hal.UnsupportedError`` before anything is
  allocated. Kernels are written to need memory proportional to their inputs and outputs
  (convolutions compute only the taps that land on the input, attention works through blocks of
  queries, expanded views stay expanded in float64).
"""

from __future__ import annotations

import functools
import os
import resource
from typing import Any, Callable, Iterable, Optional

import numpy as np

from hal.errors import UnsupportedError
from hal.plugin import Inputs

from . import plugin

#: bytes of a float64 element.
F64 = 8

#: estimates of a call's working set: canonical inputs -> bytes.
Footprint = Callable[[Inputs], int]


def elements(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def array_elements(inputs: Inputs) -> int:
    """Logical elements of every array argument (inside lists too)."""
    total = 0
    for a in inputs.args:
        for item in a if isinstance(a, (list, tuple)) else (a,):
            if hasattr(item, "shape") and hasattr(item, "dtype"):
                total += elements(item.shape)
    return total


def proportional(inputs: Inputs) -> int:
    """The default estimate: float64 copies of the inputs, a result of their size and one
    temporary of it (ops whose results are no larger than their inputs)."""
    return 3 * F64 * array_elements(inputs)


def with_result(result_elements: Callable[[Inputs], int], temporaries: int = 2) -> Footprint:
    """An estimate for ops whose result can be larger than their inputs: the inputs in float64,
    plus ``temporaries + 1`` float64 arrays of the result's size."""
    return lambda inputs: F64 * (array_elements(inputs) + (temporaries + 1) * result_elements(inputs))


def available_bytes() -> Optional[int]:
    """What this process can still allocate: the smaller of the memory the system has available
    and the headroom under this process's address-space limit (None where neither is known)."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            limits.append(max(0, soft - used))
        except (OSError, ValueError):
            limits.append(soft)
    return min(limits) if limits else None


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def memory_reasons(footprint: Footprint, inputs: Inputs) -> list[str]:
    """Why this call cannot run in the memory left (empty when it can)."""
    need = footprint(inputs)
    have = available_bytes()
    if have is None or need <= have:
        return []
    return [
        f"needs about {_gib(need)} of float64 working memory ({need} bytes), more than the {_gib(have)} this "
        "process can still allocate (cpu_ref computes in float64; split the call or use another backend)"
    ]


def reference(op: str, footprint: Footprint = proportional) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the reference kernel ("numpy") of ``op``.

    The registered kernel runs the function with NumPy's errors ignored and turns a MemoryError
    into a ``hal.UnsupportedError``; the function itself is returned unchanged (tests call it).
    """

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def kernel(*args: Any) -> Any:
            try:
                with np.errstate(all="ignore"):
                    return fn(*args)
            except MemoryError:
                raise UnsupportedError(
                    f"cpu_ref/numpy ran out of memory computing {op} (it computes in float64); split the call "
                    "or use another backend"
                ) from None

        plugin.kernel(op, name="numpy", fused=False, check=functools.partial(memory_reasons, footprint))(kernel)
        return fn

    return register


def f64(a: Any) -> np.ndarray:
    """An array (or number) as float64: the precision every reference kernel computes in.

    Dimensions an array is expanded along (stride 0, as ``torch.expand`` and ``np.broadcast_to``
    make them) stay expanded: one slice is converted and viewed at the full shape (read-only), so
    a float64 copy costs the memory of what the array holds, not of its logical size.
    """
    a = np.asarray(a)
    if a.size > 1 and any(st == 0 and n > 1 for st, n in zip(a.strides, a.shape)):
        held = tuple(slice(0, 1) if st == 0 else slice(None) for st, n in zip(a.strides, a.shape))
        return np.broadcast_to(a[held].astype(np.float64), a.shape)
    return np.asarray(a, dtype=np.float64)


def like(result: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``result`` rounded to x's dtype, as a fresh contiguous array."""
    return np.array(result, dtype=x.dtype, order="C")  # a copy; keeps 0-d (ascontiguousarray makes it 1-d)
