"""The autograd route of eager calls: the chosen kernel as the forward of one autograd node.

When a call of a trainable op needs autograd, the dispatcher has already chosen its kernel (once per
input signature, cached); this module runs that kernel inside a ``torch.autograd.Function`` whose
backward calls the op's backward op through ``hal.ops`` (its own decision, cached too). What the
backward needs is read off the declarations (:mod:`hal.gradients`). Saved tensors go through
``ctx.save_for_backward``, so an in-place change of one between forward and backward raises as it
does in torch; a second derivative raises too (backward ops have no autograd formula).

Why not ``torch.ops.hal.<op>`` with its registered autograd here as well: that path crosses torch's
dispatcher three times in Python (custom op, autograd wrapper, kernel) and cost 40-50 µs per call
on the host; one Function costs about what torch's own autograd node costs. Under torch.compile the
``torch.ops.hal`` operators are used (:mod:`hal.torch_library`), with the same mapping.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd.function import once_differentiable

from hal import dispatch
from hal.gradients import OUT, gradients_of
from hal.registry import OpDecl


class _Saver:
    """What the autograd node of one op keeps, precomputed from its declaration: for each value the
    backward op takes after grad_out, where it comes from (an argument slot or the result)."""

    __slots__ = ("spec", "sources", "written", "when", "grad_slots", "n_args", "backward")

    def __init__(self, decl: OpDecl) -> None:
        self.spec = gradients_of(decl)
        self.sources = tuple(-1 if n == OUT else decl.index(n) for n in self.spec.needs)
        self.written = tuple(decl.index(n) for n in decl.mutates)
        self.when = decl.index(decl.mutates_when) if decl.mutates_when else None
        self.grad_slots = tuple(decl.index(n) for n in decl.gradients)
        self.n_args = len(decl.params)
        self.backward = self.spec.bwd.entry


_SAVERS: dict[int, _Saver] = {}


def _saver(decl: OpDecl) -> _Saver:
    s = _SAVERS.get(id(decl))
    if s is None or s.spec.decl is not decl:
        s = _SAVERS[id(decl)] = _Saver(decl)
    return s


class HalNode(torch.autograd.Function):
    """One hal op call in the autograd graph: ``apply(saver, run, *canonical_args)``."""

    @staticmethod
    def forward(ctx: Any, saver: _Saver, run: Callable[..., Any], *args: Any) -> Any:
        out = run(*args)
        skip = saver.written if (saver.written and (saver.when is None or args[saver.when])) else ()
        values = [out if i < 0 else (None if i in skip else args[i]) for i in saver.sources]
        tensors, where = [], []
        for j, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                where.append(j)
                tensors.append(v)
        ctx.save_for_backward(*tensors)
        ctx.hal = (saver, values, where, [isinstance(args[i], torch.Tensor) for i in saver.grad_slots])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        saver, values, where, given = ctx.hal
        values = list(values)
        for j, t in zip(where, ctx.saved_tensors):
            values[j] = t
        bargs, batched = saver.spec.call(grad_out, values)
        grads = saver.spec.results(saver.backward(*bargs), batched)
        out: list[Any] = [None] * (2 + saver.n_args)
        for slot, name, ok in zip(saver.grad_slots, saver.spec.decl.gradients, given):
            if ok:
                out[2 + slot] = grads.get(name)
        return tuple(out)


def autograd_call(decl: OpDecl, run: Callable[..., Any], args: tuple) -> Any:
    """The dispatcher's autograd route: ``run`` (the chosen kernel) inside one :class:`HalNode`."""
    return HalNode.apply(_saver(decl), run, *args)


dispatch.HOOKS.autograd = autograd_call
