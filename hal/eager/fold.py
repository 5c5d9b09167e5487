"""Eval-mode batch norm folded into the preceding convolution, and a cache of folded parameters.

For inference, ``bn(conv(x, w, b))`` is ``conv(x, w * a, (b - mean) * a + beta)`` with
``a = gamma / sqrt(var + eps)`` per output channel, so a vendor's fused conv + bias + ReLU call
(cuDNN's, MIOpen's) computes the whole conv -> BN -> ReLU chain. Folding costs a few small kernels;
:class:`FoldCache` keeps the result while the parameters are unchanged, so a model run in eval mode
folds once. Shared by the GPU plugins (vendor-neutral torch code).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Optional

import torch

Param = Optional[torch.Tensor]


@torch.no_grad()
def fold(dtype: torch.dtype, channels_last: bool, conv_weight: torch.Tensor, conv_bias: Param, bn_weight: Param,
         bn_bias: Param, running_mean: torch.Tensor, running_var: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of the convolution with the batch norm folded in: computed in float32, rounded
    once to ``dtype``; the weight in channels_last when the input is."""
    scale = torch.rsqrt(running_var.float() + eps)
    if bn_weight is not None:
        scale = scale * bn_weight.float()
    weight = (conv_weight.float() * scale.view(-1, *([1] * (conv_weight.ndim - 1)))).to(dtype)
    if channels_last:
        weight = weight.contiguous(memory_format=torch.channels_last)
    shift = -running_mean.float() * scale
    if conv_bias is not None:
        shift = shift + conv_bias.float() * scale
    if bn_bias is not None:
        shift = shift + bn_bias.float()
    return weight, shift.to(dtype)


class FoldCache:
    """Folded (weight, bias) per parameter set, valid while every parameter is the same live tensor
    at the same version counter (an optimizer step or ``load_state_dict`` bumps it); the least
    recently used entries go first once ``size`` are kept."""

    def __init__(self, size: int = 64) -> None:
        self._entries: OrderedDict[tuple, tuple[tuple, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def get(self, x: torch.Tensor, conv_weight: torch.Tensor, conv_bias: Param, bn_weight: Param, bn_bias: Param,
            running_mean: torch.Tensor, running_var: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        params = (conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var)
        channels_last = x.ndim == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
        key = (*(None if p is None else (id(p), p._version) for p in params), eps, x.dtype, channels_last)
        with self._lock:
            found = self._entries.get(key)
            if found is not None and all(_same(ref, p) for ref, p in zip(found[0], params)):
                self._entries.move_to_end(key)
                return found[1], found[2]
        weight, bias = fold(x.dtype, channels_last, *params, eps)
        with self._lock:
            self._entries[key] = (tuple(None if p is None else weakref.ref(p) for p in params), weight, bias)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return weight, bias

    def __len__(self) -> int:
        return len(self._entries)


def _same(ref: Optional[weakref.ref], p: Param) -> bool:
    """Whether a cached weak reference still points at ``p`` (an id can be reused after a free)."""
    return p is None if ref is None else ref() is p
