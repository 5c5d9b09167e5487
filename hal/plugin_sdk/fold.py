"""Eval-mode batch norm folded into the preceding convolution, and a cache of folded parameters.

For inference, ``bn(conv(x, w, b))`` is ``conv(x, w * a, (b - mean) * a + beta)`` with
``a = gamma / sqrt(var + eps)`` per output channel, so a vendor's fused conv + bias + ReLU call
(cuDNN's, MIOpen's) computes the whole conv -> BN -> ReLU chain. Folding costs a few small kernels;
:class:`FoldCache` keeps the result while the parameters are unchanged, so a model run in eval mode
folds once. Vendor-neutral torch code shared by ``hal.nn.FusedConvBN2d`` and the backends' fused
conv kernels (part of the plugin SDK, :mod:`hal.plugin_sdk`); :class:`ParamCache` is the general
memo it is built on.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from hal.arrays import writes_of

Param = Optional[torch.Tensor]


@torch.no_grad()
def fold(conv_weight: torch.Tensor, conv_bias: Param, bn_weight: Param, bn_bias: Param, running_mean: torch.Tensor,
         running_var: torch.Tensor, eps: float, dtype: torch.dtype, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of the convolution with the batch norm folded in: computed in float32 (float64
    for float64), rounded once to ``dtype``; the weight in channels_last when asked. Parameters
    first, as :class:`ParamCache` passes them."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scale = torch.rsqrt(running_var.to(acc) + eps)
    if bn_weight is not None:
        scale = scale * bn_weight.to(acc)
    weight = (conv_weight.to(acc) * scale.view(-1, *([1] * (conv_weight.ndim - 1)))).to(dtype)
    if channels_last:
        weight = weight.contiguous(memory_format=torch.channels_last)
    shift = -running_mean.to(acc) * scale
    if conv_bias is not None:
        shift = shift + conv_bias.to(acc) * scale
    if bn_bias is not None:
        shift = shift + bn_bias.to(acc)
    return weight, shift.to(dtype)


class ParamCache:
    """``build(*params, *extra)`` memoised per parameter set and hashable ``extra`` values; the least
    recently used entries go first once ``size`` are kept.

    An entry is valid while each parameter is the same live tensor object with the same version
    counter (every in-place update bumps it: an optimizer step, ``load_state_dict``) and the same
    count of hal's statistics writes (:func:`hal.arrays.writes_of`: the running statistics a
    training batch norm updates, which torch writes without a bump), so a stale entry is never
    returned. The tensors are held by weak references (an entry never keeps a model alive). A
    statistic written by torch's own batch norm outside hal is not seen (torch counts nothing).
    NumPy arrays reach kernels as fresh tensor views on every call, so for them an entry never
    hits: their build runs each call, which is right since NumPy arrays carry no version counter.
    """

    def __init__(self, build: Callable[..., Any], size: int = 64) -> None:
        self._build = build
        self._size = size
        self._lru: OrderedDict[Hashable, tuple[list, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0  # how many times ``build`` ran (for tests and benchmarks)

    def get(self, params: Sequence[Param], extra: tuple[Hashable, ...] = ()) -> Any:
        key = (tuple(None if p is None else (id(p), p._version, writes_of(p)) for p in params), extra)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None and all(_same(r, p) for r, p in zip(hit[0], params)):
                self._lru.move_to_end(key)
                return hit[1]
        value = self._build(*params, *extra)
        refs = [None if p is None else weakref.ref(p) for p in params]
        with self._lock:
            self.builds += 1
            self._lru[key] = (refs, value)
            self._lru.move_to_end(key)
            while len(self._lru) > self._size:
                self._lru.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)


class FoldCache:
    """Folded (weight, bias) of :func:`fold` per parameter set (a :class:`ParamCache`), in the
    input's dtype and memory format."""

    def __init__(self, size: int = 64) -> None:
        self._cache = ParamCache(fold, size)

    def get(self, x: torch.Tensor, conv_weight: torch.Tensor, conv_bias: Param, bn_weight: Param, bn_bias: Param,
            running_mean: torch.Tensor, running_var: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        channels_last = x.ndim == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
        params = (conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var)
        return self._cache.get(params, (eps, x.dtype, channels_last))

    def __len__(self) -> int:
        return len(self._cache)


def folds_finitely(inputs: Any) -> list[str]:
    """A check of kernels that fold: eps = 0 declines, since a zero running variance would give
    infinite folded weights, whose convolution is NaN where the op's formula gives +-inf
    (ops/conv.py: fused_conv_bn_relu)."""
    return ["eps = 0 (a zero running variance would make the folded weights infinite)"] if inputs["eps"] == 0 else []


def _same(ref: Optional[weakref.ref], p: Param) -> bool:
    """Whether a cached weak reference still points at ``p`` (an id can be reused after a free)."""
    return p is None if ref is None else ref() is p
