"""What hal decides while torch.compile traces a model, and what an opaque node runs.

Under torch.compile a ``hal.ops`` call becomes a ``torch.ops.hal.<name>_decide`` node
(:mod:`hal.integration.library`), whose body AOTAutograd runs on fake tensors while it builds the
graph. There :func:`traced_kernel` asks the dispatcher: a kernel made of torch's ops joins the graph
as those ops (Inductor fuses them with their neighbours and AOTAutograd derives their backward); a
decomposition's ops are decided in turn; anything else stays one opaque ``torch.ops.hal.<name>``
node, which runs the op's kernel route (:func:`direct`) when the compiled code runs.

Where the eager choice is an opaque kernel and a kernel made of torch's ops can also run the call,
which of the two the graph takes is a measured choice: :func:`measure_for_compile` (inside
:func:`hal.tuning.for_compile`) times the opaque route against ``torch.compile`` of the torch-ops
kernel on the call's inputs and keeps the winner in the tune cache (context ``compiled``);
:func:`traced_alternative` reads it while tracing. Nothing is measured while tracing: without a
measurement the torch-ops kernel is taken (``HAL_COMPILE_PREFER_TORCH=0``: the opaque node).

A graph keys on Dynamo's nodes, which are the same whatever hal chose, so :func:`tag_compile_caches`
keys torch.compile's on-disk caches on what decides hal's calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import types
from typing import Any, Callable, Optional, Sequence

import torch

from hal import config
from hal.config import Choice, choice_for, env_flag
from hal.dispatch import DISPATCHER, Decided, measure
from hal.dispatch.plan import canonical, rebatching
from hal.dispatch.route import Route
from hal.dispatch.validate import Prepared, prepare
from hal.errors import HalError
from hal.registry import OpDecl
from hal.runtime import Runtime
from hal.version import __version__

log = logging.getLogger("hal")

_HAL_TAG = "|hal:"
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


def traced_kernel(decl: OpDecl, args: tuple) -> Optional[Callable[[], Any]]:
    """As AOTAutograd traces a call (on fake tensors): the call of the kernel the dispatcher chooses
    when that kernel is made of torch's ops (so that its ops join the compiled graph), the call of
    the op's decomposition where that is the route (its ops decided in turn); None where the call
    stays one opaque ``torch.ops.hal`` node (any other kernel; an error, which the node's fake
    kernel raises as in eager; ops whose argument values are checked on every call). Nothing is
    counted: the graph runs the ops, not hal."""
    if decl.values is not None:
        return None
    config.check_environment()
    try:
        decided = decide_traced(decl, args, choice_for(decl.name, config.current()))
    except HalError:
        return None  # the opaque node's fake kernel raises it, as an eager call would
    if decided is None or decided.route is None:
        return None
    route = decided.route
    composite = route.kind == "decomposition"  # its ops are decided in turn, as in eager
    if not (route.traceable or composite):
        return None
    run = _inlined_call(decl, route, decided.prepared, rebatch=not composite)  # a composite takes the call's own arguments
    return lambda: run(*args)


def decide_traced(decl: OpDecl, args: Sequence[Any], choice: Choice) -> Optional[Decided]:
    """The decision of a call as AOTAutograd traces it: the eager decision, or
    :func:`traced_alternative` in its place. A capability check that reads data (a NumPy view, an
    address) cannot run on fake tensors: then only the kernels made of torch's ops are considered,
    and None says that the call stays an opaque node, which decides on real tensors when the graph
    runs. Raises InvalidArgumentError for bad arguments."""
    prepared = prepare(decl, args)
    choice = dataclasses.replace(choice, for_graph=True)
    try:
        decided: Optional[Decided] = DISPATCHER.decide(decl, args, choice, may_measure=False, prepared=prepared)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        _no_decision_on_fakes(decl, exc)
        decided = None
    try:
        alternative = traced_alternative(decl, args, decided, choice, prepared)
    except Exception as exc:  # noqa: BLE001 - as above
        _no_decision_on_fakes(decl, exc)
        alternative = None
    return alternative if alternative is not None else decided


def traced_alternative(decl: OpDecl, args: Sequence[Any], decided: Optional[Decided], choice: Optional[Choice] = None,
                       prepared: Any = None) -> Optional[Decided]:
    """A torch.compile graph's second decision for a call whose eager decision is an opaque kernel
    (None: it could not be made on fake tensors). A graph runs the ops of a kernel made of torch's
    ops as its own code (Inductor fuses them with their neighbours), any other kernel as an opaque
    node that Inductor cannot fuse and that costs a Python call per run. So, unless
    HAL_COMPILE_PREFER_TORCH=0, the best kernel made of torch's ops that can run the inputs; None
    where none can (the opaque node stays). Not the op's composite: where a kernel exists for what
    its composite cannot do (``linear_cross_entropy`` without the whole logits in memory), the
    composite would undo it; a backend that wants its fused op decomposed inside graphs registers a
    kernel of torch's ops for it, below its others."""
    if decided is not None:
        route = decided.route
        if route is None or route.traceable or route.kind == "decomposition":
            return None
        choice = decided.choice
    assert choice is not None
    if not choice.torch_autograd:
        return None
    second = _torch_ops_decision(decl, args, choice, prepared)
    if second is None:
        return None
    opaque = decided.route if decided is not None else None
    measured = _measured(decl, second.prepared, second.route, opaque)
    if measured is not None:
        if measured.winner.split(" (")[0] != _kernel_of(second.route):
            return None  # the opaque kernel measured faster: the node stays
        why = f"measured faster under torch.compile than the opaque {_kernel_of(opaque)}" if opaque else "measured"
        return dataclasses.replace(second, route=dataclasses.replace(second.route, reason=f"{why}: its ops join the graph",
                                                                     measurement=measured))
    if not env_flag("HAL_COMPILE_PREFER_TORCH", True):
        return None
    instead = f"in place of the opaque {_kernel_of(opaque)}" if opaque is not None else "the first kernel made of torch's ops"
    route = dataclasses.replace(second.route, reason=f"under torch.compile, {instead} (not measured): its ops join the graph")
    return dataclasses.replace(second, route=route)


def measure_for_compile(decl: OpDecl, args: Sequence[Any], decided: Decided) -> None:
    """Inside :func:`hal.tuning.for_compile`, after a call's eager decision on real arrays: where
    its route is an opaque kernel (a graph's node) and a kernel made of torch's ops can run the call
    too, time the opaque route against ``torch.compile`` of that kernel (forward and backward where
    the call trains; wall time, since a compiled graph's host issues both) and keep the winner in
    the tune cache, context ``compiled``, for :func:`traced_alternative`. The torch-ops kernel
    keeps its place unless the opaque one is faster by :data:`hal.dispatch.measure.MARGIN`.
    Costs one compilation per call signature."""
    opaque = decided.route
    if opaque is None or opaque.traceable or opaque.kind == "decomposition" or not decided.choice.torch_autograd:
        return
    second = _torch_ops_decision(decl, args, decided.choice, decided.prepared)
    if second is None:
        return
    torch_ops = second.route
    compiled = torch.compile(_own_code(_inlined_call(decl, torch_ops, decided.prepared)), dynamic=False)

    def runner(route: Route) -> Callable[..., Any]:
        return compiled if route is torch_ops else DISPATCHER.plan_of(decl, route, decided.prepared, counted=False)[1]

    measure.choose(decl, decided.prepared, args, (torch_ops, opaque), "on", False, True, DISPATCHER.runtime(), runner,
                   base_context="compiled")


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a copy of its code object. Dynamo keeps a function's compiled graphs on its code
    object, at most ``torch._dynamo.config.recompile_limit`` (8) of them, and runs the function
    uncompiled beyond that: measured after eight call signatures of the same kernel, a ninth timed
    eager PyTorch's ops in place of Inductor's code (found measuring linear_cross_entropy on the CPU
    at eight shapes and two dtypes)."""
    if not isinstance(fn, types.FunctionType):  # a partial or a callable object: a function around it
        target = fn

        def fn(*args: Any) -> Any:
            return target(*args)

    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _torch_ops_decision(decl: OpDecl, args: Sequence[Any], choice: Choice, prepared: Optional[Prepared]) -> Optional[Decided]:
    """The best kernel made of torch's ops that can run the call (None: none can)."""
    second = DISPATCHER.decide(decl, args, dataclasses.replace(choice, traceable_only=True, for_graph=True, for_compile=False),
                               may_measure=False, prepared=prepared)
    if second.route is None or not second.route.traceable:
        return None
    return second


def _inlined_call(decl: OpDecl, route: Route, prepared: Prepared, rebatch: bool = True) -> Callable[..., Any]:
    """What a graph inlines for a route made of torch's ops: its function on the canonical arguments
    (``rebatch``: a call given without its batch dimension gets it, as the kernel expects)."""
    target = route.option.fn
    if rebatch and prepared.unbatched is not None:
        target = rebatching(target, prepared.unbatched)
    checks = [(decl.index(name), name, check) for name, check in decl.volatile.items()]
    return canonical(decl.name, target, prepared.subs, checks)


def _measured(decl: OpDecl, prepared: Prepared, torch_ops: Route, opaque: Optional[Route]) -> Optional[measure.Measurement]:
    """The compiled context's measurement of a call, where one was made for these two kernels (a
    traced call cannot tell whether it trains: either context's measurement serves)."""
    if opaque is None:
        return None
    kernels = {_kernel_of(torch_ops), _kernel_of(opaque)}
    cache = measure.cache_of(prepared, DISPATCHER.runtime())
    for context in ("compiled/train", "compiled"):
        key = measure.tune_key(decl, prepared, context, grads=False)
        record = cache.get(key)
        if record is None or {label.split(" (")[0] for label in record.get("times_us", {})} != kernels:
            continue
        times = tuple((label, float(t) if t != "inf" else float("inf")) for label, t in record["times_us"].items())
        return measure.Measurement(key, context, times, record["winner"], "seed" if record.get("source") == "seed" else "cache")
    return None


def _kernel_of(route: Optional[Route]) -> str:
    return f"{route.backend}/{route.kernel}" if route is not None else "?"


def direct(decl: OpDecl, args: tuple) -> Any:
    """Run ``decl`` on the kernel route (no autograd node), through its public function: the body of
    the ``torch.ops.hal`` operators, which run below autograd."""
    assert decl.entry is not None
    keywords = [p.name for p in decl.params if p.keyword_only]
    n = len(decl.params) - len(keywords)
    enabled = _grad_enabled()
    _set_grad_enabled(False)
    try:
        if keywords:
            return decl.entry(*args[:n], **dict(zip(keywords, args[n:])))
        return decl.entry(*args)
    finally:
        _set_grad_enabled(enabled)


def tag_compile_caches(runtime: Runtime) -> None:
    """Key torch.compile's on-disk caches on what decides hal's calls. A compiled graph holds the
    torch ops of the kernels chosen while it was traced (:func:`traced_kernel`), but AOTAutograd's
    cache keys on Dynamo's graph, whose ``torch.ops.hal.<name>_decide`` nodes are the same whatever
    was chosen: without this, a process with other plugins or other HAL_* variables would load a
    graph traced with the old choices. Appends hal's digest (hal's version, the runtime's
    :meth:`~hal.runtime.Runtime.signature`, the HAL_* variables) to
    ``torch.compiler.config.cache_key_tag``, keeping whatever the user put before it."""
    cfg = getattr(torch.compiler, "config", None)
    if cfg is None or not hasattr(cfg, "cache_key_tag"):  # pragma: no cover - older torch
        return
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("HAL_"))
    digest = hashlib.sha256(repr((__version__, runtime.signature(), env)).encode()).hexdigest()[:16]
    user = cfg.cache_key_tag.split(_HAL_TAG)[0]
    cfg.cache_key_tag = f"{user}{_HAL_TAG}{digest}"


def _no_decision_on_fakes(decl: OpDecl, exc: Exception) -> None:
    log.debug("hal: %s under torch.compile: no decision on fake tensors (%s: %s)", decl.name, type(exc).__name__, exc)

