"""Step 7: ``hal.explain``: the decision of a call as a :class:`~hal.dispatch.decision.Decision`,
made by the same steps as the call's plan (so what explain says is what runs), without running the
call.

A decomposition is followed op by op: its composite runs with every ``hal.ops`` call inside
answering with results of the right shape from the op's fake rule (:func:`recording_plan`) and
recording its own decision. On the autograd route the backward op's decision is shown too, as the
node would make it. Collectives of :mod:`hal.dist` register their own explainers in
:data:`EXPLAINERS`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from hal import config
from hal.config import Choice, choice_for
from hal.errors import InvalidArgumentError
from hal.gradients import gradients_of
from hal.registry import OPS, OpDecl, get_op
from hal.runtime import Runtime

from .adapt import fake_results, map_outputs
from .decided import Decided
from .decision import Decision
from .plan import NO_COUNT, Plan
from .select import Candidate, describe_inputs, passed_over
from .validate import prepare


class Decider(Protocol):
    """What explain asks of the dispatcher (:class:`hal.dispatch.dispatcher.Dispatcher`, which
    calls this module: named by what it does here, not imported back)."""

    def decide(self, decl: OpDecl, args: Sequence[Any], choice: Choice, may_measure: bool = True) -> Decided: ...

    def compiled(self, decl: OpDecl, args: Sequence[Any], decided: Decided) -> Optional[Decided]: ...

    def runtime(self) -> Runtime: ...


#: Explainers for names that are not registry ops (:func:`hal.wiring.wire` adds hal.dist's collectives).
EXPLAINERS: dict[str, Callable[..., Any]] = {}


class _Walk(threading.local):
    """Per thread: the decisions recorded while a decomposition is followed."""

    steps: Optional[list[Decision]] = None


_WALK = _Walk()


def explain(dispatcher: Decider, decl: OpDecl, args: Sequence[Any], may_measure: bool = True) -> Decision:
    """The decision for a call of a registry op, without running it or caching it: the route, and
    the decisions of a decomposition's ops or of the backward op an autograd node would run. The
    call's routes are measured as the call would measure them (``may_measure``); the steps and the
    backward, met with stand-in arrays, are not."""
    args = tuple(args)
    scope = config.current()
    decided = dispatcher.decide(decl, args, choice_for(decl.name, scope), may_measure=may_measure)
    steps: list[Decision] = []
    backward = compiled = None
    if decided.route is not None:
        if decided.route.kind == "decomposition":
            steps = _follow(decided.route.option.fn, decided.prepared.inputs.args)
        elif decided.route.kind in ("node", "recorded"):
            backward = _backward_decision(dispatcher, decl, decided, args)
        # compiled calls inside a hal.use scope stay opaque nodes
        alternative = dispatcher.compiled(decl, args, decided) if not (scope is not None and scope.forces) else None
        if alternative is not None:
            compiled = decision_of(decl, alternative, reason=alternative.route.reason)
    unseen = passed_over(decl, decided.prepared.inputs, decided.choice, dispatcher.runtime(), decided.selection)
    return decision_of(decl, decided, steps=steps, backward=backward, compiled=compiled, unseen=unseen)


def decision_of(decl: OpDecl, decided: Decided, *, steps: Sequence[Decision] = (), backward: Optional[Decision] = None,
                compiled: Optional[Decision] = None, reason: Optional[str] = None, unseen: Sequence[Candidate] = ()) -> Decision:
    """The public record of a decided call; ``unseen``: the candidates selection never tried
    (:func:`hal.dispatch.select.passed_over`), listed after the others."""
    sel, route, choice = decided.selection, decided.route, decided.choice
    candidates = list(sel.candidates) + list(unseen)
    common = dict(op=decl.name, inputs=describe_inputs(decl, decided.prepared.inputs), device=sel.device, forced=list(sel.forced),
                  strict=choice.strict, device_bound=choice.device_bound, context=sel.context)
    if route is None:
        return Decision(candidates=candidates, error=sel.error, **common)
    outcome = decided.outcome
    measurement = outcome.measurement if outcome is not None else None
    if (route.backend, route.kernel) not in {(c.backend, c.kernel) for c in candidates}:  # a training decomposition
        candidates.append(Candidate(route.backend, route.kernel, [], note="training decomposition"))
    times = _times_by_candidate(decided, measurement)
    candidates = [dataclasses.replace(c, chosen=(c.backend, c.kernel) == (route.backend, route.kernel), time_us=times.get((c.backend, c.kernel)))
                  for c in candidates]
    public, autograd_by = route.public
    return Decision(
        backend=route.backend, kernel=route.kernel, fallback=route.fallback, candidates=candidates, route=public,
        route_reason=reason if reason is not None else route.reason, steps=list(steps), backward=backward, autograd_by=autograd_by,
        traceable=route.traceable, compiled=compiled, measurement=measurement,
        tuning=outcome.note if (outcome is not None and measurement is None) else "", **common,
    )


def _times_by_candidate(decided: Decided, measurement: Any) -> dict[tuple[str, str], float]:
    """The measured time of each candidate kernel (its route's), where the routes were timed."""
    if measurement is None:
        return {}
    out = {}
    for r in decided.alternatives:
        t = measurement.time_of(r.label)
        if t is not None:
            out[(r.backend, r.kernel)] = t
    return out


def recording_plan(dispatcher: Decider, decl: OpDecl) -> Plan:
    """The plan of a call met while explain follows a decomposition: record the call's decision and
    return results of the right shape (which require grad where the real ones would)."""

    def run(*a: Any) -> Any:
        outer = config.current()
        saved = config.enter(dataclasses.replace(outer, explaining=False) if outer else None)
        try:
            decision = explain(dispatcher, decl, a, may_measure=False)
            prepared = prepare(decl, a)
        finally:
            config.leave(saved)
        if _WALK.steps is not None:
            _WALK.steps.append(decision)
        out = fake_results(decl, prepared.inputs.args, prepared.inputs.array_type)
        if decision.route != "kernel":
            out = map_outputs(out, lambda t: t.requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        return out

    return NO_COUNT, run


def _follow(composite: Callable[..., Any], canon: tuple) -> list[Decision]:
    """The decisions of the ops a decomposition calls, in order (nothing runs)."""
    outer = config.current() or config.Overrides()
    saved = config.enter(dataclasses.replace(outer, explaining=True))
    recorder: list[Decision] = []
    previous, _WALK.steps = _WALK.steps, recorder
    try:
        composite(*canon)
    finally:
        _WALK.steps = previous
        config.leave(saved)
    return recorder


def _backward_decision(dispatcher: Decider, decl: OpDecl, decided: Decided, args: tuple) -> Decision:
    """The decision of the backward op for the autograd node of a forward call."""
    spec = gradients_of(decl)
    named = decl.bind(decided.prepared.original_batch(args))
    out = fake_results(decl, tuple(named.values()), decided.prepared.inputs.array_type)
    grad_out = out[0] if isinstance(out, tuple) else out
    asked = [named[n] for n in decl.gradients]  # the gradients autograd would ask the node for
    mask = tuple(isinstance(v, torch.Tensor) and v.requires_grad for v in asked)
    bargs, _ = spec.call(grad_out, spec.saved(named, out), mask)
    with torch.no_grad():
        return explain(dispatcher, spec.bwd, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in bargs), may_measure=False)


def explain_call(dispatcher: Decider, op_name: str, *args: Any, **kwargs: Any) -> Any:
    """``hal.explain(op_name, *args, **kwargs)``: the decision of a registry op's call, or of a
    name in :data:`EXPLAINERS` (nothing runs)."""
    explainer = EXPLAINERS.get(op_name) if isinstance(op_name, str) else None
    if explainer is not None:
        return explainer(*args, **kwargs)
    if not isinstance(op_name, str) or op_name not in OPS:
        raise InvalidArgumentError(
            "hal.explain", "op_name", "the name of a declared op (hal.list_ops()) or a collective of hal.dist",
            repr(op_name),
        )
    decl = get_op(op_name)
    assert decl.entry is not None
    try:
        bound = decl.entry.__signature__.bind(*args, **kwargs)
    except TypeError as exc:
        raise InvalidArgumentError(op_name, "(arguments)", f"arguments matching {op_name}{decl.signature}", str(exc)) from None
    bound.apply_defaults()
    return explain(dispatcher, decl, tuple(bound.arguments[n] for n in decl.param_names))
