"""How scale_shift_act's parameters broadcast over x, for the numba kernels: x (C-contiguous) seen
as (P, C, I) with each parameter one value per channel c."""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

Param = Union[float, int, np.ndarray]


def _span(v: Param, ndim: int) -> Optional[tuple[int, int]]:
    """The dimensions [a, b) of x along which parameter ``v`` varies (None: it is one value)."""
    if not isinstance(v, np.ndarray) or v.size == 1:
        return None
    shape = (1,) * (ndim - v.ndim) + tuple(v.shape)
    varying = [d for d, s in enumerate(shape) if s != 1]
    return varying[0], varying[-1] + 1


def channel_split(x: np.ndarray, scale: Param, shift: Param) -> Union[str, tuple[int, int, int]]:
    """(P, C, I) when both parameters vary along one run of x's dimensions (the same run for both),
    else the reason the numba kernel cannot run them."""
    spans = {s for s in (_span(scale, x.ndim), _span(shift, x.ndim)) if s is not None}
    if len(spans) > 1:
        return "scale and shift broadcast along different dimensions (the numba kernel takes one channel run)"
    # two numbers: one channel spanning all of x, (1, 1, N), whose chunks the kernel runs in
    # parallel (as (N, 1, 1) it ran N one-element segments: 53x slower than torch's ReLU at ResNet's
    # (8, 64, 56, 56), measured 2026-12-01)
    a, b = spans.pop() if spans else (0, 0)
    for v in (scale, shift):
        if isinstance(v, np.ndarray) and v.size > 1:
            shape = (1,) * (x.ndim - v.ndim) + tuple(v.shape)
            if any(shape[d] == 1 for d in range(a, b)):
                return "a parameter broadcasts inside its channel run (the numba kernel takes one value per channel)"
    dims = tuple(int(s) for s in x.shape)
    return int(np.prod(dims[:a], dtype=np.int64)), int(np.prod(dims[a:b], dtype=np.int64)), int(np.prod(dims[b:], dtype=np.int64))


def channel_vector(v: Param, channels: int, dtype: Any) -> np.ndarray:
    """A parameter as a contiguous (channels,) vector of ``dtype``."""
    a = np.asarray(v, dtype=dtype).reshape(-1)
    return np.ascontiguousarray(np.broadcast_to(a, (channels,)))
