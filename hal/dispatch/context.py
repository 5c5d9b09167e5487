"""Which context a call is decided in: the one place that says so.

Kernels state where they serve as data (:class:`hal.plugin.Routing`: a priority per context of
:data:`hal.plugin.CONTEXTS`); selection (:mod:`hal.dispatch.select`) ranks the kernels that serve
the call's context by their priority there, and ``hal.explain`` names the context. A call is in the
first context of :data:`~hal.plugin.CONTEXTS` that applies to it, so that a kernel registered with a
``graph_priority`` keeps it in every step replayed from a CUDA graph, compiled or training as well.
Every input of this choice is part of a call's cache key (the ``hal.use`` scope, the arrays' types,
their ``requires_grad`` and grad mode), so a cached plan never serves another context.
"""

from __future__ import annotations

from hal.config import Choice
from hal.plugin import Inputs
from hal.registry import OpDecl

from .validate import needs_autograd


def context_of(decl: OpDecl, inputs: Inputs, choice: Choice) -> str:
    """``graph`` inside :func:`hal.graphs.device_bound`; ``compiled`` for a torch.compile graph
    (traced arrays, or ``hal.explain`` asking what a graph runs); ``training`` where a trainable op's
    call needs autograd; ``eager`` otherwise."""
    if choice.device_bound:
        return "graph"
    if inputs.traced:
        return "compiled"
    if decl.trainable and needs_autograd(inputs.args):
        return "training"
    return "eager"
