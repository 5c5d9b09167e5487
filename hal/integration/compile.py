"""What hal decides while torch.compile traces a model, and what an opaque node runs.

Under torch.compile a ``hal.ops`` call becomes a ``torch.ops.hal.<name>_decide`` node
(:mod:`hal.integration.library`), whose body AOTAutograd runs on fake tensors while it builds the
graph. There :func:`traced_kernel` asks the dispatcher: a kernel made of torch's ops joins the graph
as those ops (Inductor fuses them with their neighbours and AOTAutograd derives their backward); a
decomposition's ops are decided in turn; anything else stays one opaque ``torch.ops.hal.<name>``
node, which runs the op's kernel route (:func:`direct`) when the compiled code runs. Nothing is
measured while tracing (:mod:`hal.dispatch.measure` uses what is cached, else priority).

A graph keys on Dynamo's nodes, which are the same whatever hal chose, so :func:`tag_compile_caches`
keys torch.compile's on-disk caches on what decides hal's calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from typing import Any, Callable, Optional, Sequence

import torch

from hal import config
from hal.config import Choice, choice_for, env_flag
from hal.dispatch import DISPATCHER, HOOKS, Decided
from hal.dispatch.explain import COMPILED
from hal.dispatch.plan import canonical, rebatching
from hal.dispatch.validate import prepare
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
    target = route.option.fn
    prepared = decided.prepared
    checks = [(decl.index(name), name, check) for name, check in decl.volatile.items()]
    if prepared.unbatched is not None and not composite:  # a composite takes the call's own arguments
        target = rebatching(target, prepared.unbatched)
    run = canonical(decl.name, target, prepared.subs, checks)
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
    if not choice.torch_autograd or not env_flag("HAL_COMPILE_PREFER_TORCH", True):
        return None
    second = DISPATCHER.decide(decl, args, dataclasses.replace(choice, traceable_only=True, for_graph=True), may_measure=False,
                               prepared=prepared)
    if second.route is None or not second.route.traceable:
        return None
    instead = f"in place of the opaque {decided.route.backend}/{decided.route.kernel}" if decided is not None and decided.route else \
        "the first kernel made of torch's ops"
    route = dataclasses.replace(second.route, reason=f"under torch.compile, {instead}: its ops join the graph")
    return dataclasses.replace(second, route=route)


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


HOOKS.loaded = tag_compile_caches
COMPILED[:] = [traced_alternative]
