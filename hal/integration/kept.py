"""What a forward kernel keeps for the backward kernel of the same call, so that the backward need
not recompute it (batch norm's batch statistics: a pass over x and, for Triton, two launches).

A backward op takes the forward's inputs, not its intermediates (``hal.gradients``), so a kernel
that has them at hand keeps them here, keyed by the input they describe. An entry holds that input
weakly and answers only the same live tensor at the same version counter with the same ``state``
(the other inputs the kept values depend on: eps, parameters as :func:`param_state`); anything else
is a miss and the backward recomputes, as it would without this module. The backward takes its
entry: a second backward of the same graph recomputes. An entry goes when its tensor dies (so a
forward whose backward never comes holds nothing past its graph), and the oldest go first past
``size``.

Only the forward of hal's own autograd node arms the keeping (:func:`arm`): a call without autograd
(inference) or one that torch's autograd records has no backward op to come, and keeping for it
would cost host time and leave small tensors pinned in the allocator (on glibc that made the next
16 MiB layer-norm result a fresh mapping: 0.10 ms of 1.0 at (4096, 1024), 2026-12-01).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Hashable, Optional

import torch


class _State(threading.local):
    """Per thread: whether forward kernels keep (``armed``; read and set inline by hal's nodes)."""

    armed = False


STATE = _State()


def arm(on: bool) -> bool:
    """Set whether forward kernels on this thread keep values (around the kernel of an opaque
    torch.compile node); returns the previous setting, to be restored. hal's autograd node sets
    ``STATE.armed`` inline (its hot path)."""
    previous = STATE.armed
    STATE.armed = on
    return previous


def armed() -> bool:
    """Whether a forward kernel running now on this thread runs for hal's autograd node."""
    return STATE.armed


def backward_follows(*inputs: Any) -> bool:
    """Whether a forward kernel running now may do work for its backward op: it runs armed
    (:func:`armed`: hal's autograd node, or an opaque torch.compile node) and one of ``inputs``
    (tensors or None) takes gradients. Inside a compiled graph only a tensor the graph passes
    through unchanged, a parameter, still requires grad; a compiled backward then calls the backward
    op with the same tensor and takes what was kept (seen on the CPU with linear_cross_entropy). The
    graph's own intermediates never do (under autocast the weight is the graph's cast), so there
    nothing is done ahead. A compiled graph run under no_grad with such a parameter does the work
    for nothing: its entries go when their tensor dies."""
    return STATE.armed and any(t is not None and t.requires_grad for t in inputs)


def param_state(*params: Optional[torch.Tensor]) -> tuple:
    """The identity and version of each parameter (None stays None): state that changes whenever a
    parameter is replaced or updated in place."""
    return tuple([None if p is None else (p._cdata, p._version) for p in params])


class KeptForBackward:
    """Values a forward kernel keeps for its backward, keyed by the input tensor they describe."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._entries: dict[int, tuple] = {}

    def keep(self, x: torch.Tensor, state: Hashable, value: Any, out: Optional[torch.Tensor] = None) -> None:
        """Keep ``value`` for the backward of ``x`` in ``state``, where hal's autograd node runs the
        forward (:func:`armed`). Given the forward's result ``out``, nothing is kept when torch's
        autograd recorded the call (``out`` requires grad): torch's node saves what its own backward
        needs, and no backward op will ask."""
        if not STATE.armed or (out is not None and out.requires_grad):
            return
        entries = self._entries
        if len(entries) >= self.size:
            try:
                entries.pop(next(iter(entries)), None)  # the oldest
            except (StopIteration, RuntimeError):  # emptied meanwhile by a dying tensor's callback
                pass
        key = x._cdata

        def forget(ref: weakref.ref) -> None:  # x died: its values go with it (runs where x died)
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                entries.pop(key, None)

        entries[key] = (weakref.ref(x, forget), x._version, state, value)

    def take(self, x: torch.Tensor, state: Hashable) -> Any:
        """The value kept for this x in this state, removed; None if there is none."""
        hit = self._entries.pop(x._cdata, None)
        if hit is None or hit[0]() is not x or hit[1] != x._version or hit[2] != state:
            return None
        return hit[3]

    def __contains__(self, x: torch.Tensor) -> bool:
        return x._cdata in self._entries

    def clear(self) -> None:
        self._entries.clear()
