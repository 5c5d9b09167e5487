"""The answer to "what runs for this call, and why": what ``hal.explain`` returns.

A :class:`Decision` is made once, by :mod:`hal.dispatch.explain`, from the call's
:class:`~hal.dispatch.route.Route` and :class:`~hal.dispatch.select.Selection` (and by
:mod:`hal.dist` for collectives). Its ``route`` names the route as the public contract does:

- ``kernel``: the chosen kernel runs directly (no autograd is needed);
- ``autograd``: the chosen kernel runs as the forward of hal's autograd node whose backward runs the
  op's backward op (its own decision is :attr:`Decision.backward`); or, where the kernel is made of
  torch's differentiable ops, it runs with grad recording on and torch's autograd records its
  backward (:attr:`Decision.autograd_by` is ``"torch"``, no backward op runs);
- ``decomposition``: the op runs as other ops (:attr:`Decision.steps`, each with its own decision),
  either because no kernel can run the inputs (a fallback) or because a call needing autograd is
  better served by ops that each save what their backward needs (the op's training decomposition).

Where several routes could serve the call, :attr:`Decision.measurement` says how they were timed
and which won (:mod:`hal.dispatch.measure`), and each candidate shows its time.

Under ``torch.compile`` the dispatcher decides as AOTAutograd traces the graph: a kernel made of
torch's ops (:attr:`Decision.traceable`) joins the graph as those ops, which Inductor compiles with
the code around them; where the eager choice is another kernel, a kernel of torch's ops that can run
the call takes its place (:attr:`Decision.compiled`); a decomposition's steps are decided in turn;
any other call is one opaque ``torch.ops.hal.<op>`` node, which runs the kernel the ``kernel`` route
names when the compiled code runs, and whose backward runs the backward op's kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from hal.errors import HalError

from .select import FALLBACK_WORDS, Candidate

#: the route reasons of the public contract (``hal.explain``'s ``route``).
ROUTES = ("kernel", "autograd", "decomposition")

#: what puts a call in each context (:func:`hal.dispatch.context.context_of`), as explain says it.
_CONTEXT_WORDS = {
    "graph": "hal.graphs.device_bound: a step replayed from a CUDA graph",
    "compiled": "decided for a torch.compile graph",
    "training": "inputs require grad",
    "eager": "no autograd, no graph",
}


@dataclasses.dataclass
class Decision:
    """The route of a call, its chosen backend and kernel, and every candidate with its reasons."""

    op: str
    inputs: list[str]  # one line per array argument
    device: str
    backend: Optional[str] = None
    kernel: Optional[str] = None
    #: None when the device's preferred path runs; else "composite", "backend" or "host".
    fallback: Optional[str] = None
    forced: list[str] = dataclasses.field(default_factory=list)
    strict: bool = False
    #: kernels ranked by their graph priority (a step replayed from a CUDA graph, hal.graphs)
    device_bound: bool = False
    #: the context the call was decided in (graph, compiled, training, eager: :mod:`hal.dispatch.context`),
    #: whose priorities ranked the kernels (None: a collective of hal.dist, which has algorithms)
    context: Optional[str] = None
    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    #: the error a call with these inputs raises (no kernel, strict mode, missing backend).
    error: Optional[HalError] = None
    #: "kernel", "autograd" or "decomposition" (see the module docstring).
    route: str = "kernel"
    #: why this route ("inputs require grad", "training decomposition", ...).
    route_reason: str = ""
    #: the decisions of the ops a decomposition runs, in order.
    steps: list["Decision"] = dataclasses.field(default_factory=list)
    #: the decision of the backward op an autograd node runs (where torch's autograd records the
    #: kernel instead, the backward op a torch.compile graph of the call would run).
    backward: Optional["Decision"] = None
    #: on the autograd route, who records the backward: "hal" (a hal node running the backward op)
    #: or "torch" (the kernel's own torch ops, through torch's autograd).
    autograd_by: Optional[str] = None
    #: the chosen kernel is made of torch's ops (as ``autograd_by == "torch"`` requires): under
    #: torch.compile its ops join the graph instead of one opaque ``torch.ops.hal`` node.
    traceable: bool = False
    #: the decision inside a torch.compile graph where it differs (the kernel is not traceable and
    #: one made of torch's ops can run the inputs; see
    #: :func:`hal.integration.compile.traced_alternative`).
    compiled: Optional["Decision"] = None
    #: how the route was chosen by measured time among the routes that could serve the call
    #: (a :class:`hal.dispatch.measure.Measurement`), or None where priority alone chose.
    measurement: Optional[Any] = None
    #: why nothing was measured although several routes could serve the call ("" otherwise).
    tuning: str = ""

    @property
    def chosen(self) -> Optional[Candidate]:
        return next((c for c in self.candidates if c.chosen), None)

    def kernels_run(self, compiled: bool = False) -> list[tuple[str, str, str]]:
        """Every (op, backend, kernel) this call runs, forward and backward, in order: what
        ``hal.stats()`` counts for one forward and, on the autograd route, one backward. With
        ``compiled``, what ``hal.stats()`` counts for the same call inside a torch.compile graph
        (outside ``hal.use`` scopes): nothing for a :attr:`traceable` kernel, whose torch ops the
        graph runs as its own code; else one ``torch.ops.hal`` node, whose backward runs the op's
        backward op."""
        if compiled and self.compiled is not None:
            return self.compiled.kernels_run(True)
        if self.backend is None or self.kernel is None or (compiled and self.traceable):
            return []
        if compiled and self.route == "decomposition":  # the graph holds its steps, not the op
            return [k for step in self.steps for k in step.kernels_run(True)]
        out = [(self.op, self.backend, self.kernel)]
        for step in self.steps:
            out += step.kernels_run(compiled)
        if self.backward is not None and (compiled or self.autograd_by != "torch"):
            out += self.backward.kernels_run(compiled)
        return out

    def __str__(self) -> str:
        return "\n".join(self._lines(""))

    def _lines(self, pad: str) -> list[str]:
        lines = [f"{pad}hal.explain: {self.op} on {self.device}"]
        for line in self.inputs:
            lines.append(f"{pad}  {line}")
        if self.forced:
            lines.append(f"{pad}forced: " + "; ".join(self.forced))
        if self.strict:
            lines.append(f"{pad}strict mode: fallbacks raise")
        if self.context is not None:
            lines.append(f"{pad}context: {self.context} ({_CONTEXT_WORDS[self.context]}): kernels ranked by their {self.context} priority")
        why = f" ({self.route_reason})" if self.route_reason else ""
        lines.append(f"{pad}route: {self.route}{why}")
        if self.measurement is not None:
            m = self.measurement
            lines.append(f"{pad}chosen {m.describe()}: " + ", ".join(f"{label} {_us(t)}" for label, t in m.times_us))
        elif self.tuning:
            lines.append(f"{pad}measured choice: {self.tuning}")
        if self.backend is not None:
            how = f"  (fallback to {FALLBACK_WORDS[self.fallback]})" if self.fallback else ""
            lines.append(f"{pad}chosen: {self.backend}/{self.kernel}{how}")
        if self.error is not None:
            lines.append(f"{pad}error: {type(self.error).__name__}: {self.error}")
        if self.candidates:
            lines.append(f"{pad}candidates:")
        for c in self.candidates:
            mark = "->" if c.chosen else ("ok" if c.supported else "no")
            note = f" [{c.note}]" if c.note else ""
            timed = f"  {_us(c.time_us)}" if c.time_us is not None else ""
            routing = f"  ({c.routing})" if c.routing else ""
            lines.append(f"{pad}  {mark} {c.backend}/{c.kernel}{note}{timed}{routing}")
            for r in c.reasons:
                lines.append(f"{pad}       - {r}")
        for i, step in enumerate(self.steps):
            lines.append(f"{pad}step {i + 1} of the decomposition:")
            lines += step._lines(pad + "    ")
        if self.autograd_by == "torch":
            lines.append(f"{pad}backward (run by autograd): torch's own, recorded from {self.backend}/{self.kernel}'s torch ops")
        if self.traceable:
            lines.append(f"{pad}under torch.compile: {self.backend}/{self.kernel}'s torch ops join the graph (no hal node)")
        if self.compiled is not None:
            lines.append(f"{pad}under torch.compile:")
            lines += self.compiled._lines(pad + "    ")
        if self.backward is not None:
            lines.append(f"{pad}backward ({'of the torch.ops.hal node, where a compiled call stays one' if self.autograd_by == 'torch' else 'run by autograd'}):")
            lines += self.backward._lines(pad + "    ")
        return lines


def _us(t: float) -> str:
    return "raised" if t == float("inf") else f"{t:.1f} us"
