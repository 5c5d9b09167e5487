"""How a trainable op's backward op is fed from its forward call: read off the two declarations.

The backward op of ``op`` takes ``grad_out`` followed by parameters named like the forward's (and
``out`` for the forward's result); it returns the gradients of the forward parameters listed in
``op``'s declaration (``gradients``), in that order. Every user of the mapping goes through this
module: the eager autograd node (:mod:`hal.integration.autograd`), the ``torch.ops.hal`` autograd formula used
under torch.compile (:mod:`hal.integration.library`), and ``hal.explain`` (the backward's decision).

A backward op may end with a parameter ``output_mask``: a tuple of bools, one per gradient in the
order of ``gradients``, saying which to compute (the others come back None). The eager autograd
node passes which forward inputs need a gradient; callers that leave it out get every gradient.

Two rules come from the declarations and not from op names:

- a parameter the forward writes (``mutates`` when ``mutates_when`` holds: batch norm's running
  statistics in training) reaches the backward as None: a backward never reads written state;
- an input the forward takes unbatched (``unbatched``: conv2d's (C, H, W) x) reaches the backward
  with a batch dimension of 1 (as does ``grad_out``), and its gradient loses it again.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from hal.errors import UnsupportedError
from hal.registry import OPS, OpDecl, get_op

OUT = "out"
#: the optional last parameter of a backward op: which gradients to compute.
MASK = "output_mask"


class Gradients:
    """The backward call of one trainable op."""

    def __init__(self, decl: OpDecl) -> None:
        if decl.backward is None:
            raise ValueError(f"op {decl.name} is not trainable")
        self.decl = decl
        if decl.backward not in OPS:  # a declaration may name its backward op before it is declared
            raise UnsupportedError(
                f"{decl.name} needs autograd here, through its backward op {decl.backward!r}, which is not declared: "
                f"declare it (hal.library.declare(..., forward={decl.name!r}), taking grad_out first) before such a call, "
                "or call it on tensors that do not require grad")
        self.bwd = get_op(decl.backward)
        #: whether the backward op takes an output mask (its last parameter, see the module doc).
        self.masked = self.bwd.param_names[-1:] == (MASK,)
        #: forward parameter names (or ``out``) the backward op takes after grad_out, in its order.
        self.needs = tuple(p.name for p in self.bwd.params if p.name not in ("grad_out", MASK))
        unknown = [n for n in self.needs if n != OUT and n not in decl.param_names]
        if unknown or self.bwd.param_names[:1] != ("grad_out",):
            raise TypeError(
                f"backward op {self.bwd.name} must take grad_out first, then parameters of {decl.name} "
                f"(or 'out'); it names {unknown or self.bwd.param_names[:1]}"
            )
        self.unbatched = decl.unbatched

    def saved(self, named: Mapping[str, Any], out: Any) -> list[Any]:
        """What the backward needs of a forward call (canonical arguments by name, its result)."""
        written = set(self.decl.mutates) if self.decl.writes(named) else set()
        return [out if n == OUT else (None if n in written else named[n]) for n in self.needs]

    def call(self, grad_out: Any, saved: Sequence[Any], mask: Optional[Sequence[bool]] = None) -> tuple[tuple, bool]:
        """The backward op's positional arguments, and whether an unbatched input was batched.
        ``mask``: which gradients are asked for (default every one), for a backward op that takes
        an output mask."""
        values = list(saved)
        batched = False
        if self.unbatched is not None:
            name, rank = self.unbatched
            if name in self.needs:
                i = self.needs.index(name)
                if values[i] is not None and values[i].ndim == rank:
                    values[i], grad_out, batched = values[i][None], grad_out[None], True
        if self.masked:
            values.append(tuple(mask) if mask is not None else (True,) * len(self.decl.gradients))
        return (grad_out, *values), batched

    def results(self, results: Any, batched: bool) -> dict[str, Any]:
        """The backward op's results by forward parameter name."""
        if self.decl.single_gradient:
            results = (results,)
        out = dict(zip(self.decl.gradients, results))
        if batched:
            name = self.unbatched[0]  # type: ignore[index]
            if out.get(name) is not None:
                out[name] = out[name][0]
        return out


_CACHE: dict[str, Gradients] = {}


def gradients_of(decl: OpDecl) -> Gradients:
    """The (cached) backward mapping of a trainable op."""
    g = _CACHE.get(decl.name)
    if g is None or g.decl is not decl:
        g = _CACHE[decl.name] = Gradients(decl)
    return g


def backward_decl(decl: OpDecl) -> Optional[OpDecl]:
    """The backward op's declaration, or None while it is not declared yet."""
    return OPS.get(decl.backward) if decl.backward else None
