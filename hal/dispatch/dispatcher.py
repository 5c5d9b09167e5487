"""The dispatcher: what is loaded, what is decided, what is counted; and a call's decision made once.

A call that misses the cache of its entry function (:mod:`hal.dispatch.entry`) comes to
:meth:`Dispatcher.plan`, which takes the steps in order and caches the plan under the call's key:

1. :mod:`~hal.dispatch.validate`: the arguments checked and canonicalised;
2. :mod:`~hal.dispatch.select`: backend and kernel by priority, with the other kernels that could
   run the call (arrays adapted by :mod:`~hal.dispatch.adapt`); :mod:`~hal.dispatch.memory`: a
   call whose results cannot fit in its device's free memory fails here, before any allocation;
3. :mod:`~hal.dispatch.route`: the routes that could serve the call (kernel, torch-recorded, hal's
   autograd node, decomposition), hal's preference first;
4. :mod:`~hal.dispatch.measure`: the fastest of them, measured once per device and shape bucket;
5. :mod:`~hal.dispatch.plan`: the route as the plan later calls of the signature run.

:meth:`Dispatcher.decide` is steps 1-4 without running the call, shared by the plan, by
``hal.explain`` (:mod:`~hal.dispatch.explain`) and by torch.compile's decisions
(:mod:`hal.integration.compile`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Optional, Sequence

from hal import config, tracing
from hal.config import Choice, choice_for
from hal.registry import OPS, OpDecl
from hal.runtime import Runtime

from . import measure, memory
from .decided import Decided
from .explain import recording_plan
from .plan import NO_COUNT, AutogradHook, Counter, Plan, build, observed
from .route import Route, routes
from .select import FALLBACK_WORDS, Selection, select
from .validate import Prepared, prepare

log = logging.getLogger("hal")

#: Decisions kept at most; the cache is cleared when it grows past this (a key per input signature).
MAX_CACHE_ENTRIES = 8192


@dataclasses.dataclass(frozen=True)
class Integration:
    """What the torch integration plugs into a call's path (:mod:`hal.integration`). The
    dispatcher does not import it: :func:`hal.wiring.wire` connects it (:meth:`Dispatcher.connect`)
    when ``import hal`` runs."""

    #: ``autograd(decl, run) -> apply``: the kernel runner ``run`` as the forward of hal's autograd
    #: node, whose backward runs the op's backward op.
    autograd: AutogradHook
    #: ``traced(decl, args) -> result``: the call under torch.compile (a ``torch.ops.hal`` node).
    traced: Callable[[OpDecl, tuple], Any]
    #: ``loaded(runtime)``: called when a runtime is installed or decisions are reset (the
    #: integration keys torch.compile's caches on what decides hal's calls).
    loaded: Callable[[Runtime], None]
    #: ``for_compile(decl, args, decided)``: inside :func:`hal.tuning.for_compile`, after an eager
    #: decision: measure what a torch.compile graph should run for the call.
    for_compile: Callable[[OpDecl, Sequence[Any], Decided], None]
    #: ``compiled(decl, args, decided) -> Decided | None``: the decision of the call inside a
    #: torch.compile graph where it differs from ``decided`` (what ``hal.explain`` shows).
    compiled: Callable[[OpDecl, Sequence[Any], Decided], Optional[Decided]]


#: Names beyond the registry's ops that ``hal.use(kernel={name: ...})`` may force, with the names
#: they accept (:func:`hal.wiring.wire` adds hal.dist's collectives and their algorithms).
FORCEABLE: dict[str, Callable[[], set[str]]] = {}


class Dispatcher:
    """Chooses and runs kernels; one per process (``hal.dispatch.DISPATCHER``)."""

    def __init__(self) -> None:
        #: the torch integration (None until :meth:`connect`: ``import hal`` connects it).
        self.integration: Optional[Integration] = None
        self._runtime: Optional[Runtime] = None
        self._cache: dict[Any, Plan] = {}
        self._lock = threading.RLock()
        self._counters: dict[tuple[str, str, str], Counter] = {}
        self._warned: set[tuple[str, str, str]] = set()
        #: bumped whenever cached plans are dropped (install, reset, reset_stats): a plan held by a
        #: caller (:func:`hal.dispatch.held.bind`) is stale once it moves.
        self.generation = 0

    # --- state ------------------------------------------------------------------------------

    def connect(self, integration: Integration) -> None:
        """Plug the torch integration into every call's path (:func:`hal.wiring.wire` does, once)."""
        with self._lock:
            self.integration = integration
            self._loaded()

    def runtime(self) -> Runtime:
        """The loaded plugins, discovered on first use."""
        rt = self._runtime
        if rt is None:
            with self._lock:
                if self._runtime is None:
                    self._runtime = Runtime.discover()
                    self._loaded()
                rt = self._runtime
        return rt

    def install(self, runtime: Optional[Runtime]) -> Optional[Runtime]:
        """Use ``runtime`` (None: rediscover on next use); returns the previous one. Clears caches."""
        with self._lock:
            previous, self._runtime = self._runtime, runtime
            self._forget()
            measure.forget_caches()  # another runtime: other plugin versions, other seeds
            if runtime is not None:
                self._loaded()
            return previous

    def reset(self) -> None:
        """Forget cached decisions (after changing HAL_* variables in a running process), the tune
        caches held in memory included (they are read again)."""
        with self._lock:
            self._forget()
            measure.forget_caches()
            if self._runtime is not None:
                self._loaded()

    def stats(self) -> dict[tuple[str, str, str], dict[str, int]]:
        return {k: c.snapshot() for k, c in list(self._counters.items())}

    def reset_stats(self) -> None:
        with self._lock:
            self._counters.clear()
            self._forget()  # cached plans hold the old counters: rebuild them with new ones

    def kernel_names(self, op: str) -> set[str]:
        """The names of every kernel of ``op`` on every installed backend (plus "composite" where
        the op has one), or of a collective's algorithms (:data:`FORCEABLE`): what
        ``hal.use(kernel=...)`` may force."""
        decl = OPS.get(op)
        if decl is None:
            return FORCEABLE[op]() if op in FORCEABLE else set()
        rt = self.runtime()
        names = {k.name for state in rt.backends.values() for k in rt.kernels(op, state.name)}
        if decl.fallback_composite is not None:
            names.add("composite")
        return names

    def forget_plans(self) -> None:
        """Drop the cached plans (not the tune caches): calls decide again, taking measurements made
        since (:func:`hal.tuning.tune`)."""
        with self._lock:
            self._forget()

    def cached_plan(self, key: Any) -> Optional[Plan]:
        """The plan cached under an entry's key (None: not decided yet)."""
        return self._cache.get(key)

    def _forget(self) -> None:
        self._cache.clear()
        self._warned.clear()
        self.generation += 1

    def _loaded(self) -> None:
        if self.integration is not None and self._runtime is not None:
            self.integration.loaded(self._runtime)

    def _connected(self) -> Integration:
        if self.integration is None:
            raise RuntimeError("hal's torch integration is not connected: import hal (hal.wiring.wire connects it)")
        return self.integration

    def _counter(self, op: str, backend: str, kernel: str) -> Counter:
        with self._lock:
            return self._counters.setdefault((op, backend, kernel), Counter())

    # --- deciding ---------------------------------------------------------------------------

    def decide(self, decl: OpDecl, args: Sequence[Any], choice: Choice, may_measure: bool = True,
               prepared: Optional[Prepared] = None) -> Decided:
        """Steps 1-4 of a call (raises InvalidArgumentError for bad arguments; other errors are
        part of the result). ``may_measure`` False: alternatives are ranked by what is cached, else
        by priority (a capture, a trace, explain's walk through a decomposition). The op's
        declaration is sealed by its first decision, if the wiring has not sealed it already (an op
        declared after ``import hal``)."""
        decl.seal()
        prepared = prepared or prepare(decl, args)
        selection = select(decl, prepared.inputs, choice, self.runtime())
        traced = tracing.traced(prepared.inputs.args)
        if selection.error is None and not traced:
            too_big = memory.check(decl, prepared.inputs)
            if too_big is not None:
                selection = dataclasses.replace(selection, chosen=None, alternatives=(), error=too_big)
        options = routes(decl, prepared, args, choice, selection)
        if not options:
            return Decided(prepared, choice, selection, None)
        may_measure = may_measure and not (tracing.capturing() or traced)
        outcome = measure.choose(decl, prepared, args, options, choice.tune, choice.device_bound, may_measure,
                                 self.runtime(), lambda route: self.plan_of(decl, route, prepared, counted=False)[1],
                                 nested=choice.measuring)
        decided = Decided(prepared, choice, selection, outcome.route, options, outcome)
        if choice.for_compile and may_measure and not choice.measuring:
            self._connected().for_compile(decl, args, decided)
        return decided

    def compiled(self, decl: OpDecl, args: Sequence[Any], decided: Decided) -> Optional[Decided]:
        """The decision of a call inside a torch.compile graph where it differs from ``decided``
        (the torch integration's :func:`hal.integration.compile.traced_alternative`)."""
        return self._connected().compiled(decl, args, decided)

    def traced(self, decl: OpDecl, args: tuple) -> Any:
        """A call torch.compile traces: the torch integration's graph node(s) for it."""
        return self._connected().traced(decl, args)

    # --- plans --------------------------------------------------------------------------------

    def plan(self, decl: OpDecl, args: tuple, key: Any) -> Plan:
        """Validate a call, decide its route, build its plan and cache it under ``key`` (None: do
        not cache). Called by the entry functions on a cache miss. A call traced by torch.compile
        (fake tensors, whatever torch's ``is_compiling()`` says) becomes its graph node."""
        config.check_environment()
        overrides = config.current()
        if tracing.traced(args):
            return NO_COUNT, lambda *a: self.traced(decl, a)
        if overrides is not None and overrides.explaining:
            return recording_plan(self, decl)
        choice = choice_for(decl.name, overrides)
        decided = self.decide(decl, args, choice)
        if decided.route is None:
            assert decided.error is not None
            raise decided.error
        route = decided.route
        if route.fallback and not choice.measuring:
            self._warn_fallback(decl, route, decided.selection)
        plan = self.plan_of(decl, route, decided.prepared, counted=not choice.measuring)
        if overrides is not None and overrides.observer is not None and not choice.measuring:
            plan = observed(plan, overrides.observer, decl, route)
        if key is not None and decided.outcome is not None and decided.outcome.final:
            self.remember(key, plan)
        return plan

    def remember(self, key: Any, plan: Plan) -> None:
        """Cache ``plan`` under an entry's key (the cache is cleared when it is full)."""
        with self._lock:
            if len(self._cache) >= MAX_CACHE_ENTRIES:
                self._cache.clear()
            self._cache[key] = plan

    def plan_of(self, decl: OpDecl, route: Route, prepared: Prepared, counted: bool = True) -> Plan:
        """The plan of one route for calls of ``prepared``'s signature (``counted`` False: it counts
        nothing, as routes being timed do)."""
        counter = self._counter(decl.name, route.backend, route.kernel) if counted else None
        return build(decl, route, prepared, counter, self._connected().autograd)

    def _warn_fallback(self, decl: OpDecl, route: Route, selection: Selection) -> None:
        """Log a fallback once per (op, backend, kernel), with every rejected candidate's reasons."""
        key = (decl.name, route.backend, route.kernel)
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        rejected = [f"{c.backend}/{c.kernel}: {'; '.join(c.reasons)}" for c in selection.candidates if c.reasons]
        log.warning(
            "hal: %s fell back to %s (%s/%s) on %s; rejected: %s. Set HAL_STRICT=1 to make this an error.",
            decl.name, FALLBACK_WORDS[route.fallback or "composite"], route.backend, route.kernel, selection.device,
            " | ".join(rejected) or "none",
        )


DISPATCHER = Dispatcher()


def install(runtime: Optional[Runtime]) -> Optional[Runtime]:
    """Replace the loaded plugins (tests build a Runtime from plugin objects); returns the old one."""
    return DISPATCHER.install(runtime)


def reset() -> None:
    """Forget cached decisions, e.g. after changing HAL_* environment variables."""
    DISPATCHER.reset()


def stats() -> dict[tuple[str, str, str], dict[str, int]]:
    """Calls and fallbacks per (op, backend, kernel) since start (or the last ``reset_stats``)."""
    return DISPATCHER.stats()


def reset_stats() -> None:
    DISPATCHER.reset_stats()


def list_ops() -> list[OpDecl]:
    """Every declared op (forward and backward), in declaration order."""
    return list(OPS.values())


def kernel_names(op: str) -> set[str]:
    """What ``hal.use(kernel={op: ...})`` may force for ``op`` (:meth:`Dispatcher.kernel_names`)."""
    return DISPATCHER.kernel_names(op)
