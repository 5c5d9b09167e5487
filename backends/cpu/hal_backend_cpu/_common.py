"""What the CPU kernel modules share: registration, dtype sets and capability checks."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import numpy as np

from hal.plugin import Inputs

from . import _numba, plugin
from ._device import onednn_dtype_reason

FLOATS = ("float16", "bfloat16", "float32", "float64")
#: dtypes of the numba kernels: numba has no float16 arithmetic and no bfloat16 at all.
NUMBA_FLOATS = ("float32", "float64")

Check = Callable[[Inputs], Optional[list[str]]]


def kernel(op: str, *, name: str, priority: int, dtypes: Optional[Iterable[str]] = None,
           checks: Iterable[Check] = (), differentiable: Union[bool, Check] = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a kernel taking torch tensors (NumPy arrays arrive as zero-copy tensor views);
    ``differentiable``: made of torch's differentiable ops (see :meth:`hal.plugin.Plugin.kernel`)."""
    return plugin.kernel(op, name=name, priority=priority, dtypes=dtypes, check=_all(list(checks)), differentiable=differentiable)


def numba_kernel(op: str, *, priority: int, dtypes: Iterable[str] = NUMBA_FLOATS, checks: Iterable[Check] = (),
                 array_api: str = "numpy") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a kernel named ``numba``, taking NumPy arrays (torch tensors arrive as zero-copy
    views), or torch tensors with ``array_api="torch"`` (a torch op whose result a numba pass
    finishes); it declines with the reason when numba is missing or broken."""
    return plugin.kernel(op, name="numba", priority=priority, dtypes=dtypes, array_api=array_api,
                         check=_all([_numba_check, *checks]))


def numpy_kernel(op: str, *, priority: int, dtypes: Optional[Iterable[str]] = None,
                 checks: Iterable[Check] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a kernel named ``numpy``: NumPy's own functions on a NumPy caller's arrays, with no
    conversion to torch and back (about 1 us a call on the project's VM, more than a small array's
    work). It declines torch callers: for them torch's kernel runs without converting."""
    return plugin.kernel(op, name="numpy", priority=priority, dtypes=dtypes, array_api="numpy",
                         check=_all([numpy_caller, *checks]))


def numpy_caller(inputs: Inputs) -> list[str]:
    """A check: the caller gave NumPy arrays (a kernel for them alone: torch callers keep torch's
    kernel, which runs their tensors without converting)."""
    if inputs.numpy_caller:
        return []
    return ["torch tensors: torch's kernel runs them without converting (this kernel is NumPy's own, for NumPy callers)"]


def _all(checks: list[Check]) -> Optional[Callable[[Inputs], list[str]]]:
    if not checks:
        return None

    def check(inputs: Inputs) -> list[str]:
        reasons: list[str] = []
        for c in checks:
            reasons.extend(c(inputs) or [])
            if reasons:  # later checks may assume what earlier ones verified
                break
        return reasons

    return check


def _numba_check(inputs: Inputs) -> list[str]:
    reason = _numba.unavailable_reason()
    return [reason] if reason else []


def contiguous(*names: str) -> Check:
    """A check: the named NumPy arrays (when given) are C-contiguous and in native byte order (the
    kernel walks flat memory of native numbers; numba has no byte-swapped types)."""

    def check(inputs: Inputs) -> list[str]:
        given = [(n, inputs[n]) for n in names if isinstance(inputs[n], np.ndarray)]
        bad = [n for n, a in given if not a.flags.c_contiguous]
        if bad:
            return [f"{', '.join(bad)} not C-contiguous (the numba kernel walks flat rows; the torch kernel takes any layout)"]
        swapped = [f"{n} ({a.dtype.str})" for n, a in given if not a.dtype.isnative]
        return [f"{', '.join(swapped)} in the other byte order: numba reads native numbers (the torch kernel takes a native copy)"] if swapped else []

    return check


def onednn_dtype(inputs: Inputs) -> list[str]:
    """A check: oneDNN has primitives for the op's dtype on this CPU."""
    reason = onednn_dtype_reason(inputs.dtype or "")
    return [reason] if reason else []


def numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
