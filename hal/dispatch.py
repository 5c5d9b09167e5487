"""The dispatcher: from an op call to a kernel, with the decision cached and explainable.

A call's cache key holds, for every argument, what can change the decision: for arrays their type,
dtype, device, shape, strides and requires_grad; for other values their type and value; plus the
``hal.use`` scope and grad mode. On a hit the call is a dictionary lookup followed by the cached
plan (count the call, run the kernel). On a miss the dispatcher validates the arguments (generic
type checks from the schema, then the op's checker), picks a backend and kernel, builds the plan and
caches it:

1. the device decides the backends: the highest-priority available backend serving it, unless
   ``HAL_BACKEND`` / ``hal.use(backend=)`` forces one;
2. in that backend, the highest-priority kernel whose ``not_supported_reasons`` is empty, unless a
   kernel is forced (``HAL_KERNEL_<OP>`` / ``hal.use(kernel=)``);
3. failing that, a fallback: the op's composite decomposition, then lower-priority backends of the
   same device, then a CPU backend through host copies. A fallback is counted in ``hal.stats()``,
   logged once per (op, kernel) at WARNING, and raises instead in strict mode.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from hal import arrays, config
from hal.config import Choice, choice_for
from hal.decision import FALLBACK_WORDS, Candidate, Decision
from hal.errors import BackendUnavailableError, HalError, InvalidArgumentError, UnsupportedError
from hal.plugin import Inputs, KernelSpec
from hal.registry import OPS, OpDecl, Param, attach_decorators, get_op
from hal.runtime import BackendState, Runtime
from hal.types import ARRAY_KINDS, Kind

log = logging.getLogger("hal")

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_ndarray = np.ndarray
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_local = config._local

#: Decisions kept at most; the cache is cleared when it grows past this (a key per input signature).
MAX_CACHE_ENTRIES = 8192


def _tensor_key(a: torch.Tensor) -> Any:
    return (a.dtype, a.device, a.shape, a.stride(), a.requires_grad)


def _ndarray_key(a: np.ndarray) -> Any:
    return (a.dtype, a.shape, a.strides)


def _sequence_key(a: Any) -> Any:
    return (type(a), tuple(map(_argkey, a)))


def _plain_key(a: Any) -> Any:
    return (type(a), a)  # the type too: 1, 1.0 and True are equal keys otherwise


#: keyers by exact type: one dict lookup on the hot path instead of a chain of isinstance checks.
_KEYERS: dict[type, Callable[[Any], Any]] = {
    _Tensor: _tensor_key,
    _Parameter: _tensor_key,
    _ndarray: _ndarray_key,
    list: _sequence_key,
    tuple: _sequence_key,
    int: _plain_key,
    float: _plain_key,
    str: _plain_key,
    bool: _plain_key,
    type(None): _plain_key,
}


def _argkey(a: Any) -> Any:
    """What of an argument can change a dispatch decision (hashable)."""
    keyer = _KEYERS.get(type(a))
    if keyer is not None:
        return keyer(a)
    if isinstance(a, _Tensor):  # subclasses
        return (type(a), *_tensor_key(a))
    if isinstance(a, _ndarray):
        return (type(a), *_ndarray_key(a))
    return _plain_key(a)


#: A cached decision: (count one call, run the kernel on the call's positional arguments).
Plan = tuple[Callable[[], Any], Callable[..., Any]]

#: a C-level callable doing nothing, for plans that count inside their runner (or not at all).
_NO_COUNT = ().__len__


class _Counter:
    """Thread-safe call and fallback counts of one (op, backend, kernel)."""

    __slots__ = ("calls", "fallbacks")

    def __init__(self) -> None:
        self.calls = itertools.count()
        self.fallbacks = itertools.count()

    @staticmethod
    def _value(counter: "itertools.count[int]") -> int:
        return int(repr(counter)[6:-1])  # "count(5)" -> 5; next() is atomic, reading must not advance

    def snapshot(self) -> dict[str, int]:
        return {"calls": self._value(self.calls), "fallbacks": self._value(self.fallbacks)}


# --- argument validation shared by every op ---------------------------------------------------


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _expect(decl: OpDecl, name: str, ok: bool, expected: str, value: Any) -> None:
    if not ok:
        raise InvalidArgumentError(decl.name, name, expected, arrays.describe(value))


def _validate_generic(decl: OpDecl, args: Sequence[Any]) -> tuple[str, str, Any, Optional[str]]:
    """Check argument types against the schema and that all arrays are of one kind on one device.

    Returns (array type, device kind, device, the op's dtype).
    """
    found: list[tuple[str, Any]] = []
    for p, a in zip(decl.params, args):
        k = p.kind
        if k is Kind.TENSOR:
            _expect(decl, p.name, arrays.is_array(a), "a torch.Tensor or numpy.ndarray", a)
            found.append((p.name, a))
        elif k is Kind.OPTIONAL_TENSOR:
            _expect(decl, p.name, a is None or arrays.is_array(a), "a torch.Tensor, numpy.ndarray or None", a)
            if a is not None:
                found.append((p.name, a))
        elif k in (Kind.TENSOR_LIST, Kind.OPTIONAL_TENSOR_LIST):
            if a is None and k is Kind.OPTIONAL_TENSOR_LIST:
                continue
            _expect(decl, p.name, isinstance(a, (list, tuple)), "a list or tuple of arrays", a)
            for i, item in enumerate(a):
                _expect(decl, f"{p.name}[{i}]", arrays.is_array(item), "a torch.Tensor or numpy.ndarray", item)
                found.append((f"{p.name}[{i}]", item))
        elif k in (Kind.SCALAR_OR_TENSOR, Kind.OPTIONAL_SCALAR_OR_TENSOR):
            if a is None and k is Kind.OPTIONAL_SCALAR_OR_TENSOR:
                continue
            _expect(decl, p.name, _is_number(a) or arrays.is_array(a), "a Python number or an array", a)
            if arrays.is_array(a):
                found.append((p.name, a))
    if not found:
        array_type, kind, device = "numpy", "cpu", "cpu"
    else:
        first_name, first = found[0]
        array_type = "torch" if isinstance(first, _Tensor) else "numpy"
        kind, device = arrays.device_kind(first), (first.device if array_type == "torch" else "cpu")
        for name, a in found[1:]:
            same_type = isinstance(a, _Tensor) == (array_type == "torch")
            if not same_type or (array_type == "torch" and a.device != device):
                raise InvalidArgumentError(
                    decl.name,
                    name,
                    f"of the same array type and device as '{first_name}' ({arrays.describe(first)}); "
                    "the arrays of one call are all numpy or all torch, on one device",
                    arrays.describe(a),
                )
    dtype = None
    if decl.dtype_from:
        src = args[decl.index(decl.dtype_from)]
        if isinstance(src, (list, tuple)):
            src = src[0] if src else None
        if arrays.is_array(src):
            dtype = arrays.dtype_name(src)
    return array_type, kind, device, dtype


# --- moving arguments between array types and devices -----------------------------------------


def _map_arrays(decl: OpDecl, args: Sequence[Any], fn: Callable[[Any], Any]) -> list[Any]:
    """Apply ``fn`` to every array among ``args`` (inside lists too)."""
    out = list(args)
    for i, p in enumerate(decl.params):
        if p.kind not in ARRAY_KINDS:
            continue
        a = out[i]
        if isinstance(a, (list, tuple)):
            out[i] = [fn(x) if arrays.is_array(x) else x for x in a]
        elif arrays.is_array(a):
            out[i] = fn(a)
    return out


def _map_outputs(out: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(out, (tuple, list)):
        return type(out)(_map_outputs(o, fn) for o in out)
    if isinstance(out, (np.ndarray, np.generic, torch.Tensor)):
        return fn(out)
    return out


def _copy_back(decl: OpDecl, originals: Sequence[Any], converted: Sequence[Any], copy: Callable[[Any, Any], None]) -> None:
    """After an in-place op ran on converted arrays, write mutated ones back into the caller's."""
    for name in decl.mutates:
        i = decl.index(name)
        a, b = originals[i], converted[i]
        if isinstance(a, (list, tuple)):
            for x, y in zip(a, b):
                copy(x, y)
        elif arrays.is_array(a):
            copy(a, b)


def _torch_into(dst: torch.Tensor, src: Any) -> None:
    src_t = src if isinstance(src, torch.Tensor) else arrays.from_numpy(src)
    if src_t.data_ptr() != dst.data_ptr():
        with torch.no_grad():
            dst.copy_(src_t)


def _numpy_into(dst: np.ndarray, src: Any) -> None:
    src_a = src if isinstance(src, np.ndarray) else arrays.to_numpy(src)
    if not np.shares_memory(src_a, dst):
        np.copyto(dst, src_a)


def _as_0d(x: Any) -> Any:
    return np.asarray(x) if isinstance(x, np.generic) else x


def adapt_array_api(decl: OpDecl, fn: Callable[..., Any], kernel_api: str, input_api: str) -> Callable[..., Any]:
    """Wrap a kernel so it receives the array type it takes and returns the caller's type."""
    if kernel_api == input_api:
        if kernel_api == "numpy":

            def run_numpy(*args: Any) -> Any:
                out = fn(*args)
                return out if type(out) is np.ndarray else _map_outputs(out, _as_0d)

            return run_numpy
        return fn
    if kernel_api == "numpy":  # torch CPU tensors into a NumPy kernel: zero-copy views

        def run(*args: Any) -> Any:
            conv = _map_arrays(decl, args, arrays.to_numpy)
            out = fn(*conv)
            _copy_back(decl, args, conv, _torch_into)
            return _map_outputs(out, arrays.from_numpy)

        return run

    def run_torch(*args: Any) -> Any:  # NumPy arrays into a torch kernel
        conv = _map_arrays(decl, args, arrays.from_numpy)
        out = fn(*conv)
        _copy_back(decl, args, conv, _numpy_into)
        return _map_outputs(out, arrays.to_numpy)

    return run_torch


def via_host(decl: OpDecl, fn: Callable[..., Any], device: Any) -> Callable[..., Any]:
    """Run a CPU kernel on device tensors: copy in, run, copy results and mutated arguments back."""

    def run(*args: Any) -> Any:
        conv = _map_arrays(decl, args, lambda t: t.detach().cpu())
        out = fn(*conv)
        _copy_back(decl, args, conv, lambda d, s: d.copy_(s))
        return _map_outputs(out, lambda t: t.to(device))

    return run


# --- the dispatcher ------------------------------------------------------------------------------


def _autograd_call(decl: OpDecl, args: Sequence[Any]) -> Any:
    """Eager calls with grad-requiring tensors: through torch.ops.hal.<name> and its autograd
    formula (hal.torch_library, which ``import hal`` loads; imported here to avoid a cycle)."""
    from hal import torch_library

    return torch_library.autograd_call(decl, args)


class Dispatcher:
    """Chooses and runs kernels; one per process (``hal.dispatch.DISPATCHER``)."""

    def __init__(self) -> None:
        self._runtime: Optional[Runtime] = None
        self._cache: dict[Any, Plan] = {}
        self._lock = threading.RLock()
        self._counters: dict[tuple[str, str, str], _Counter] = {}
        self._warned: set[tuple[str, str, str]] = set()
        #: runs a call that needs autograd through torch.ops.hal.* (hal.torch_library); None: never.
        self.autograd_call: Optional[Callable[[OpDecl, Sequence[Any]], Any]] = _autograd_call

    # --- state ------------------------------------------------------------------------------

    def runtime(self) -> Runtime:
        """The loaded plugins, discovered on first use."""
        rt = self._runtime
        if rt is None:
            with self._lock:
                if self._runtime is None:
                    self._runtime = Runtime.discover()
                rt = self._runtime
        return rt

    def install(self, runtime: Optional[Runtime]) -> Optional[Runtime]:
        """Use ``runtime`` (None: rediscover on next use); returns the previous one. Clears caches."""
        with self._lock:
            previous, self._runtime = self._runtime, runtime
            self._cache.clear()
            self._warned.clear()
            return previous

    def reset(self) -> None:
        """Forget cached decisions (after changing HAL_* variables in a running process)."""
        with self._lock:
            self._cache.clear()
            self._warned.clear()

    def stats(self) -> dict[tuple[str, str, str], dict[str, int]]:
        return {k: c.snapshot() for k, c in list(self._counters.items())}

    def reset_stats(self) -> None:
        with self._lock:
            self._counters.clear()
            self._cache.clear()  # cached plans hold the old counters: rebuild them with new ones

    def _counter(self, op: str, backend: str, kernel: str) -> _Counter:
        with self._lock:
            return self._counters.setdefault((op, backend, kernel), _Counter())

    # --- the hot path -----------------------------------------------------------------------

    def call(self, decl: OpDecl, args: tuple) -> Any:
        """Run ``decl`` on ``args`` (positional, complete, in schema order)."""
        try:
            keyed = _mask_volatile(decl, args) if decl.volatile else args
            key = (decl, _local.overrides, _grad_enabled(), *map(_argkey, keyed))
            plan = self._cache.get(key)
        except TypeError:  # an unhashable static argument: decide without caching
            key, plan = None, None
        if plan is None:
            plan = self._plan(decl, args, key)
        plan[0]()
        return plan[1](*args)

    def call_direct(self, decl: OpDecl, args: tuple) -> Any:
        """Run ``decl`` without routing through autograd (the body of torch.ops.hal.* kernels)."""
        try:
            keyed = _mask_volatile(decl, args) if decl.volatile else args
            key = (decl, _local.overrides, None, *map(_argkey, keyed))
            plan = self._cache.get(key)
        except TypeError:
            key, plan = None, None
        if plan is None:
            plan = self._plan(decl, args, key, direct=True)
        plan[0]()
        return plan[1](*args)

    # --- planning ---------------------------------------------------------------------------

    def prepare(self, decl: OpDecl, args: Sequence[Any]) -> tuple[Inputs, list[tuple[int, Any]], Optional[int]]:
        """Validate a call; return what kernels see (canonical arguments), the static substitutions
        and the unbatched slot. The conformance suite uses it to build canonical calls."""
        array_type, kind, device, dtype = _validate_generic(decl, args)
        canon = list(args)
        subs: list[tuple[int, Any]] = []
        if decl.check is not None:
            try:
                static = decl.check(*args)
            except HalError:
                raise
            except Exception as exc:  # a checker bug must still surface as a hal error
                raise InvalidArgumentError(decl.name, "(arguments)", "valid input", f"{type(exc).__name__}: {exc}") from exc
            for name, value in (static or {}).items():
                if name in decl.volatile:
                    continue  # validated on every call by the plan
                i = decl.index(name)
                canon[i] = value
                subs.append((i, value))
        unbatched = None
        if decl.unbatched is not None:
            name, rank = decl.unbatched
            i = decl.index(name)
            if canon[i].ndim == rank:
                unbatched = i
                canon[i] = canon[i][None]
        inputs = Inputs(decl, tuple(canon), kind, device, dtype, array_type)
        return inputs, subs, unbatched

    def _plan(self, decl: OpDecl, args: Sequence[Any], key: Any, direct: bool = False) -> Plan:
        """Validate a call, decide, build its plan and cache it under ``key`` (None: do not cache)."""
        inputs, subs, unbatched = self.prepare(decl, args)
        overrides = config.current()
        decision, target = self.decide(decl, inputs, choice_for(decl.name, overrides))
        if decision.error is not None:
            raise decision.error
        assert target is not None and decision.backend is not None and decision.kernel is not None
        if not direct and self.autograd_call is not None and decl.trainable and _needs_autograd(args):
            autograd_call = self.autograd_call
            plan: Plan = (_NO_COUNT, lambda *a: autograd_call(decl, a))  # counted by the direct call inside
        else:
            plan = self._build_plan(decl, decision, target, inputs, subs, unbatched)
        if key is not None:
            with self._lock:
                if len(self._cache) >= MAX_CACHE_ENTRIES:
                    self._cache.clear()
                self._cache[key] = plan
        return plan

    def _build_plan(
        self,
        decl: OpDecl,
        decision: Decision,
        target: Callable[..., Any],
        inputs: Inputs,
        subs: list[tuple[int, Any]],
        unbatched: Optional[int],
    ) -> Plan:
        """The cached plan of a decision: (count the call, run the kernel on the call's arguments)."""
        counter = self._counter(decl.name, decision.backend or "", decision.kernel or "")
        count_call = counter.calls.__next__
        if decision.fallback:
            self._warn_fallback(decl, decision)
            count_fallback = counter.fallbacks.__next__
        else:
            count_fallback = None
        fn = target
        if decl.mutates and inputs.array_type == "torch":
            inner = fn

            def fn(*a: Any) -> Any:  # torch.no_grad() without its Python-level context manager
                enabled = _grad_enabled()
                _set_grad_enabled(False)
                try:
                    return inner(*a)
                finally:
                    _set_grad_enabled(enabled)

        checks = [(decl.index(name), name, check) for name, check in decl.volatile.items()]
        if unbatched is None and count_fallback is None and not checks:
            if not subs:
                return count_call, fn

            def run_canonical(*args: Any) -> Any:
                a = list(args)
                for i, v in subs:
                    a[i] = v
                return fn(*a)

            return count_call, run_canonical

        def run_general(*args: Any) -> Any:
            a = list(args)
            for i, v in subs:
                a[i] = v
            for i, name, check in checks:
                a[i] = check(decl.name, name, a[i])
            count_call()
            if count_fallback is not None:
                count_fallback()
            if unbatched is None:
                return fn(*a)
            a[unbatched] = a[unbatched][None]
            return fn(*a)[0]

        return _NO_COUNT, run_general

    def _warn_fallback(self, decl: OpDecl, decision: Decision) -> None:
        key = (decl.name, decision.backend or "", decision.kernel or "")
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        rejected = [f"{c.backend}/{c.kernel}: {'; '.join(c.reasons)}" for c in decision.candidates if c.reasons]
        log.warning(
            "hal: %s fell back to %s (%s/%s) on %s; rejected: %s. Set HAL_STRICT=1 to make this an error.",
            decl.name,
            FALLBACK_WORDS[decision.fallback or "composite"],
            decision.backend,
            decision.kernel,
            decision.device,
            " | ".join(rejected) or "none",
        )

    # --- the decision -----------------------------------------------------------------------

    def decide(self, decl: OpDecl, inputs: Inputs, choice: Choice) -> tuple[Decision, Optional[Callable[..., Any]]]:
        """Choose a backend and kernel for validated inputs; never raises (errors go in the Decision)."""
        rt = self.runtime()
        decision = Decision(
            op=decl.name,
            inputs=_describe_inputs(decl, inputs),
            device=str(inputs.device) if inputs.array_type == "torch" else "cpu (numpy)",
            strict=choice.strict,
        )
        if choice.backend:
            decision.forced.append(f"backend {choice.backend} ({choice.backend_source})")
        if choice.kernel:
            decision.forced.append(f"kernel {choice.kernel} ({choice.kernel_source})")

        plan = self._backend_order(decl, inputs, choice, rt, decision)
        if plan is None:
            return decision, None
        for position, (state, mode) in enumerate(plan):
            target = self._try_backend(decl, inputs, choice, state, mode, position, decision)
            if decision.error is not None or target is not None:
                return decision, target
        decision.error = UnsupportedError(self._no_kernel_message(decl, decision, rt))
        return decision, None

    def _backend_order(
        self, decl: OpDecl, inputs: Inputs, choice: Choice, rt: Runtime, decision: Decision
    ) -> Optional[list[tuple[BackendState, str]]]:
        """The backends to try, in order, each with a mode: "native" or "host" (copies via the CPU)."""
        kind = inputs.device_kind
        if choice.backend:
            state = rt.backends.get(choice.backend)
            if state is None:
                decision.error = BackendUnavailableError(
                    f"backend {choice.backend!r} (forced by {choice.backend_source}) is not installed; installed "
                    f"backends: {', '.join(sorted(rt.backends)) or 'none'}. Install it with "
                    f"`pip install hal-backend-{choice.backend.replace('_', '-')}` (or ./backends/{choice.backend} "
                    f"from a checkout) or unset the override.{_plugin_problems(rt)}"
                )
                return None
            if not state.available:
                decision.error = BackendUnavailableError(
                    f"backend {choice.backend!r} (forced by {choice.backend_source}) is installed but not usable "
                    f"here: {state.reason}. Unset the override to let hal choose."
                )
                return None
            if kind in state.info.device_types:
                return [(state, "native")]
            if "cpu" in state.info.device_types and inputs.array_type == "torch":
                return [(state, "host")]
            decision.error = BackendUnavailableError(
                f"backend {choice.backend!r} (forced by {choice.backend_source}) serves "
                f"{', '.join(state.info.device_types)} devices; these inputs are on {decision.device}"
            )
            return None
        native = rt.backends_for(kind)
        for state in native:
            if not state.available:
                decision.candidates.append(Candidate(state.name, "*", [f"backend unavailable: {state.reason}"]))
        usable = [(s, "native") for s in native if s.available]
        if not usable:
            names = ", ".join(s.name for s in native) or "none installed"
            hint = {"cpu": "hal-backend-cpu-ref", "cuda": "hal-backend-cuda", "rocm": "hal-backend-rocm"}.get(kind)
            install = f"Install one (pip install {hint}) or move" if hint else "Move"
            decision.error = BackendUnavailableError(
                f"no usable backend for {kind} inputs ({decision.device}); backends for {kind}: {names}. "
                f"{install} the inputs to a supported device.{_candidate_lines(decision)}{_plugin_problems(rt)}"
            )
            return None
        if kind != "cpu" and inputs.array_type == "torch":
            usable += [(s, "host") for s in rt.backends_for("cpu") if s.available]
        return usable

    def _try_backend(
        self,
        decl: OpDecl,
        inputs: Inputs,
        choice: Choice,
        state: BackendState,
        mode: str,
        position: int,
        decision: Decision,
    ) -> Optional[Callable[..., Any]]:
        """Pick a kernel of one backend (or its composite) for the inputs; record every candidate."""
        kernels = self.runtime().kernels(decl.name, state.name)
        names = [k.name for k in kernels]
        forced = choice.kernel if (choice.kernel in names or choice.kernel == "composite") else None
        if choice.kernel and forced is None and choice.kernel_required:
            decision.error = UnsupportedError(
                f"{choice.kernel_source} forces kernel {choice.kernel!r} for {decl.name}, but backend "
                f"{state.name} has no such kernel; its kernels: {', '.join(names + ['composite'])}"
            )
            return None
        note = "host fallback" if mode == "host" else ""
        if not kernels:
            decision.candidates.append(Candidate(state.name, "*", [f"no kernel of {decl.name} registered"], note=note))
        if mode == "host":
            k_inputs = Inputs(decl, inputs.args, "cpu", torch.device("cpu"), inputs.dtype, "torch", None)
        else:
            arch = state.arch(inputs.device)
            k_inputs = Inputs(decl, inputs.args, inputs.device_kind, inputs.device, inputs.dtype, inputs.array_type, arch)
        views: dict[str, Inputs] = {}
        for k in kernels:
            if forced is not None and k.name != forced:
                continue
            reasons = k.not_supported_reasons(_inputs_as(k_inputs, k.array_api or state.info.array_api, views))
            cand = Candidate(state.name, k.name, reasons, note=note or ("forced" if forced else ""))
            decision.candidates.append(cand)
            if reasons:
                continue
            cand.chosen = True
            fallback = None if (position == 0 or forced) else ("host" if mode == "host" else "backend")
            return self._choose(decl, decision, state, k.name, fallback, self._kernel_fn(decl, k, state, inputs, mode))
        if forced is not None and forced != "composite":
            decision.error = UnsupportedError(
                f"{decl.name}: the forced kernel {state.name}/{forced} ({choice.kernel_source}) cannot run these "
                f"inputs:{_candidate_lines(decision)}\ninputs:\n  " + "\n  ".join(decision.inputs)
            )
            return None
        if decl.composite is None:
            if forced == "composite":
                decision.error = UnsupportedError(f"{decl.name} has no composite decomposition to force")
            return None
        cand = Candidate(state.name, "composite", [], chosen=True, note="forced" if forced else "decomposition into other ops")
        decision.candidates.append(cand)
        composite = decl.composite
        return self._choose(decl, decision, state, "composite", None if forced else "composite", composite)

    def _choose(
        self, decl: OpDecl, decision: Decision, state: BackendState, kernel: str, fallback: Optional[str], fn: Callable[..., Any]
    ) -> Optional[Callable[..., Any]]:
        decision.backend, decision.kernel, decision.fallback = state.name, kernel, fallback
        if fallback and decision.strict:
            decision.error = UnsupportedError(
                f"strict mode: {decl.name} on {decision.device} would fall back to {FALLBACK_WORDS[fallback]} "
                f"({state.name}/{kernel}) because the preferred kernels cannot run these inputs:"
                f"{_candidate_lines(decision)}\nUnset HAL_STRICT / hal.use(strict=...) to allow fallbacks."
            )
            return None
        return fn

    @staticmethod
    def _kernel_fn(decl: OpDecl, k: KernelSpec, state: BackendState, inputs: Inputs, mode: str) -> Callable[..., Any]:
        api = k.array_api or state.info.array_api
        if mode == "host":
            return via_host(decl, adapt_array_api(decl, k.fn, api, "torch"), inputs.device)
        return adapt_array_api(decl, k.fn, api, inputs.array_type)

    def _no_kernel_message(self, decl: OpDecl, decision: Decision, rt: Runtime) -> str:
        return (
            f"no kernel can run {decl.name} for these inputs on {decision.device}:\n  "
            + "\n  ".join(decision.inputs)
            + "\ncandidates:"
            + (_candidate_lines(decision) or "\n  (no backend registers a kernel for this op)")
            + _plugin_problems(rt)
        )

    # --- explain ------------------------------------------------------------------------------

    def explain(self, decl: OpDecl, args: Sequence[Any]) -> Decision:
        """The decision for a call, without running it or caching it."""
        inputs, _, _ = self.prepare(decl, args)
        decision, _ = self.decide(decl, inputs, choice_for(decl.name, config.current()))
        return decision


def _mask_volatile(decl: OpDecl, args: tuple) -> list[Any]:
    """``args`` with the values of volatile parameters replaced by their type, for the cache key."""
    keyed = list(args)
    for i, p in enumerate(decl.params):
        if p.name in decl.volatile and not arrays.is_array(keyed[i]):
            keyed[i] = type(keyed[i])
    return keyed


def _inputs_as(inputs: Inputs, api: str, views: dict[str, Inputs]) -> Inputs:
    """``inputs`` with arrays of the kernel's array type, so capability checks see what the kernel
    will receive (zero-copy views; made once per array type)."""
    if api == inputs.array_type:
        return inputs
    if api not in views:
        convert = arrays.to_numpy if api == "numpy" else arrays.from_numpy
        args = tuple(_map_arrays(inputs.op, inputs.args, convert))
        views[api] = Inputs(inputs.op, args, inputs.device_kind, inputs.device, inputs.dtype, api, inputs.arch)
    return views[api]


def _needs_autograd(args: Sequence[Any]) -> bool:
    if not torch.is_grad_enabled():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) and x.requires_grad for x in a):
            return True
    return False


def _describe_inputs(decl: OpDecl, inputs: Inputs) -> list[str]:
    lines = []
    for p, a in zip(decl.params, inputs.args):
        if p.kind in ARRAY_KINDS and (arrays.is_array(a) or isinstance(a, (list, tuple))):
            if isinstance(a, (list, tuple)) and a and arrays.is_array(a[0]):
                lines.append(f"{p.name}: {len(a)} arrays, first {arrays.describe(a[0])}")
            else:
                lines.append(f"{p.name}: {arrays.describe(a)}")
    return lines


def _candidate_lines(decision: Decision) -> str:
    out = []
    for c in decision.candidates:
        note = f" [{c.note}]" if c.note else ""
        reasons = "; ".join(c.reasons) if c.reasons else "supported"
        out.append(f"\n  {c.backend}/{c.kernel}{note}: {reasons}")
    return "".join(out)


def _plugin_problems(rt: Runtime) -> str:
    lines = [f"\n  {lp.name}: {lp.error}" for lp in rt.failed_plugins()]
    lines += [f"\n  {lp.name}: disabled by HAL_DISABLE_PLUGINS" for lp in rt.plugins if lp.disabled]
    return ("\nplugins not loaded:" + "".join(lines)) if lines else ""


DISPATCHER = Dispatcher()


def install(runtime: Optional[Runtime]) -> Optional[Runtime]:
    """Replace the loaded plugins (tests build a Runtime from plugin objects); returns the old one."""
    return DISPATCHER.install(runtime)


def reset() -> None:
    """Forget cached decisions, e.g. after changing HAL_* environment variables."""
    DISPATCHER.reset()


# --- public entry functions ---------------------------------------------------------------------

_is_compiling = torch.compiler.is_compiling

#: annotations whose values are keyed inline as (type, value) by the generated entry functions.
_SIMPLE_ANNOTATIONS = (int, float, str, bool)


def _key_source(p: Param, i: int, volatile: Mapping[str, Any]) -> list[str]:
    """Source lines computing ``k{i}``, parameter ``p``'s part of the cache key (as ``_argkey`` would,
    inlined for the common types: the hot path of an op call is these lines and one dict lookup)."""
    v = p.name
    if p.name in volatile:
        return [f"    k{i} = _argkey({v}) if _is_array({v}) else type({v})"]
    if p.kind in (Kind.TENSOR, Kind.OPTIONAL_TENSOR, Kind.SCALAR_OR_TENSOR, Kind.OPTIONAL_SCALAR_OR_TENSOR):
        return [
            f"    t{i} = type({v})",
            f"    if t{i} is _Tensor:",
            f"        k{i} = ({v}.dtype, {v}.device, {v}.shape, {v}.stride(), {v}.requires_grad)",
            f"    elif t{i} is _ndarray:",
            f"        k{i} = ({v}.dtype, {v}.shape, {v}.strides)",
            "    else:",
            f"        k{i} = _argkey({v})",
        ]
    if p.kind is Kind.STATIC and p.annotation in _SIMPLE_ANNOTATIONS:
        return [f"    k{i} = (type({v}), {v})"]
    if p.kind is Kind.STATIC:  # tuples of numbers (stride, padding, dims): the values and their types
        return [
            f"    if type({v}) is tuple:",
            f"        k{i} = ({v}, *map(type, {v}))",
            "    else:",
            f"        k{i} = _argkey({v})",
        ]
    return [f"    k{i} = _argkey({v})"]


def make_entry(decl: OpDecl, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Build ``hal.ops.<name>``: a function with the declaration's exact signature that dispatches.

    The function is generated from the declaration: Python itself binds the arguments, and the cache
    key is computed inline (no ``inspect.Signature.bind``, no per-argument function calls on the hot
    path). On a cache hit a call costs the key, one dictionary lookup and the cached plan. Under
    ``torch.compile`` the call is routed to ``torch.ops.hal.<name>`` (hal.torch_library) so that
    Dynamo sees one custom op.
    """
    sig = inspect.signature(fn)
    params, names, defaults = [], [], {}
    star = False
    for p in sig.parameters.values():
        if p.kind == p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        if p.default is p.empty:
            params.append(p.name)
        else:
            defaults[f"_d_{p.name}"] = p.default
            params.append(f"{p.name}=_d_{p.name}")
        names.append(p.name)
    arg_list = ", ".join(names)
    arg_tuple = "(" + "".join(f"{n}, " for n in names) + ")"
    key_lines = [line for i, p in enumerate(decl.params) for line in _key_source(p, i, decl.volatile)]
    keys = "".join(f", k{i}" for i in range(len(decl.params)))
    src = "\n".join(
        [
            f"def {decl.name}({', '.join(params)}):",
            "    if _is_compiling():  # under torch.compile: one torch.ops.hal.<name> node",
            f"        return _traced(_decl, {arg_tuple})",
            *key_lines,
            f"    key = (_decl, _local.overrides if _scopes[0] else None, _grad_enabled(){keys})",
            "    try:",
            "        plan = _cache_get(key)",
            "    except TypeError:  # an unhashable argument: decide without caching",
            "        key = plan = None",
            "    if plan is None:",
            f"        plan = _plan(_decl, {arg_tuple}, key)",
            "    plan[0]()",
            f"    return plan[1]({arg_list})",
            "",
        ]
    )
    namespace: dict[str, Any] = {
        "_plan": DISPATCHER._plan,
        "_cache_get": DISPATCHER._cache.get,
        "_decl": decl,
        "_is_compiling": _is_compiling,
        "_traced": _traced_call,
        "_local": _local,
        "_scopes": config.ACTIVE_SCOPES,
        "_grad_enabled": _grad_enabled,
        "_Tensor": _Tensor,
        "_ndarray": _ndarray,
        "_argkey": _argkey,
        "_is_array": arrays.is_array,
        **defaults,
    }
    exec(compile(src, f"<hal.ops.{decl.name}>", "exec"), namespace)
    entry = namespace[decl.name]
    entry.__doc__ = fn.__doc__
    entry.__module__ = "hal.ops"
    entry.__qualname__ = decl.name
    entry.__signature__ = sig
    entry.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    entry.__hal_source__ = src
    attach_decorators(entry, decl)
    return entry


def _traced_call(decl: OpDecl, args: tuple) -> Any:
    """Under torch.compile: call torch.ops.hal.<name> (registered by hal.torch_library)."""
    from hal import torch_library

    return torch_library.traced_call(decl, args)


def explain(op_name: str, *args: Any, **kwargs: Any) -> Decision:
    """The dispatch decision for ``op_name`` called with these arguments (nothing runs)."""
    if op_name not in EXPLAINERS and op_name not in OPS:
        import hal.dist  # noqa: F401  (registers the collectives' explainers: all_reduce, ...)
    explainer = EXPLAINERS.get(op_name)
    if explainer is not None:
        return explainer(*args, **kwargs)
    decl = get_op(op_name)
    assert decl.entry is not None
    bound = inspect.signature(decl.entry).bind(*args, **kwargs)
    bound.apply_defaults()
    return DISPATCHER.explain(decl, tuple(bound.arguments[n] for n in decl.param_names))


#: Explainers for names that are not registry ops (hal.dist registers its collectives here).
EXPLAINERS: dict[str, Callable[..., Any]] = {}


def stats() -> dict[tuple[str, str, str], dict[str, int]]:
    """Calls and fallbacks per (op, backend, kernel) since start (or the last ``reset_stats``)."""
    return DISPATCHER.stats()


def reset_stats() -> None:
    DISPATCHER.reset_stats()


def list_ops() -> list[OpDecl]:
    """Every declared op (forward and backward), in declaration order."""
    return list(OPS.values())
