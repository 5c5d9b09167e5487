"""Building blocks of the ops' fake (meta) rules: results of the right shape, dtype and device,
allocated with ``new_empty`` so that they work on meta and fake tensors (symbolic sizes) as well as
on real ones, computing nothing. The rules state what the kernels return (see each op's docstring):
a gradient has the dtype of the input it belongs to, or x's dtype when that input was absent;
results are contiguous and distinct tensors (two results that are one object would read as
aliases to AOTAutograd)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

Args = Mapping[str, Any]


def like(t: torch.Tensor, shape: Optional[tuple] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An uninitialised tensor on t's device: t's shape and dtype unless given."""
    return t.new_empty(tuple(t.shape) if shape is None else tuple(shape), dtype=dtype or t.dtype)


def param_like(p: Optional[torch.Tensor], x: torch.Tensor, shape: tuple, fallback: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient of a parameter: its shape and dtype; for an absent one, ``shape`` in the dtype of
    ``fallback`` (or x)."""
    if p is not None:
        return like(p)
    return like(x, shape, (fallback if fallback is not None else x).dtype)


def conv_out(a: Args, x: str, w: str) -> tuple:
    """conv2d's output shape from canonical stride, padding (top, bottom, left, right), dilation."""
    xs, ws = a[x].shape, a[w].shape
    (sh, sw), (top, bottom, left, right), (dh, dw) = a["stride"], a["padding"], a["dilation"]
    ho = (xs[-2] + top + bottom - dh * (ws[2] - 1) - 1) // sh + 1
    wo = (xs[-1] + left + right - dw * (ws[3] - 1) - 1) // sw + 1
    return tuple(xs[:-3]) + (ws[0], ho, wo)


def matmul_shape(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """torch.matmul's result shape (1-D operands, broadcast batch dimensions)."""
    sa, sb = tuple(a.shape), tuple(b.shape)
    if len(sa) == 1 and len(sb) == 1:
        return ()
    batch = tuple(torch.broadcast_shapes(sa[:-2], sb[:-2]))
    return batch + (sa[-2:-1] if len(sa) > 1 else ()) + (sb[-1:] if len(sb) > 1 else ())


def number_grad(v: Any, x: torch.Tensor) -> torch.Tensor:
    """Gradient of a number-or-array argument: its shape (0-d for a number), x's dtype."""
    return like(x, tuple(v.shape) if isinstance(v, torch.Tensor) else (), x.dtype)


def new_array(like_this: Any, shape: tuple, fill: Optional[float] = None, dtype: Any = None) -> Any:
    """An array of the same kind, device and (unless given) dtype as ``like_this``, of ``shape``,
    filled with ``fill`` (uninitialised when None): for the ``empty`` rules, which see NumPy arrays
    and torch tensors alike."""
    if isinstance(like_this, torch.Tensor):
        out = like_this.new_empty(tuple(shape), dtype=dtype or like_this.dtype)
        return out if fill is None else out.fill_(fill)
    import numpy as np

    out = np.empty(tuple(shape), dtype=dtype or like_this.dtype)
    if fill is not None:
        out.fill(fill)
    return out
