"""Step 3: which backend and kernel can run the call, in the order hal prefers them.

1. The device picks the backends: the available backends serving it, highest priority first, then
   for device tensors the CPU backends through host copies; ``HAL_BACKEND`` / ``hal.use(backend=)``
   forces one.
2. In each backend, the kernels that serve the call's context (:mod:`hal.dispatch.context`: graph,
   compiled, training or eager) in the order of their priority there (:class:`hal.plugin.Routing`);
   the first whose ``not_supported_reasons`` is empty is chosen, unless a kernel is forced (``HAL_KERNEL_<OP>`` / ``hal.use(kernel=)``). Failing every kernel,
   the op's composite decomposition runs on that backend; failing that, the next backend. Any
   choice but the first backend's own kernel is a fallback.
3. The other kernels of the chosen one's backend that support the inputs are its *alternatives*:
   :mod:`hal.dispatch.measure` may time them all and take the fastest.
4. Inputs with a zero-size dimension are answered by the op's ``empty`` rule in place of the kernel
   chosen for them (kernels never see zero-size arrays).

The result is one frozen :class:`Selection`; errors (no kernel, strict mode, a missing backend) are
part of it rather than raised, so that ``hal.explain`` can show them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional, Sequence

import torch

from hal import arrays
from hal.config import Choice
from hal.errors import BackendUnavailableError, HalError, UnsupportedError
from hal.plugin import Inputs, KernelSpec
from hal.registry import OpDecl
from hal.runtime import BackendState, Runtime
from hal.types import ARRAY_KINDS

from .adapt import inputs_as, kernel_runner
from .context import context_of
from .validate import has_zero_size

log = logging.getLogger("hal")

#: The backends of this project, which ``pip install hal-backend-<name>`` installs.
KNOWN_BACKENDS = ("cpu_ref", "cpu", "cuda", "rocm", "eager")
#: which distribution serves a device kind when none is installed.
DEVICE_DISTRIBUTIONS = {"cpu": "hal-backend-cpu", "cuda": "hal-backend-cuda", "rocm": "hal-backend-rocm"}

FALLBACK_WORDS = {
    "composite": "the op's composite decomposition",
    "backend": "a lower-priority backend",
    "host": "a CPU backend, copying data through the host",
}

#: why a kernel is passed over when a torch.compile graph looks for one made of torch's ops.
UNTRACEABLE = "under torch.compile: not made of torch's ops (it would be an opaque node)"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One kernel (or composite, or backend) that was considered, as ``hal.explain`` lists it."""

    backend: str
    kernel: str
    reasons: list[str]
    chosen: bool = False
    note: str = ""  # "host fallback", "forced", ...
    #: the measured time of this candidate in microseconds (see :mod:`hal.dispatch.measure`).
    time_us: Optional[float] = None
    #: a kernel's contexts and its priority in each (:class:`hal.plugin.Routing`), as explain prints them.
    routing: str = ""

    @property
    def supported(self) -> bool:
        return not self.reasons


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to run the call: a kernel, the op's composite or its empty rule, on one backend."""

    backend: str
    #: the kernel's name, "composite" or "empty".
    kernel: str
    #: runs the call's canonical arguments (the kernel adapted to the caller's arrays, or the composite).
    fn: Callable[..., Any]
    #: None on the device's preferred path; else "composite", "backend" or "host".
    fallback: Optional[str] = None
    #: the kernel is made of torch's differentiable ops for these inputs, and torch's autograd may
    #: record it (``HAL_TORCH_AUTOGRAD`` on, no input differentiated that the op gives no gradient):
    #: on the autograd route torch records it, and under torch.compile its ops join the graph.
    recordable: bool = False


@dataclasses.dataclass(frozen=True)
class Selection:
    """The outcome of selection for one validated call."""

    #: the device as explain names it ("cuda:0", "cpu (numpy)").
    device: str
    candidates: tuple[Candidate, ...]
    #: what hal prefers by priority (None with an error).
    chosen: Optional[Option]
    #: the chosen kernel's equals: further kernels of its backend that support the inputs, by rank
    #: (none where the choice is forced, a fallback or the empty rule).
    alternatives: tuple[Option, ...] = ()
    error: Optional[HalError] = None
    #: what was forced, as explain prints it.
    forced: tuple[str, ...] = ()
    #: the first usable backend of the device (a training decomposition's backend).
    first_backend: Optional[str] = None
    #: the context the call was decided in (:func:`hal.dispatch.context.context_of`).
    context: str = "eager"

    def with_choice(self, option: Option, note: str) -> "Selection":
        """The same selection with ``option`` (one of :attr:`alternatives`) chosen instead."""
        marked = tuple(dataclasses.replace(c, chosen=(c.backend, c.kernel) == (option.backend, option.kernel),
                                           note=note if (c.backend, c.kernel) == (option.backend, option.kernel) else c.note)
                       for c in self.candidates)
        return dataclasses.replace(self, candidates=marked, chosen=option)


def select(decl: OpDecl, inputs: Inputs, choice: Choice, runtime: Runtime) -> Selection:
    """Choose a backend and kernel for validated inputs; never raises (errors go in the Selection)."""
    device = str(inputs.device) if inputs.array_type == "torch" else "cpu (numpy)"
    forced = _forced(choice)
    context = context_of(decl, inputs, choice)
    found = _Search(decl, inputs, choice, runtime, device, context)
    order = found.backend_order()
    if order is None:
        return Selection(device, tuple(found.candidates), None, error=found.error, forced=forced, context=context)
    first = order[0][0].name
    for position, (state, mode) in enumerate(order):
        option = found.in_backend(state, mode, position)
        if found.error is not None:
            return Selection(device, tuple(found.candidates), None, error=found.error, forced=forced, first_backend=first, context=context)
        if option is None:
            continue
        if option.fallback and choice.strict:
            error = UnsupportedError(
                f"strict mode: {decl.name} on {device} would fall back to {FALLBACK_WORDS[option.fallback]} "
                f"({option.backend}/{option.kernel}) because the preferred kernels cannot run these inputs:"
                f"{candidate_lines(found.candidates)}\nUnset HAL_STRICT / hal.use(strict=...) to allow fallbacks."
            )
            return Selection(device, tuple(found.candidates), None, error=error, forced=forced, first_backend=first, context=context)
        alternatives = tuple(found.alternatives)
        if option.kernel != "composite" and decl.empty is not None and has_zero_size(decl, inputs.args):
            option, alternatives = found.empty_instead(decl, option), ()
        return Selection(device, tuple(found.candidates), option, alternatives, forced=forced, first_backend=first, context=context)
    error = UnsupportedError(no_kernel_message(decl, device, inputs, found.candidates, runtime))
    return Selection(device, tuple(found.candidates), None, error=error, forced=forced, first_backend=first, context=context)


def ranked(kernels: Sequence[KernelSpec], context: str) -> list[KernelSpec]:
    """``kernels`` (in their registered priority order) as selection tries them for a call made in
    ``context``: those serving it by their priority there (ties keep their order), then those that
    do not (candidates only for explain, which says why)."""
    serving = [(p, k) for k in kernels for p in (k.routing.priority(context),) if p is not None]
    serving.sort(key=lambda pk: -pk[0])
    return [k for _, k in serving] + [k for k in kernels if k.routing.priority(context) is None]


def _context_reasons(k: KernelSpec, context: str) -> list[str]:
    """Why ``k`` is no candidate in ``context`` (empty: it serves calls made there)."""
    if k.routing.priority(context) is not None:
        return []
    return [f"serves no {context} calls (its contexts: {k.routing})"]


class _Search:
    """The state of one selection: the candidates seen so far, and the error found, if any."""

    def __init__(self, decl: OpDecl, inputs: Inputs, choice: Choice, runtime: Runtime, device: str, context: str) -> None:
        self.decl, self.inputs, self.choice, self.runtime, self.device = decl, inputs, choice, runtime, device
        self.context = context
        self.candidates: list[Candidate] = []
        self.alternatives: list[Option] = []
        self.error: Optional[HalError] = None

    def backend_order(self) -> Optional[list[tuple[BackendState, str]]]:
        """The backends to try, in order, each with a mode: "native" or "host" (copies via the CPU)."""
        choice, rt, inputs = self.choice, self.runtime, self.inputs
        kind = inputs.device_kind
        if choice.backend:
            state = rt.backends.get(choice.backend)
            if state is None:
                self.error = BackendUnavailableError(
                    f"backend {choice.backend!r} (forced by {choice.backend_source}) is not installed; installed "
                    f"backends: {', '.join(sorted(rt.backends)) or 'none'}. {_install_hint(choice.backend)}"
                    f"{plugin_problems(rt)}"
                )
                return None
            if not state.available:
                self.error = BackendUnavailableError(
                    f"backend {choice.backend!r} (forced by {choice.backend_source}) is installed but not usable "
                    f"here: {state.reason}. Unset the override to let hal choose."
                )
                return None
            if kind in state.info.device_types:
                return [(state, "native")]
            if "cpu" in state.info.device_types and inputs.array_type == "torch":
                return [(state, "host")]
            self.error = BackendUnavailableError(
                f"backend {choice.backend!r} (forced by {choice.backend_source}) serves "
                f"{', '.join(state.info.device_types)} devices; these inputs are on {self.device}"
            )
            return None
        native = rt.backends_for(kind)
        for state in native:
            if not state.available:
                self.candidates.append(Candidate(state.name, "*", [f"backend unavailable: {state.reason}"]))
        usable = [(s, "native") for s in native if s.available]
        if not usable:
            names = ", ".join(s.name for s in native) or "none installed"
            disabled = [lp.name for lp in rt.plugins if lp.disabled]
            hint = DEVICE_DISTRIBUTIONS.get(kind)
            install = f"Install one (pip install {hint}) or move" if hint else "Move"
            off = f" ({', '.join(disabled)} disabled by HAL_DISABLE_PLUGINS)" if disabled else ""
            self.error = BackendUnavailableError(
                f"no usable backend for {kind} inputs ({self.device}); backends for {kind}: {names}{off}. "
                f"{install} the inputs to a supported device.{candidate_lines(self.candidates)}{plugin_problems(rt)}"
            )
            return None
        if kind != "cpu" and inputs.array_type == "torch":
            usable += [(s, "host") for s in rt.backends_for("cpu") if s.available]
        return usable

    def in_backend(self, state: BackendState, mode: str, position: int) -> Optional[Option]:
        """The kernel of one backend for the inputs (or its composite); records every candidate, and
        on the first backend tried the other kernels that could run them too."""
        decl, choice = self.decl, self.choice
        kernels = ranked(self.runtime.kernels(decl.name, state.name), self.context)
        names = [k.name for k in kernels]
        composite = decl.fallback_composite
        wants_composite = choice.kernel == "composite" and (composite is not None or choice.kernel_required)
        forced = choice.kernel if (choice.kernel in names or wants_composite) else None
        if choice.kernel and forced is None and choice.kernel_required:
            self.error = UnsupportedError(
                f"{choice.kernel_source} forces kernel {choice.kernel!r} for {decl.name}, but backend "
                f"{state.name} has no such kernel; its kernels: {', '.join(names + (['composite'] if composite else []))}"
            )
            return None
        note = "host fallback" if mode == "host" else ""
        if not kernels:
            self.candidates.append(Candidate(state.name, "*", [f"no kernel of {decl.name} registered"], note=note))
        inputs = self._inputs_for(state, mode)
        views: dict[str, Inputs] = {}
        chosen: Optional[Option] = None
        fallback = None if (position == 0 or forced) else ("host" if mode == "host" else "backend")
        for k in kernels:
            if forced is not None and k.name != forced:
                continue
            api = k.array_api or state.info.array_api
            routing = str(k.routing)
            elsewhere = _context_reasons(k, self.context)
            if elsewhere or (choice.traceable_only and not _made_of_torch_ops(k, api, mode, inputs)):
                self.candidates.append(Candidate(state.name, k.name, elsewhere or [UNTRACEABLE], note=note, routing=routing))
                continue
            reasons = _reasons(k, inputs_as(inputs, api, views))
            self.candidates.append(Candidate(state.name, k.name, reasons, chosen=not reasons and chosen is None,
                                             note=note or ("forced" if forced else ""), routing=routing))
            if reasons:
                continue
            option = self._option(state, k, api, mode, inputs, fallback)
            if chosen is None:
                chosen = option
                if forced is not None or fallback is not None:
                    return chosen
            else:
                self.alternatives.append(option)
        if chosen is not None:
            return chosen
        if forced is not None and forced != "composite":
            self.error = UnsupportedError(
                f"{decl.name}: the forced kernel {state.name}/{forced} ({choice.kernel_source}) cannot run these "
                f"inputs:{candidate_lines(self.candidates)}\ninputs:\n  " + "\n  ".join(describe_inputs(decl, self.inputs))
            )
            return None
        if composite is None:
            if forced == "composite":
                self.error = UnsupportedError(f"{decl.name} has no composite decomposition to force ({choice.kernel_source})")
            return None
        self.candidates.append(Candidate(state.name, "composite", [], chosen=True,
                                         note="forced" if forced else "decomposition into other ops"))
        return Option(state.name, "composite", composite, None if forced else "composite")

    def empty_instead(self, decl: OpDecl, chosen: Option) -> Option:
        """The op's empty rule in place of the kernel chosen (the same choice, errors and forcing as
        for other inputs)."""
        self.candidates = [dataclasses.replace(c, chosen=False) for c in self.candidates]
        self.candidates.append(Candidate(chosen.backend, "empty", [], chosen=True,
                                         note=f"a zero-size dimension: the op's empty rule instead of {chosen.kernel}"))
        return Option(chosen.backend, "empty", _empty_runner(decl), chosen.fallback)

    def _inputs_for(self, state: BackendState, mode: str) -> Inputs:
        i = self.inputs
        graph = self.choice.for_graph
        if mode == "host":
            return Inputs(self.decl, i.args, "cpu", torch.device("cpu"), i.dtype, "torch", None, graph)
        return Inputs(self.decl, i.args, i.device_kind, i.device, i.dtype, i.array_type, _arch(state, i.device), graph)

    def _option(self, state: BackendState, k: KernelSpec, api: str, mode: str, inputs: Inputs, fallback: Optional[str]) -> Option:
        recordable = (self.choice.torch_autograd and not _differentiates_more(self.decl, self.inputs.args)
                      and _made_of_torch_ops(k, api, mode, inputs))
        host_of = self.inputs.device if mode == "host" else None
        fn = kernel_runner(self.decl, k.fn, api, "torch" if mode == "host" else self.inputs.array_type, host_of, self.inputs.args)
        return Option(state.name, k.name, fn, fallback, recordable)


def passed_over(decl: OpDecl, inputs: Inputs, choice: Choice, runtime: Runtime, selection: Selection) -> list[Candidate]:
    """The kernels a selection never tried, each with the reasons it was passed over, for
    ``hal.explain`` (which promises every candidate): those of the lower-priority backends of the
    device (and, for device tensors, of the CPU backends a host fallback would use), or of the
    other backends where one was forced. Each says why it was not tried; a kernel of a native
    backend also gets its own capability reasons (none: it could run the call if chosen), computed
    on the call's arrays as selection would (views, no copies). Host backends' checks are not run:
    they would need copies of device arrays. Backends that serve neither the device nor (for device
    tensors) the host are no candidates and are not listed."""
    tried = {c.backend for c in selection.candidates}
    chosen = selection.chosen
    if chosen is None:
        return []  # an error: every backend that could serve the call was tried
    if choice.backend:
        why = f"not tried: backend {choice.backend} is forced ({choice.backend_source})"
    else:
        why = f"not tried: backend {chosen.backend} ranks first and runs the call"
    others = [(s, "native") for s in runtime.backends_for(inputs.device_kind)]
    if inputs.device_kind != "cpu" and inputs.array_type == "torch":
        others += [(s, "host") for s in runtime.backends_for("cpu")]
    search = _Search(decl, inputs, choice, runtime, selection.device, selection.context)
    out: list[Candidate] = []
    for state, mode in others:
        if state.name in tried:
            continue
        tried.add(state.name)
        if not state.available:
            out.append(Candidate(state.name, "*", [f"backend unavailable: {state.reason}"]))
            continue
        kernels = ranked(runtime.kernels(decl.name, state.name), selection.context)
        if not kernels:
            out.append(Candidate(state.name, "*", [why, f"no kernel of {decl.name} registered"]))
            continue
        note = "host fallback" if mode == "host" else ""
        if mode == "host":
            out += [Candidate(state.name, k.name, [why, *_context_reasons(k, selection.context)], note=note, routing=str(k.routing))
                    for k in kernels]
            continue
        native = search._inputs_for(state, "native")
        views: dict[str, Inputs] = {}
        for k in kernels:
            api = k.array_api or state.info.array_api
            own = _context_reasons(k, selection.context) or _reasons(k, inputs_as(native, api, views))
            out.append(Candidate(state.name, k.name, [why, *own], note=note, routing=str(k.routing)))
    return out


def _forced(choice: Choice) -> tuple[str, ...]:
    out = []
    if choice.backend:
        out.append(f"backend {choice.backend} ({choice.backend_source})")
    if choice.kernel:
        out.append(f"kernel {choice.kernel} ({choice.kernel_source})")
    return tuple(out)


def _made_of_torch_ops(k: KernelSpec, api: str, mode: str, inputs: Inputs) -> bool:
    """Whether kernel ``k`` runs as torch's differentiable ops for these inputs: what torch's
    autograd may record eagerly and a torch.compile graph may take in. Asked only of kernels that
    support the inputs, or of each candidate while a graph looks for such a kernel: a kernel's
    check may assume the inputs are ones it supports."""
    return mode == "native" and api == "torch" and not k.torch_autograd_reasons(inputs)


def _differentiates_more(decl: OpDecl, args: tuple) -> bool:
    """Whether an input the op gives no gradient (rotary's cos and sin, an attention mask) requires
    grad: torch's autograd, recording the kernel, would differentiate it where the op says None."""
    given = decl.gradients
    return any(isinstance(a, torch.Tensor) and a.requires_grad for p, a in zip(decl.params, args) if p.name not in given)


def _empty_runner(decl: OpDecl) -> Callable[..., Any]:
    """The op's empty rule as a kernel: canonical arguments in, results out."""
    rule = decl.empty
    assert rule is not None
    names = decl.param_names

    def run(*args: Any) -> Any:
        return rule(dict(zip(names, args)))

    return run


def _arch(state: BackendState, device: Any) -> Optional[str]:
    try:
        return state.arch(device)
    except Exception as exc:  # a backend's architecture query must not break dispatch
        log.warning("hal: backend %s could not name the architecture of %s: %s", state.name, device, exc)
        return None


def _reasons(k: KernelSpec, inputs: Inputs) -> list[str]:
    """A kernel's rejection reasons; a check that raises rejects the kernel with the error."""
    try:
        return k.not_supported_reasons(inputs)
    except Exception as exc:
        return [f"its capability check raised {type(exc).__name__}: {exc}"]


# --- what the errors say ---------------------------------------------------------------------------


def describe_inputs(decl: OpDecl, inputs: Inputs) -> list[str]:
    """One line per array argument: its name, shape, dtype and device."""
    lines = []
    for p, a in zip(decl.params, inputs.args):
        if p.kind in ARRAY_KINDS and (arrays.is_array(a) or isinstance(a, (list, tuple))):
            if isinstance(a, (list, tuple)) and a and arrays.is_array(a[0]):
                lines.append(f"{p.name}: {len(a)} arrays, first {arrays.describe(a[0])}")
            else:
                lines.append(f"{p.name}: {arrays.describe(a)}")
    return lines


def candidate_lines(candidates: Any) -> str:
    out = []
    for c in candidates:
        note = f" [{c.note}]" if c.note else ""
        reasons = "; ".join(c.reasons) if c.reasons else "supported"
        out.append(f"\n  {c.backend}/{c.kernel}{note}: {reasons}")
    return "".join(out)


def no_kernel_message(decl: OpDecl, device: str, inputs: Inputs, candidates: Any, rt: Runtime) -> str:
    return (
        f"no kernel can run {decl.name} for these inputs on {device}:\n  "
        + "\n  ".join(describe_inputs(decl, inputs))
        + "\ncandidates:"
        + (candidate_lines(candidates) or "\n  (no backend registers a kernel for this op)")
        + plugin_problems(rt)
    )


def _install_hint(backend: str) -> str:
    if backend in KNOWN_BACKENDS:
        return (f"Install it with `pip install hal-backend-{backend.replace('_', '-')}` (or ./backends/{backend} "
                "from a checkout) or unset the override.")
    return f"No hal backend of that name is known ({', '.join(KNOWN_BACKENDS)} are this project's); check the name."


def plugin_problems(rt: Runtime) -> str:
    lines = [f"\n  {lp.name}: {lp.error}" for lp in rt.failed_plugins()]
    lines += [f"\n  {lp.name}: disabled by HAL_DISABLE_PLUGINS" for lp in rt.plugins if lp.disabled]
    return ("\nplugins not loaded:" + "".join(lines)) if lines else ""
