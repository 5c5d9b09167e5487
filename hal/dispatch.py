"""The dispatcher: from an op call to its route and kernel, decided once per input signature.

A call's cache key holds, for every argument, what can change the decision: for arrays their type,
dtype, device, shape, strides and requires_grad (and, for NumPy arrays an op writes, whether they
are writeable); for other values their type and value; plus the ``hal.use`` scope and grad mode. On
a hit the call is a dictionary lookup followed by the cached plan. On a miss :meth:`Dispatcher.plan`
validates the arguments (generic checks from the schema, then the op's checker), decides the route
(:mod:`hal.decision`) and the kernel, builds the plan and caches it:

1. the device decides the backends: the highest-priority available backend serving it, unless
   ``HAL_BACKEND`` / ``hal.use(backend=)`` forces one;
2. in that backend, the highest-priority kernel whose ``not_supported_reasons`` is empty, unless a
   kernel is forced (``HAL_KERNEL_<OP>`` / ``hal.use(kernel=)``); inputs with a zero-size dimension
   are answered by the op's ``empty`` rule instead;
3. failing that, a fallback: the op's composite decomposition, then lower-priority backends of the
   same device, then a CPU backend through host copies. A fallback is counted in ``hal.stats()``,
   logged once per (op, kernel) at WARNING, and raises instead in strict mode;
4. the route: a call of a trainable op that needs autograd runs the op's training decomposition
   where it declares one, else the chosen kernel inside an autograd node (installed by the torch
   integration, :mod:`hal.autograd`, through :data:`HOOKS`: this module does not import it), or,
   for a kernel registered ``differentiable`` (torch's own ops), the kernel itself with grad
   recording on, so that torch's autograd records its backward.

:meth:`Dispatcher.explain` runs the same decision without running anything; a decomposition is
followed op by op with results of the right shape from the ops' fake rules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import linecache
import logging
import operator
import os
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from hal import arrays, config, registry
from hal.config import Choice, Overrides, choice_for, env_flag
from hal.decision import FALLBACK_WORDS, TORCH_RECORDS, UNTRACEABLE, Candidate, Decision
from hal.errors import BackendUnavailableError, HalError, InvalidArgumentError, UnsupportedError
from hal.gradients import gradients_of
from hal.plugin import Inputs, KernelSpec
from hal.registry import OPS, OpDecl, Param, get_op
from hal.runtime import BackendState, Runtime
from hal.types import ARRAY_KINDS, Kind
from hal.version import __version__

log = logging.getLogger("hal")

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_ndarray = np.ndarray
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_increment_version = torch._C._increment_version
_local = config._local

#: Decisions kept at most; the cache is cleared when it grows past this (a key per input signature).
MAX_CACHE_ENTRIES = 8192

#: The backends of this project, which ``pip install hal-backend-<name>`` installs.
KNOWN_BACKENDS = ("cpu_ref", "cpu", "cuda", "rocm")
#: which distribution serves a device kind when none is installed.
DEVICE_DISTRIBUTIONS = {"cpu": "hal-backend-cpu", "cuda": "hal-backend-cuda", "rocm": "hal-backend-rocm"}


class Hooks:
    """What the torch integration plugs into the route (set by :mod:`hal.autograd` and
    :mod:`hal.torch_library` when ``import hal`` loads them)."""

    #: ``autograd(decl, run) -> apply``, where ``apply(*canonical_args) -> result`` runs the kernel
    #: runner ``run`` as the forward of an autograd node whose backward runs the op's backward op.
    autograd: Optional[Callable[[OpDecl, Callable[..., Any]], Callable[..., Any]]] = None
    #: ``traced(decl, args) -> result``: the call under torch.compile (a ``torch.ops.hal`` node).
    traced: Optional[Callable[[OpDecl, tuple], Any]] = None


HOOKS = Hooks()


# --- cache keys -------------------------------------------------------------------------------


def _tensor_key(a: torch.Tensor) -> Any:
    return (a.dtype, a.device, a.shape, a.stride(), a.requires_grad)


def _ndarray_key(a: np.ndarray) -> Any:
    return (a.dtype, a.shape, a.strides)


_TENSOR_TYPES = frozenset((_Tensor, _Parameter))
_TENSOR_FIELDS = operator.attrgetter("dtype", "device", "shape", "requires_grad")
_STRIDES = operator.methodcaller("stride")


def _sequence_key(a: Any) -> Any:
    if a and set(map(type, a)) <= _TENSOR_TYPES:
        # lists of plain tensors (the multi-tensor ops, hundreds of tensors a call): the fields of
        # _tensor_key gathered by C-level maps, without a Python frame per tensor
        return (type(a), tuple(map(_TENSOR_FIELDS, a)), tuple(map(_STRIDES, a)))
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


def _written_key(a: Any) -> Any:
    """The key of an argument an op writes: NumPy arrays also by whether they are writeable (so a
    read-only array is refused before anything is written, never half way)."""
    if isinstance(a, (list, tuple)):
        if a and set(map(type, a)) <= _TENSOR_TYPES:
            return _sequence_key(a)
        return (type(a), tuple(map(_written_key, a)))
    if type(a) is _ndarray:
        return (a.dtype, a.shape, a.strides, a.flags.writeable)
    return _argkey(a)


#: A cached decision: (count one call, run the call's positional arguments).
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


def _check_array(decl: OpDecl, name: str, a: Any) -> None:
    """An array hal can hand to kernels: a strided, non-nested torch tensor or a NumPy array."""
    if isinstance(a, _Tensor) and (a.is_nested or a.layout != torch.strided):
        what = "a nested tensor" if a.is_nested else f"a tensor of layout {a.layout}"
        raise InvalidArgumentError(
            decl.name, name, "a dense (strided) torch.Tensor or numpy.ndarray", f"{what}; convert it with .to_dense() first"
        )


def _check_written(decl: OpDecl, name: str, a: Any, grad: bool) -> None:
    """An array an op writes in place: writeable, without internal overlap, and (with grad mode on)
    not requiring grad, as torch's own in-place ops demand."""
    if isinstance(a, _ndarray):
        if not a.flags.writeable:
            raise InvalidArgumentError(decl.name, name, "a writeable array (the op updates it in place)", f"a read-only {arrays.describe(a)}")
        if 0 in a.strides and a.size > 1:
            raise InvalidArgumentError(decl.name, name, "an array without repeated elements (it is written in place)", f"a broadcast view {arrays.describe(a)}")
        return
    if grad and a.requires_grad:
        raise InvalidArgumentError(
            decl.name, name,
            "a tensor that does not require grad while grad mode is on (hal's in-place ops are not differentiable); "
            "call it under torch.no_grad() or on .detach()ed tensors",
            arrays.describe(a) + " requiring grad",
        )
    if torch._debug_has_internal_overlap(a) == 1:
        raise InvalidArgumentError(decl.name, name, "a tensor without overlapping elements (it is written in place)", f"an expanded view {arrays.describe(a)}")


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
    for name, a in found:
        _check_array(decl, name, a)
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


def _written(decl: OpDecl, args: Sequence[Any]) -> list[tuple[str, Any]]:
    """The arrays a call writes, by argument name (given its canonical arguments)."""
    if not decl.writes(decl.bind(args)):
        return []
    out = []
    for name in decl.mutates:
        a = args[decl.index(name)]
        if isinstance(a, (list, tuple)):
            out += [(f"{name}[{i}]", x) for i, x in enumerate(a) if arrays.is_array(x)]
        elif arrays.is_array(a):
            out.append((name, a))
    return out


def _differentiates_more(decl: OpDecl, args: Sequence[Any]) -> bool:
    """Whether an input the op gives no gradient (rotary's cos and sin, an attention mask) requires
    grad: torch's autograd, recording the kernel, would differentiate it where the op says None."""
    given = decl.gradients
    return any(
        isinstance(a, torch.Tensor) and a.requires_grad for p, a in zip(decl.params, args) if p.name not in given
    )


def _made_of_torch_ops(k: KernelSpec, api: str, mode: str, inputs: Inputs) -> bool:
    """Whether kernel ``k`` runs as torch's differentiable ops for these inputs: what torch's
    autograd may record eagerly and a torch.compile graph may take in. Asked only for the kernel
    chosen, or for each candidate while a graph looks for such a kernel: a kernel's check may
    assume the inputs are ones it supports."""
    return mode == "native" and api == "torch" and not k.torch_autograd_reasons(inputs)


_PLAIN = (int, float, str, bool, type(None))


def _already_canonical(given: Any, canonical: Any) -> bool:
    """Whether a static argument as given is its canonical value already (same types, equal
    values): then a plan needs no substitution for it. A plan serves calls of one cache key, which
    holds a static argument's value and types, so what holds for this call holds for all of them
    (``softmax(x, 1)``: dim stays; ``conv2d(..., stride=1)``: 1 still becomes (1, 1))."""
    if type(given) is not type(canonical):
        return False
    if type(given) is tuple:
        return len(given) == len(canonical) and all(_already_canonical(g, c) for g, c in zip(given, canonical))
    return type(given) in _PLAIN and given == canonical


def _has_zero_size(decl: OpDecl, args: Sequence[Any]) -> bool:
    """Whether an array argument has a zero-size dimension (the op's ``empty`` rule answers)."""
    for p, a in zip(decl.params, args):
        if p.kind not in ARRAY_KINDS:
            continue
        items = a if isinstance(a, (list, tuple)) else (a,)
        for x in items:
            if arrays.is_array(x) and x.ndim and 0 in tuple(x.shape):
                return True
    return False


def needs_autograd(args: Sequence[Any]) -> bool:
    """Whether grad mode is on and an array argument requires grad."""
    if not torch.is_grad_enabled():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) and x.requires_grad for x in a):
            return True
    return False


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


def map_outputs(out: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every array of a result (tuples and lists too)."""
    if isinstance(out, (tuple, list)):
        return type(out)(map_outputs(o, fn) for o in out)
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
                return out if type(out) is np.ndarray else map_outputs(out, _as_0d)

            return run_numpy
        return fn
    if kernel_api == "numpy":  # torch CPU tensors into a NumPy kernel: zero-copy views

        def run(*args: Any) -> Any:
            conv = _map_arrays(decl, args, arrays.to_numpy)
            out = fn(*conv)
            _copy_back(decl, args, conv, _torch_into)
            return map_outputs(out, arrays.from_numpy)

        return run

    def run_torch(*args: Any) -> Any:  # NumPy arrays into a torch kernel
        conv = _map_arrays(decl, args, arrays.from_numpy)
        out = fn(*conv)
        _copy_back(decl, args, conv, _numpy_into)
        return map_outputs(out, arrays.to_numpy)

    return run_torch


def via_host(decl: OpDecl, fn: Callable[..., Any], device: Any) -> Callable[..., Any]:
    """Run a CPU kernel on device tensors: copy in, run, copy results and mutated arguments back."""

    def run(*args: Any) -> Any:
        conv = _map_arrays(decl, args, lambda t: t.detach().cpu())
        out = fn(*conv)
        _copy_back(decl, args, conv, lambda d, s: d.copy_(s))
        return map_outputs(out, lambda t: t.to(device))

    return run


def _as_torch(value: Any) -> Any:
    return arrays.from_numpy(value) if isinstance(value, (np.ndarray, np.generic)) else value


def fake_results(decl: OpDecl, args: Sequence[Any], array_type: str) -> Any:
    """Results of the right shape, dtype and device from the op's fake rule, nothing computed."""
    if decl.fake is None:
        raise UnsupportedError(f"{decl.name} declares no fake rule: hal.explain cannot follow a decomposition through it")
    named = decl.bind(_map_arrays(decl, args, _as_torch) if array_type == "numpy" else args)
    out = decl.fake(named)
    return map_outputs(out, lambda t: t.numpy()) if array_type == "numpy" else out


# --- the dispatcher ------------------------------------------------------------------------------


def _no_decision_on_fakes(decl: OpDecl, exc: Exception) -> None:
    log.debug("hal: %s under torch.compile: no decision on fake tensors (%s: %s)", decl.name, type(exc).__name__, exc)


_HAL_TAG = "|hal:"


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


class Dispatcher:
    """Chooses and runs kernels; one per process (``hal.dispatch.DISPATCHER``)."""

    def __init__(self) -> None:
        self._runtime: Optional[Runtime] = None
        self._cache: dict[Any, Plan] = {}
        self._lock = threading.RLock()
        self._counters: dict[tuple[str, str, str], _Counter] = {}
        self._warned: set[tuple[str, str, str]] = set()
        self._explaining = threading.local()
        #: bumped whenever cached plans are dropped (install, reset, reset_stats): a plan held by a
        #: caller (:func:`bind`) is stale once it moves.
        self.generation = 0

    # --- state ------------------------------------------------------------------------------

    def runtime(self) -> Runtime:
        """The loaded plugins, discovered on first use."""
        rt = self._runtime
        if rt is None:
            with self._lock:
                if self._runtime is None:
                    self._runtime = Runtime.discover()
                    tag_compile_caches(self._runtime)
                rt = self._runtime
        return rt

    def install(self, runtime: Optional[Runtime]) -> Optional[Runtime]:
        """Use ``runtime`` (None: rediscover on next use); returns the previous one. Clears caches."""
        with self._lock:
            previous, self._runtime = self._runtime, runtime
            self._cache.clear()
            self._warned.clear()
            self.generation += 1
            if runtime is not None:
                tag_compile_caches(runtime)
            return previous

    def reset(self) -> None:
        """Forget cached decisions (after changing HAL_* variables in a running process)."""
        with self._lock:
            self._cache.clear()
            self._warned.clear()
            self.generation += 1
            if self._runtime is not None:
                tag_compile_caches(self._runtime)

    def stats(self) -> dict[tuple[str, str, str], dict[str, int]]:
        return {k: c.snapshot() for k, c in list(self._counters.items())}

    def reset_stats(self) -> None:
        with self._lock:
            self._counters.clear()
            self._cache.clear()  # cached plans hold the old counters: rebuild them with new ones
            self.generation += 1

    def _counter(self, op: str, backend: str, kernel: str) -> _Counter:
        with self._lock:
            return self._counters.setdefault((op, backend, kernel), _Counter())

    # --- validation ---------------------------------------------------------------------------

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
                if not _already_canonical(args[i], value):
                    subs.append((i, value))
        if decl.mutates:
            grad = _grad_enabled()
            for name, a in _written(decl, canon):
                _check_written(decl, name, a, grad)
        unbatched = None
        if decl.unbatched is not None:
            name, rank = decl.unbatched
            i = decl.index(name)
            if canon[i].ndim == rank:
                unbatched = i
                canon[i] = canon[i][None]
        inputs = Inputs(decl, tuple(canon), kind, device, dtype, array_type)
        return inputs, subs, unbatched

    # --- the route ----------------------------------------------------------------------------

    def decide_route(self, decl: OpDecl, inputs: Inputs, args: Sequence[Any], choice: Choice) -> tuple[Decision, Optional[Callable[..., Any]]]:
        """The whole decision of a validated call: its route, backend and kernel (errors go in the
        Decision). Returns the decision and the callable of the chosen kernel or decomposition."""
        named = decl.bind(inputs.args)
        if decl.trainable and needs_autograd(args):
            kernel_forced = choice.kernel_required and choice.kernel not in (None, "composite")
            composite = None if kernel_forced else decl.training_composite(named)
            if composite is not None:
                # the backend's own kernel first: one made of torch's ops, recorded by torch's autograd,
                # computes what the decomposition's steps would (the same torch kernels, the same
                # saved tensors) with one entry into hal instead of one per step
                decision, target = self.decide(decl, inputs, choice)
                if decision.autograd_by == "torch" and decision.error is None and not decision.fallback:
                    decision.route, decision.route_reason = "autograd", TORCH_RECORDS + " (in place of the op's training decomposition)"
                    decision.traceable = True
                    return decision, target
                decision = self._decision(decl, inputs, choice)
                plan = self._backend_order(decl, inputs, choice, self.runtime(), decision)
                if plan is not None:
                    decision.backend, decision.kernel = plan[0][0].name, "composite"
                    decision.candidates.append(Candidate(plan[0][0].name, "composite", [], chosen=True, note="training decomposition"))
                decision.route, decision.route_reason = "decomposition", "inputs require grad: the op's training decomposition"
                return decision, composite
            decision, target = self.decide(decl, inputs, choice)
            if decision.kernel == "composite":
                decision.route, decision.route_reason = "decomposition", "no kernel runs these inputs; the composite's ops each take autograd"
            elif decision.autograd_by == "torch":
                decision.route, decision.route_reason = "autograd", TORCH_RECORDS
                decision.traceable = True
            else:
                decision.route, decision.route_reason = "autograd", "inputs require grad: the kernel runs inside an autograd node"
                decision.autograd_by = "hal"
            return decision, target
        decision, target = self.decide(decl, inputs, choice)
        decision.traceable = decision.autograd_by == "torch"
        decision.autograd_by = None  # no autograd: the kernel route
        if decision.kernel == "composite":
            decision.route, decision.route_reason = "decomposition", FALLBACK_WORDS["composite"]
        return decision, target

    def _decision(self, decl: OpDecl, inputs: Inputs, choice: Choice) -> Decision:
        decision = Decision(
            op=decl.name,
            inputs=_describe_inputs(decl, inputs),
            device=str(inputs.device) if inputs.array_type == "torch" else "cpu (numpy)",
            strict=choice.strict,
            device_bound=choice.device_bound,
        )
        if choice.backend:
            decision.forced.append(f"backend {choice.backend} ({choice.backend_source})")
        if choice.kernel:
            decision.forced.append(f"kernel {choice.kernel} ({choice.kernel_source})")
        return decision

    def decide(self, decl: OpDecl, inputs: Inputs, choice: Choice) -> tuple[Decision, Optional[Callable[..., Any]]]:
        """Choose a backend and kernel for validated inputs; never raises (errors go in the Decision)."""
        rt = self.runtime()
        decision = self._decision(decl, inputs, choice)
        plan = self._backend_order(decl, inputs, choice, rt, decision)
        if plan is None:
            return decision, None
        for position, (state, mode) in enumerate(plan):
            target = self._try_backend(decl, inputs, choice, state, mode, position, decision)
            if decision.error is not None or target is not None:
                if target is not None and decision.kernel != "composite" and decl.empty is not None and _has_zero_size(decl, inputs.args):
                    decision.autograd_by = None  # the op's empty rule runs, not the kernel's torch ops
                    return decision, self._empty_instead(decl, decision)
                return decision, target
        decision.error = UnsupportedError(self._no_kernel_message(decl, decision, rt))
        return decision, None

    @staticmethod
    def _empty_instead(decl: OpDecl, decision: Decision) -> Callable[..., Any]:
        """Inputs with a zero-size dimension: the op's empty rule answers in place of the kernel
        chosen for them (the same choice, errors and forcing as other inputs; kernels never see
        zero-size arrays)."""
        chosen = decision.chosen
        if chosen is not None:
            chosen.chosen = False
        decision.candidates.append(Candidate(decision.backend or "", "empty", [], chosen=True,
                                             note=f"a zero-size dimension: the op's empty rule instead of {decision.kernel}"))
        decision.kernel = "empty"
        return _empty_runner(decl)

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
                    f"backends: {', '.join(sorted(rt.backends)) or 'none'}. {_install_hint(choice.backend)}"
                    f"{_plugin_problems(rt)}"
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
            disabled = [lp.name for lp in rt.plugins if lp.disabled]
            hint = DEVICE_DISTRIBUTIONS.get(kind)
            install = f"Install one (pip install {hint}) or move" if hint else "Move"
            off = f" ({', '.join(disabled)} disabled by HAL_DISABLE_PLUGINS)" if disabled else ""
            decision.error = BackendUnavailableError(
                f"no usable backend for {kind} inputs ({decision.device}); backends for {kind}: {names}{off}. "
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
        kernels = self.runtime().kernels(decl.name, state.name, choice.device_bound)
        names = [k.name for k in kernels]
        composite = decl.fallback_composite
        wants_composite = choice.kernel == "composite" and (composite is not None or choice.kernel_required)
        forced = choice.kernel if (choice.kernel in names or wants_composite) else None
        if choice.kernel and forced is None and choice.kernel_required:
            decision.error = UnsupportedError(
                f"{choice.kernel_source} forces kernel {choice.kernel!r} for {decl.name}, but backend "
                f"{state.name} has no such kernel; its kernels: {', '.join(names + (['composite'] if composite else []))}"
            )
            return None
        note = "host fallback" if mode == "host" else ""
        if not kernels:
            decision.candidates.append(Candidate(state.name, "*", [f"no kernel of {decl.name} registered"], note=note))
        if mode == "host":
            k_inputs = Inputs(decl, inputs.args, "cpu", torch.device("cpu"), inputs.dtype, "torch", None)
        else:
            k_inputs = Inputs(decl, inputs.args, inputs.device_kind, inputs.device, inputs.dtype, inputs.array_type, _arch(state, inputs.device))
        views: dict[str, Inputs] = {}
        for k in kernels:
            if forced is not None and k.name != forced:
                continue
            api = k.array_api or state.info.array_api
            if choice.traceable_only and not _made_of_torch_ops(k, api, mode, k_inputs):
                decision.candidates.append(Candidate(state.name, k.name, [UNTRACEABLE], note=note))
                continue
            reasons = _reasons(k, _inputs_as(k_inputs, api, views))
            cand = Candidate(state.name, k.name, reasons, note=note or ("forced" if forced else ""))
            decision.candidates.append(cand)
            if reasons:
                continue
            cand.chosen = True
            if choice.torch_autograd and not _differentiates_more(decl, inputs.args) and _made_of_torch_ops(k, api, mode, k_inputs):
                decision.autograd_by = "torch"
            fallback = None if (position == 0 or forced) else ("host" if mode == "host" else "backend")
            return self._choose(decl, decision, state, k.name, fallback, self._kernel_fn(decl, k, state, inputs, mode))
        if forced is not None and forced != "composite":
            decision.error = UnsupportedError(
                f"{decl.name}: the forced kernel {state.name}/{forced} ({choice.kernel_source}) cannot run these "
                f"inputs:{_candidate_lines(decision)}\ninputs:\n  " + "\n  ".join(decision.inputs)
            )
            return None
        if composite is None:
            if forced == "composite":
                decision.error = UnsupportedError(f"{decl.name} has no composite decomposition to force ({choice.kernel_source})")
            return None
        cand = Candidate(state.name, "composite", [], chosen=True, note="forced" if forced else "decomposition into other ops")
        decision.candidates.append(cand)
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

    def traced_alternative(
        self, decl: OpDecl, inputs: Inputs, args: Sequence[Any], choice: Choice, decision: Optional[Decision]
    ) -> Optional[tuple[Decision, Callable[..., Any]]]:
        """A torch.compile graph's second decision for a call whose eager ``decision`` is an opaque
        kernel (None: the eager decision could not be made on fake tensors). A graph runs the ops of
        a kernel made of torch's ops as its own code (Inductor fuses them with their neighbours),
        any other kernel as an opaque node that Inductor cannot fuse and that costs a Python call per
        run. So, unless HAL_COMPILE_PREFER_TORCH=0, the best kernel made of torch's ops that can run
        the inputs; None where none can (the opaque node stays). Not the op's composite: where a
        kernel exists for what its composite cannot do (``linear_cross_entropy`` without the whole
        logits in memory), the composite would undo it; a backend that wants its fused op
        decomposed inside graphs registers a kernel of torch's ops for it, below its others."""
        if decision is not None and (decision.error is not None or decision.traceable or decision.route == "decomposition"):
            return None
        if not choice.torch_autograd or not env_flag("HAL_COMPILE_PREFER_TORCH", True):
            return None
        second, fn = self.decide_route(decl, inputs, args, dataclasses.replace(choice, traceable_only=True))
        if second.error is not None or fn is None or not second.traceable:
            return None
        instead = f"in place of the opaque {decision.backend}/{decision.kernel}" if decision is not None else "the first kernel made of torch's ops"
        second.route_reason = f"under torch.compile, {instead}: its ops join the graph"
        return second, fn

    def decide_traced(self, decl: OpDecl, inputs: Inputs, args: Sequence[Any], choice: Choice) -> tuple[Optional[Decision], Optional[Callable[..., Any]]]:
        """The decision of a call as AOTAutograd traces it (fake tensors): the eager decision, or
        :meth:`traced_alternative` in its place. A capability check that reads data (a NumPy view,
        an address) cannot run on fake tensors: then only the kernels made of torch's ops are
        considered, and (None, None) says that the call stays an opaque node, which decides on real
        tensors when the graph runs."""
        try:
            decision, target = self.decide_route(decl, inputs, args, choice)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            _no_decision_on_fakes(decl, exc)
            decision = target = None
        try:
            alternative = self.traced_alternative(decl, inputs, args, choice, decision)
        except Exception as exc:  # noqa: BLE001 - as above
            _no_decision_on_fakes(decl, exc)
            alternative = None
        return alternative if alternative is not None else (decision, target)

    # --- plans --------------------------------------------------------------------------------

    def plan(self, decl: OpDecl, args: tuple, key: Any) -> Plan:
        """Validate a call, decide its route, build its plan and cache it under ``key`` (None: do
        not cache). Called by the public functions on a cache miss."""
        config.check_environment()
        overrides = config.current()
        if overrides is not None and overrides.explaining:
            plan = self._explain_plan(decl, args)
        else:
            inputs, subs, unbatched = self.prepare(decl, args)
            decision, target = self.decide_route(decl, inputs, args, choice_for(decl.name, overrides))
            if decision.error is not None:
                raise decision.error
            assert target is not None and decision.backend is not None and decision.kernel is not None
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
        """The cached plan of a decision: (count the call, run the call's arguments)."""
        counter = self._counter(decl.name, decision.backend or "", decision.kernel or "")
        count_call = counter.calls.__next__
        count_fallback = None
        if decision.fallback:
            self._warn_fallback(decl, decision)
            count_fallback = counter.fallbacks.__next__
        checks = [(decl.index(name), name, check) for name, check in decl.volatile.items()]
        if decision.route == "decomposition":
            run = _canonical(decl.name, target, subs, checks)
            if count_fallback is None:
                return count_call, run

            def run_fallback(*args: Any) -> Any:
                count_fallback()
                return run(*args)

            return count_call, run_fallback
        recorded = decision.route == "autograd" and decision.autograd_by == "torch"
        fn = _writing(decl, target, recorded) if (decl.mutates and inputs.array_type == "torch") else target
        if decl.values is not None and inputs.device_kind == "cpu":
            fn = _validating(decl, fn)
        if unbatched is not None:
            fn = _rebatching(fn, unbatched)
        count = count_call if count_fallback is None else _both(count_call, count_fallback)
        run = fn
        if decision.route == "autograd" and not recorded:
            autograd = HOOKS.autograd
            if autograd is None:
                raise RuntimeError("hal's torch integration is not loaded (import hal, not hal.dispatch alone)")
            run = autograd(decl, fn)
        if not checks:
            return count, _canonical(decl.name, run, subs, ())

        def run_checked(*args: Any) -> Any:
            a = list(args)
            for i, v in subs:
                a[i] = v
            for i, name, check in checks:
                a[i] = check(decl.name, name, a[i])
            count()  # after the checks: a call they refuse ran no kernel
            return run(*a)

        return _NO_COUNT, run_checked

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

    # --- explain ------------------------------------------------------------------------------

    def explain(self, decl: OpDecl, args: Sequence[Any]) -> Decision:
        """The decision for a call, without running it or caching it: the route, and the decisions
        of a decomposition's ops or of the backward op an autograd node would run."""
        args = tuple(args)
        inputs, _, _ = self.prepare(decl, args)
        scope = config.current()
        choice = choice_for(decl.name, scope)
        decision, target = self.decide_route(decl, inputs, args, choice)
        if decision.error is not None:
            return decision
        if decision.route == "decomposition" and target is not None:
            decision.steps = self._follow(target, inputs.args)
        elif decision.route == "autograd":
            decision.backward = self._backward_decision(decl, inputs, args)
        # compiled calls inside a hal.use scope stay opaque nodes
        alternative = None if scope is not None and scope.forces else self.traced_alternative(decl, inputs, args, choice, decision)
        if alternative is not None:
            decision.compiled = alternative[0]
        return decision

    def _follow(self, composite: Callable[..., Any], canon: tuple) -> list[Decision]:
        """The decisions of the ops a decomposition calls, in order (nothing runs)."""
        outer = config.current() or Overrides()
        saved = config.enter(dataclasses.replace(outer, explaining=True))
        recorder: list[Decision] = []
        previous = getattr(self._explaining, "steps", None)
        self._explaining.steps = recorder
        try:
            composite(*canon)
        finally:
            self._explaining.steps = previous
            config.leave(saved)
        return recorder

    def _explain_plan(self, decl: OpDecl, args: tuple) -> Plan:
        """A plan used while explain follows a decomposition: record the decision, return fake
        results (which require grad where the real ones would)."""

        def run(*a: Any) -> Any:
            outer = config.current()
            saved = config.enter(dataclasses.replace(outer, explaining=False) if outer else None)
            try:
                decision = self.explain(decl, a)
                inputs, _, _ = self.prepare(decl, a)
            finally:
                config.leave(saved)
            steps = getattr(self._explaining, "steps", None)
            if steps is not None:
                steps.append(decision)
            out = fake_results(decl, inputs.args, inputs.array_type)
            if decision.route != "kernel":
                out = map_outputs(out, lambda t: t.requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
            return out

        return _NO_COUNT, run

    def _backward_decision(self, decl: OpDecl, inputs: Inputs, args: tuple) -> Decision:
        """The decision of the backward op for the autograd node of a forward call."""
        spec = gradients_of(decl)
        named = decl.bind(_original_batch(decl, inputs, args))
        out = fake_results(decl, tuple(named.values()), inputs.array_type)
        grad_out = out[0] if isinstance(out, tuple) else out
        asked = [named[n] for n in decl.gradients]  # the gradients autograd would ask the node for
        mask = tuple(isinstance(v, torch.Tensor) and v.requires_grad for v in asked)
        bargs, _ = spec.call(grad_out, spec.saved(named, out), mask)
        with torch.no_grad():
            return self.explain(spec.bwd, _detached(bargs))


def _original_batch(decl: OpDecl, inputs: Inputs, args: tuple) -> tuple:
    """Canonical arguments with an unbatched input as the caller gave it."""
    canon = list(inputs.args)
    if decl.unbatched is not None:
        i = decl.index(decl.unbatched[0])
        canon[i] = args[i]
    return tuple(canon)


def _detached(args: Sequence[Any]) -> tuple:
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


def _both(first: Callable[[], Any], second: Callable[[], Any]) -> Callable[[], None]:
    """One counting call that counts twice (a call and its fallback)."""

    def count() -> None:
        first()
        second()

    return count


def _canonical(op: str, fn: Callable[..., Any], subs: list[tuple[int, Any]], checks: Sequence[tuple[int, str, Any]]) -> Callable[..., Any]:
    """``fn`` called with the checker's canonical static values substituted into the arguments (and
    the volatile ones validated)."""
    if not subs and not checks:
        return fn

    def run(*args: Any) -> Any:
        a = list(args)
        for i, v in subs:
            a[i] = v
        for i, name, check in checks:
            a[i] = check(op, name, a[i])
        return fn(*a)

    return run


def _rebatching(fn: Callable[..., Any], i: int) -> Callable[..., Any]:
    """``fn`` on a batch of one for an unbatched input at slot ``i``, its result unbatched again."""

    def run(*args: Any) -> Any:
        a = list(args)
        a[i] = a[i][None]
        return fn(*a)[0]

    return run


def _validating(decl: OpDecl, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` after the op's value check (host-resident arrays: reading them costs no synchronisation)."""
    check, names = decl.values, decl.param_names
    assert check is not None

    def run(*a: Any) -> Any:
        check(dict(zip(names, a)))
        return fn(*a)

    return run


def _writing(decl: OpDecl, fn: Callable[..., Any], recorded: bool = False) -> Callable[..., Any]:
    """An in-place kernel on torch tensors: bump the version counter of every tensor it wrote
    (kernels that write through pointers or NumPy views do not), so that autograd notices a saved
    tensor that changed, as with torch's own in-place ops, and caches keyed on versions see the
    write. Running statistics (``mutates_statistics``) are written as torch's batch norm writes
    them, without a bump, and counted by :func:`hal.arrays.note_writes` instead. The kernel runs
    without grad recording, unless torch's autograd is to record it (``recorded``)."""
    slots = [decl.index(n) for n in decl.mutates]
    when = decl.index(decl.mutates_when) if decl.mutates_when else None
    mark = arrays.note_writes if decl.mutates_statistics else _increment_version

    def bump(a: Sequence[Any]) -> None:
        if when is None or a[when]:
            written = []
            for i in slots:
                v = a[i]
                if isinstance(v, (list, tuple)):
                    written.extend(v)
                elif v is not None:
                    written.append(v)
            mark(written)

    if recorded:  # marked before: a node that saves the written tensors saves them at their new version

        def run_recorded(*a: Any) -> Any:
            bump(a)
            return fn(*a)

        return run_recorded

    def run(*a: Any) -> Any:
        enabled = _grad_enabled()
        _set_grad_enabled(False)
        try:
            out = fn(*a)
        finally:
            _set_grad_enabled(enabled)
        bump(a)
        return out

    return run


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


def _install_hint(backend: str) -> str:
    if backend in KNOWN_BACKENDS:
        return (f"Install it with `pip install hal-backend-{backend.replace('_', '-')}` (or ./backends/{backend} "
                "from a checkout) or unset the override.")
    return f"No hal backend of that name is known ({', '.join(KNOWN_BACKENDS)} are this project's); check the name."


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

_is_compiling = is_compiling = torch.compiler.is_compiling

#: annotations whose values are keyed inline as (type, value) by the generated entry functions.
_SIMPLE_ANNOTATIONS = (int, float, str, bool)


def _key_source(p: Param, i: int, decl: OpDecl) -> list[str]:
    """Source lines computing ``k{i}``, parameter ``p``'s part of the cache key (as ``_argkey`` would,
    inlined for the common types: the hot path of an op call is these lines and one dict lookup)."""
    v = p.name
    if p.name in decl.volatile:
        return [f"    k{i} = _argkey({v}) if _is_array({v}) else type({v})"]
    tensor = [  # a plain tensor or a parameter (a model's weights), as _tensor_key
        f"    t{i} = type({v})",
        f"    if t{i} is _Tensor or t{i} is _Parameter:",
        f"        k{i} = ({v}.dtype, {v}.device, {v}.shape, {v}.stride(), {v}.requires_grad)",
        f"    elif {v} is None:",
        f"        k{i} = None",
    ]
    if p.name in decl.mutates:  # a written tensor keys as any tensor; a NumPy array also by its writeability
        return tensor + ["    else:", f"        k{i} = _written_key({v})"]
    if p.kind in (Kind.TENSOR, Kind.OPTIONAL_TENSOR):
        return tensor + [
            f"    elif t{i} is _ndarray:",
            f"        k{i} = ({v}.dtype, {v}.shape, {v}.strides)",
            "    else:",
            f"        k{i} = _argkey({v})",
        ]
    if p.kind in (Kind.SCALAR_OR_TENSOR, Kind.OPTIONAL_SCALAR_OR_TENSOR):  # a number keys as (type, value)
        return tensor + [
            f"    elif t{i} is float or t{i} is int:",
            f"        k{i} = (t{i}, {v})",
            f"    elif t{i} is _ndarray:",
            f"        k{i} = ({v}.dtype, {v}.shape, {v}.strides)",
            "    else:",
            f"        k{i} = _argkey({v})",
        ]
    if p.kind is Kind.STATIC and p.annotation in _SIMPLE_ANNOTATIONS:
        return [f"    k{i} = (type({v}), {v})"]
    if p.kind is Kind.STATIC:  # tuples of numbers (stride, padding, dims): the values and their types; or one int
        return [
            f"    t{i} = type({v})",
            f"    if t{i} is tuple:",
            f"        k{i} = ({v}, *map(type, {v}))",
            f"    elif t{i} is int:",
            f"        k{i} = (int, {v})",
            "    else:",
            f"        k{i} = _argkey({v})",
        ]
    return [f"    k{i} = _argkey({v})"]


def make_entry(decl: OpDecl, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Build ``hal.ops.<name>``: a function with the declaration's exact signature that dispatches.

    Why generated: the function is the hot path of every op call, and generating it from the
    declaration lets Python itself bind the arguments and computes the cache key inline (no
    ``inspect.Signature.bind``, no per-argument function calls). On a cache hit a call costs the
    key, one dictionary lookup and the cached plan. Its source is registered with ``linecache`` so
    tracebacks show it. Under ``torch.compile`` the call becomes a ``torch.ops.hal.<name>`` node.
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
    key_lines = [line for i, p in enumerate(decl.params) for line in _key_source(p, i, decl)]
    keys = "".join(f", k{i}" for i in range(len(decl.params)))
    doc = f'    """hal.ops.{decl.name}, generated from its declaration by hal.dispatch.make_entry."""'
    src = "\n".join(
        [
            f"def {decl.name}({', '.join(params)}):",
            doc,
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
    filename = f"<hal.ops.{decl.name}>"
    namespace: dict[str, Any] = {
        "_plan": DISPATCHER.plan,
        "_cache_get": DISPATCHER._cache.get,
        "_decl": decl,
        "_is_compiling": _is_compiling,
        "_traced": _traced_call,
        "_local": _local,
        "_scopes": config.ACTIVE_SCOPES,
        "_grad_enabled": _grad_enabled,
        "_Tensor": _Tensor,
        "_Parameter": _Parameter,
        "_ndarray": _ndarray,
        "_argkey": _argkey,
        "_written_key": _written_key,
        "_is_array": arrays.is_array,
        **defaults,
    }
    exec(compile(src, filename, "exec"), namespace)
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    entry = namespace[decl.name]
    entry.__doc__ = fn.__doc__
    entry.__module__ = "hal.ops"
    entry.__qualname__ = decl.name
    entry.__signature__ = sig
    entry.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    entry.__hal_source__ = src
    return entry


registry.set_entry_factory(make_entry)


def _traced_call(decl: OpDecl, args: tuple) -> Any:
    """Under torch.compile: the torch integration's graph node(s) for the call."""
    traced = HOOKS.traced
    if traced is None:
        raise RuntimeError("hal's torch integration is not loaded (import hal, not hal.dispatch alone)")
    return traced(decl, args)


def traced_kernel(decl: OpDecl, args: tuple) -> Optional[Callable[[], Any]]:
    """Under torch.compile, as AOTAutograd traces a call (on fake tensors): the call of the kernel
    the dispatcher chooses for these arguments when that kernel is made of torch's ops
    (:attr:`hal.decision.Decision.traceable`), so that its ops join the compiled graph, where
    Inductor compiles them with the code around them and AOTAutograd derives their backward; the
    call of the op's decomposition where that is the route (its ops decided in turn); None where
    the call stays one opaque ``torch.ops.hal`` node (any other kernel, an error, which the node's
    fake kernel raises as in eager, and ops whose argument values are checked on every call).
    Nothing is counted: the graph runs the ops, not hal."""
    if decl.values is not None:
        return None
    config.check_environment()
    try:
        inputs, subs, unbatched = DISPATCHER.prepare(decl, args)
    except HalError:
        return None  # the opaque node's fake kernel raises it, as an eager call would
    decision, target = DISPATCHER.decide_traced(decl, inputs, args, choice_for(decl.name, config.current()))
    if decision is None or decision.error is not None or target is None:
        return None
    composite = decision.route == "decomposition"  # its ops are decided in turn, as in eager
    if not (decision.traceable or composite):
        return None
    checks = [(decl.index(name), name, check) for name, check in decl.volatile.items()]
    if unbatched is not None and not composite:  # a composite takes the call's own arguments
        target = _rebatching(target, unbatched)
    run = _canonical(decl.name, target, subs, checks)
    return lambda: run(*args)


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


class Bound:
    """One call's plan, held by its caller: for code repeating a call of one shape many times with
    arguments that it knows match (an optimizer's step over the lists it keeps), which then skips
    the cache key (for a multi-tensor op, a few hundred microseconds per step on a slow host).

    Call it with every parameter of the op positionally, in declaration order. The caller vouches
    that the arrays have the types, dtypes, devices, shapes and strides of the call it was bound
    with; :meth:`current` says whether the plan itself still holds (no reset or newly installed
    plugins since, the same ``hal.use`` scope and grad mode, not under torch.compile). A bound call
    counts in ``hal.stats()`` and runs exactly what ``hal.ops.<op>`` would run for such arguments."""

    __slots__ = ("_count", "_run", "_generation", "_overrides", "_grad")

    def __init__(self, plan: Plan) -> None:
        self._count, self._run = plan
        self._generation = DISPATCHER.generation
        self._overrides = _local.overrides
        self._grad = _grad_enabled()

    def current(self) -> bool:
        return (
            self._generation == DISPATCHER.generation and _local.overrides is self._overrides
            and _grad_enabled() == self._grad and not _is_compiling()
        )

    def __call__(self, *args: Any) -> Any:
        self._count()
        return self._run(*args)


def bind(op_name: str, *args: Any, **kwargs: Any) -> Bound:
    """The plan of ``hal.ops.<op_name>(*args, **kwargs)`` (validated and decided as that call would
    be), as a :class:`Bound` callable taking the op's parameters positionally."""
    decl = OPS[op_name]
    assert decl.entry is not None
    named = decl.entry.__signature__.bind(*args, **kwargs)
    named.apply_defaults()
    return Bound(DISPATCHER.plan(decl, tuple(named.arguments[p.name] for p in decl.params), None))


_SHAPE = operator.attrgetter("shape")


def layout_of(tensors: Sequence[torch.Tensor]) -> tuple:
    """The shapes and strides of a list of tensors (C-level passes): what a caller holding a plan
    for lists whose dtype and device it knows checks on each call."""
    return (tuple(map(_SHAPE, tensors)), tuple(map(_STRIDES, tensors)))


class Held:
    """A :class:`Bound` its caller keeps across calls: bound again when what the caller vouches for
    (``signature``: :func:`layout_of` its arrays, and whatever else it passes) changes, or when the
    plan itself goes stale (:meth:`Bound.current`)."""

    __slots__ = ("bound", "signature")

    def __init__(self) -> None:
        self.bound: Optional[Bound] = None
        self.signature: Any = None

    def get(self, signature: Any, bind_call: Callable[[], Bound]) -> Bound:
        bound = self.bound
        if bound is None or signature != self.signature or not bound.current():
            bound, self.signature = bind_call(), signature
            self.bound = bound
        return bound


def explain(op_name: str, *args: Any, **kwargs: Any) -> Decision:
    """The dispatch decision for ``op_name`` called with these arguments (nothing runs)."""
    if op_name not in EXPLAINERS and op_name not in OPS:
        import hal.dist  # noqa: F401  (registers the collectives' explainers: all_reduce, ...)
    explainer = EXPLAINERS.get(op_name)
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
        bound = inspect.signature(decl.entry).bind(*args, **kwargs)
    except TypeError as exc:
        raise InvalidArgumentError(op_name, "(arguments)", f"arguments matching {op_name}{decl.signature}", str(exc)) from None
    bound.apply_defaults()
    return DISPATCHER.explain(decl, tuple(bound.arguments[n] for n in decl.param_names))


#: Explainers for names that are not registry ops (hal.dist registers its collectives here).
EXPLAINERS: dict[str, Callable[..., Any]] = {}
#: Names beyond the registry's ops that ``hal.use(kernel={name: ...})`` may force, with the names
#: they accept (hal.dist registers its collectives and their algorithms here).
FORCEABLE: dict[str, Callable[[], set[str]]] = {}


def stats() -> dict[tuple[str, str, str], dict[str, int]]:
    """Calls and fallbacks per (op, backend, kernel) since start (or the last ``reset_stats``)."""
    return DISPATCHER.stats()


def reset_stats() -> None:
    DISPATCHER.reset_stats()


def list_ops() -> list[OpDecl]:
    """Every declared op (forward and backward), in declaration order."""
    return list(OPS.values())


def kernel_names(op: str) -> set[str]:
    """The names of every kernel of ``op`` on every installed backend (plus "composite" where the
    op has one), or of a collective's algorithms: what ``hal.use(kernel=...)`` may force."""
    if op not in OPS:
        if op not in FORCEABLE:
            import hal.dist  # noqa: F401  (registers the collectives' algorithms)
        return FORCEABLE[op]() if op in FORCEABLE else set()
    rt = DISPATCHER.runtime()
    names = {k.name for state in rt.backends.values() for k in rt.kernels(op, state.name)}
    decl = OPS.get(op)
    if decl is not None and decl.fallback_composite is not None:
        names.add("composite")
    return names


__all__ = ["DISPATCHER", "Dispatcher", "HOOKS", "explain", "stats", "reset_stats", "list_ops", "install", "reset", "direct",
           "needs_autograd", "map_outputs", "kernel_names"]
