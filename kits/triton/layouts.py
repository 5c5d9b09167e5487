"""Layout arithmetic of the transformer kernels, importable without Triton (capability checks use
it before any kernel runs)."""

from __future__ import annotations

from typing import Optional

import torch

from hal.arrays import dense_alike, row_geometry


def four_dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(A, B, T, last) sizes and strides of a tensor of rank >= 2; leading dimensions beyond two
    are merged where memory allows (None where it does not)."""
    lead_s, lead_st = list(shape[:-2]), list(strides[:-2])
    while len(lead_s) > 2:  # merge the innermost mergeable pair
        for j in range(len(lead_s) - 1, 0, -1):
            if lead_st[j - 1] == lead_st[j] * lead_s[j] or lead_s[j - 1] == 1 or lead_s[j] == 1:
                stride = lead_st[j] if lead_s[j] != 1 else lead_st[j - 1]
                lead_s[j - 1 : j + 1] = [lead_s[j - 1] * lead_s[j]]
                lead_st[j - 1 : j + 1] = [stride]
                break
        else:
            return None
    while len(lead_s) < 2:
        lead_s.insert(0, 1)
        lead_st.insert(0, 0)
    return (*lead_s, shape[-2], shape[-1]), (*lead_st, strides[-2], strides[-1])


def rotary_geometry(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[tuple]:
    """The (A, B, T, *) views of x, cos and sin the kernel addresses, or None when x's leading
    dimensions cannot be merged into two (the caller falls back)."""
    half = int(x.shape[-1]) // 2
    target = tuple(x.shape[:-1]) + (half,)
    views = []
    for t in (x, cos.expand(target), sin.expand(target)):
        four = four_dims(tuple(t.shape), tuple(t.stride()))
        if four is None:
            return None
        views.append(four)
    if len({v[0][:3] for v in views}) != 1:
        return None  # merged differently: sizes no longer line up
    return tuple(views)


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements as the flat run of memory they occupy (for a layout-blind walk)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset()) if not t.is_contiguous() else t.view(-1)


def swiglu_geometry(*tensors: torch.Tensor) -> Optional[list[tuple[torch.Tensor, int, int, int]]]:
    """Each tensor as ``(view, R, C, row stride)`` for the kernels: dense tensors of one layout as
    one flat run each (R = 1); otherwise rows of the last dimension (:func:`hal.arrays.row_geometry`)
    of one (R, C) for all. None when neither fits (the plugins' torch kernels run those)."""
    if dense_alike(*tensors):
        n = tensors[0].numel()
        return [(storage_view(t), 1, n, n) for t in tensors]
    geos = [row_geometry(t) for t in tensors]
    if any(g is None for g in geos) or len({g[:2] for g in geos}) != 1:  # type: ignore[index]
        return None
    return [(t, *g) for t, g in zip(tensors, geos)]  # type: ignore[misc]
