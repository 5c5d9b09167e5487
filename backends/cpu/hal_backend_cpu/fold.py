"""A cache of values derived from parameter tensors (batch norm folded into convolution weights).

An entry is valid while each parameter is the same live tensor object at the same version counter:
every in-place update bumps the counter (an optimizer step, ``load_state_dict``, a running-statistics
update in training), and a new tensor is a new object, so a stale entry is never returned. The
tensor objects are held by weak references (an entry never keeps a model alive). NumPy arrays reach
kernels as fresh tensor views on every call, so for them an entry never hits: their fold is
recomputed each call, which is right since NumPy arrays carry no version counter.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

Params = Sequence[Optional[torch.Tensor]]


class ParamCache:
    """``build(*params, *extra)`` memoised per parameter set and hashable ``extra`` values, least
    recently used entries dropped beyond ``size``."""

    def __init__(self, build: Callable[..., Any], size: int = 64) -> None:
        self._build = build
        self._size = size
        self._lru: OrderedDict[Hashable, tuple[list, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0  # how many times ``build`` ran (for tests and benchmarks)

    def get(self, params: Params, extra: tuple[Hashable, ...] = ()) -> Any:
        key = (tuple(None if p is None else (id(p), p._version) for p in params), extra)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None and all((r is None) if p is None else (r is not None and r() is p) for r, p in zip(hit[0], params)):
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
