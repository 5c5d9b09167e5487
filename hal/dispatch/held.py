"""Plans held by their callers: for code repeating a call of one shape many times with arguments it
knows match (an optimizer's step over the lists it keeps), which then skips the cache key (for a
multi-tensor op, a few hundred microseconds per step on a slow host).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import torch

from hal import config, tracing
from hal.registry import OPS

from .dispatcher import DISPATCHER
from .plan import Plan

_SHAPE = operator.attrgetter("shape")
_STRIDES = operator.methodcaller("stride")
_grad_enabled = torch.is_grad_enabled
_local = config._local


class Bound:
    """One call's plan, held by its caller.

    Call it with every parameter of the op positionally, in declaration order. The caller vouches
    that the arrays have the types, dtypes, devices, shapes and strides of the call it was bound
    with; :meth:`current` says whether the plan itself still holds (no reset or newly installed
    plugins since, the same ``hal.use`` scope and grad mode, not under torch.compile). A bound call
    counts in ``hal.stats()`` and runs exactly what ``hal.ops.<op>`` would run for such arguments."""

    __slots__ = ("_count", "_run", "_generation", "_overrides", "_grad")

    def __init__(self, plan: Plan) -> None:
        self._count, self._run = plan
        self._generation = DISPATCHER.generation
        self._overrides = _local.overrides
        self._grad = _grad_enabled()

    def current(self) -> bool:
        return (
            self._generation == DISPATCHER.generation and _local.overrides is self._overrides
            and _grad_enabled() == self._grad and not tracing.is_compiling()
        )

    def __call__(self, *args: Any) -> Any:
        self._count()
        return self._run(*args)


def bind(op_name: str, *args: Any, **kwargs: Any) -> Bound:
    """The plan of ``hal.ops.<op_name>(*args, **kwargs)`` (validated and decided as that call would
    be), as a :class:`Bound` callable taking the op's parameters positionally."""
    decl = OPS[op_name]
    assert decl.entry is not None
    named = decl.entry.__signature__.bind(*args, **kwargs)
    named.apply_defaults()
    return Bound(DISPATCHER.plan(decl, tuple(named.arguments[p.name] for p in decl.params), None))


def layout_of(tensors: Sequence[torch.Tensor]) -> tuple:
    """The shapes and strides of a list of tensors (C-level passes): what a caller holding a plan
    for lists whose dtype and device it knows checks on each call."""
    return (tuple(map(_SHAPE, tensors)), tuple(map(_STRIDES, tensors)))


class Held:
    """A :class:`Bound` its caller keeps across calls: bound again when what the caller vouches for
    (``signature``: :func:`layout_of` its arrays, and whatever else it passes) changes, or when the
    plan itself goes stale (:meth:`Bound.current`)."""

    __slots__ = ("bound", "signature")

    def __init__(self) -> None:
        self.bound: Optional[Bound] = None
        self.signature: Any = None

    def get(self, signature: Any, bind_call: Callable[[], Bound]) -> Bound:
        bound = self.bound
        if bound is None or signature != self.signature or not bound.current():
            bound, self.signature = bind_call(), signature
            self.bound = bound
        return bound
