"""Step 4: the route of the call, one frozen :class:`Route` value.

A call takes one of four routes:

- ``kernel``: the chosen kernel runs directly (no autograd is needed, or the op has no backward);
- ``recorded``: the call needs autograd and the kernel is made of torch's differentiable ops, so it
  runs with grad recording on and torch's autograd records its backward (no hal node, no backward
  op: hal would add host time and nothing else);
- ``node``: the call needs autograd and the kernel runs as the forward of hal's autograd node, whose
  backward runs the op's backward op (its own decision);
- ``decomposition``: the op runs as other ops, each decided in turn: because no kernel runs the
  inputs (the op's composite, a fallback), or because a call needing autograd is better served by
  ops that each save what their backward needs (the op's training decomposition).

:func:`routes` gives the route hal prefers by priority first, then every other route that could
serve the call on the same backend (its other kernels, the training decomposition): the
alternatives :mod:`hal.dispatch.measure` may time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from hal.config import Choice
from hal.registry import OpDecl

from .select import FALLBACK_WORDS, Option, Selection
from .validate import Prepared, needs_autograd

#: the reason of a route whose kernel torch's autograd records.
TORCH_RECORDS = "inputs require grad: the kernel is torch's differentiable ops, so torch's autograd records their backward (no hal node)"
TRAINING_DECOMPOSITION = "inputs require grad: the op's training decomposition"
IN_A_NODE = "inputs require grad: the kernel runs inside an autograd node"

KINDS = ("kernel", "recorded", "node", "decomposition")


@dataclasses.dataclass(frozen=True)
class Route:
    """How one call runs: the route's kind, the kernel (or decomposition) on its backend, and why."""

    kind: str
    option: Option
    reason: str = ""
    #: how the route was chosen among its alternatives by timing them (None: by priority alone).
    measurement: Optional[Any] = None

    @property
    def backend(self) -> str:
        return self.option.backend

    @property
    def kernel(self) -> str:
        return self.option.kernel

    @property
    def fallback(self) -> Optional[str]:
        return self.option.fallback

    @property
    def label(self) -> str:
        """What measurements and explain call this route: backend/kernel, with "+autograd" for a
        kernel that torch's autograd records and "+node" for one inside hal's node."""
        suffix = {"recorded": " (torch autograd)", "node": " (hal node)"}.get(self.kind, "")
        return f"{self.backend}/{self.kernel}{suffix}"

    @property
    def public(self) -> tuple[str, Optional[str]]:
        """The route as ``hal.explain`` names it: ("kernel" | "autograd" | "decomposition", and for
        "autograd" who records the backward, "torch" or "hal")."""
        if self.kind == "recorded":
            return "autograd", "torch"
        if self.kind == "node":
            return "autograd", "hal"
        return self.kind, None

    @property
    def traceable(self) -> bool:
        """Whether under torch.compile the kernel's torch ops join the graph instead of one opaque
        ``torch.ops.hal`` node."""
        return self.kind in ("kernel", "recorded") and self.option.recordable


def routes(decl: OpDecl, prepared: Prepared, args: Sequence[Any], choice: Choice, selection: Selection) -> tuple[Route, ...]:
    """The routes that can serve a call whose selection succeeded: hal's preference by priority
    first, then the alternatives on the same backend (empty when the selection failed)."""
    chosen = selection.chosen
    if chosen is None:
        return ()
    if not (decl.trainable and needs_autograd(args)):
        if chosen.kernel == "composite":
            return (Route("decomposition", chosen, FALLBACK_WORDS["composite"]),)
        return tuple(Route("kernel", o) for o in (chosen, *selection.alternatives))
    kernel_forced = choice.kernel_required and choice.kernel not in (None, "composite")
    composite = None if kernel_forced else decl.training_composite(decl.bind(prepared.inputs.args))
    trained = () if chosen.kernel == "composite" else tuple(_autograd_route(o) for o in (chosen, *selection.alternatives))
    if composite is not None:
        backend = selection.first_backend or chosen.backend
        decomposition = Route("decomposition", Option(backend, "composite", composite), TRAINING_DECOMPOSITION)
        if chosen.fallback or not trained:
            return (decomposition,)
        if trained[0].kind == "recorded":
            # the backend's own kernel first: made of torch's ops and recorded by torch's autograd, it
            # computes what the decomposition's steps would (the same torch kernels, the same saved
            # tensors) with one entry into hal instead of one per step
            first = dataclasses.replace(trained[0], reason=TORCH_RECORDS + " (in place of the op's training decomposition)")
            return (first, decomposition, *trained[1:])
        return (decomposition, *trained)
    if chosen.kernel == "composite":
        return (Route("decomposition", chosen, "no kernel runs these inputs; the composite's ops each take autograd"),)
    return trained


def _autograd_route(option: Option) -> Route:
    if option.recordable:
        return Route("recorded", option, TORCH_RECORDS)
    return Route("node", option, IN_A_NODE)
