"""Ops and kernels from your own code, in the running process: hal's ``torch.library.custom_op``.

Entry-point plugins (``pip install`` a distribution with a ``hal.backends`` entry point) are how a
vendor ships a backend; this module is how a user adds an op, a kernel or a whole backend from a
script or a notebook, without packaging anything::

    import hal, hal.library
    from hal.types import Tensor

    @hal.library.declare(dtypes=("float32", "float64"), tolerances=hal.library.ELEMENTWISE,
                         backward="cube_backward", gradients="x")
    def cube(x: Tensor) -> Tensor:
        '''x ** 3'''

    @cube.fake
    def _(a):
        return a["x"].new_empty(a["x"].shape)

    @hal.library.register_kernel("cube", backend="cpu", name="mine", priority=100)
    def cube_cpu(x):
        return x * x * x

    y = hal.ops.cube(t)                 # also torch.ops.hal.cube, autograd, torch.compile, hal.explain

What each step gives:

- :func:`declare` (``hal.registry.declare``, the decorator of hal's own ``ops/``): the op's
  declaration from a typed function, ``hal.ops.<name>``, ``torch.ops.hal.<name>`` with its fake
  kernel (``@op.fake``) and, when it names a ``backward`` op declared the same way, autograd and
  torch.compile (``fullgraph=True``) through it. ``@op.checker``, ``@op.composite``, ``@op.empty``
  and ``@op.values`` complete a declaration as in ``ops/``, before the op's first call, which
  seals it (:mod:`hal.registry`: a decorator attached later raises ``FrozenInstanceError``).
- :func:`register_kernel`: a kernel of any op (yours or hal's) on a backend that exists here, an
  installed one (``cpu``, ``cuda`` ...) or one defined with :func:`define_backend`, ranked by a
  ``priority`` or by the ``contexts`` it serves (``{"eager": 30, "compiled": 5}``, as
  :meth:`hal.plugin.Plugin.kernel`); its signature and dtypes are checked against the declaration
  at once. Decisions made before are dropped, so
  the next call decides again with the new kernel among the candidates; ``hal.explain`` lists it.
- :func:`define_backend`: a backend of this process (a device type, a priority, an availability
  probe), whose kernels are registered with :func:`register_kernel`.
- Conformance: register the op's cases with ``hal.conformance.cases.register_cases`` and run
  ``hal.conformance.runner.Suite(backend=..., ops=[...])`` in the same process; the reference is a
  ``cpu_ref`` kernel registered the same way (``register_kernel(op, backend="cpu_ref", ...)``, a
  NumPy function computing in float64).

Registrations last for the process (like ``torch.library``); a name used twice is refused. A
runtime installed by hand (``hal.dispatch.install``) gets this process's registrations only when
they are made after it. See docs/library.md.

What is checked, so that a mistake is an error rather than a wrong result: at registration, dtype
names, tolerances, parameters an op's schema cannot hold (no annotation, ``*args``), an ``array_api``
other than "torch" or "numpy", a kernel's parameters and dtypes; a ``backward`` op declared as
another op's (at the declaration), or not declared when a kernel of its forward op is registered
(it may be declared after its forward op, but before that op's kernels). At each call of a kernel registered here, that it returned arrays of its own array
type (hal converts them for the caller), and no ``None`` for an op that writes nothing in place;
on each kernel's first call, under ``HAL_DEBUG=1`` and in conformance runs (:func:`checking_results`),
every result's shape, dtype and device against the op's fake rule. A failed check raises
:class:`KernelResultError`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from hal import arrays, config, tracing
from hal.dispatch import DISPATCHER
from hal.dispatch.adapt import fake_results
from hal.errors import HalError, InvalidArgumentError, PluginError
from hal.ops import _tolerances as _presets
from hal.plugin import CONTEXTS, Archs, DeviceInfo, Inputs, Plugin, Reasons, Routing
from hal.integration.schema import codec
from hal.registry import OPS, Autocast, OpDecl, Tolerance, _params_of
from hal.registry import declare as _declare
from hal.runtime import IN_PROCESS
from hal.version import __version__

#: the plugin holding kernels added to backends this process did not define
KERNELS_PLUGIN = "in_process"

_LOCK = threading.RLock()

#: tolerance presets of hal's own ops, for declarations made here: ELEMENTWISE (no accumulation),
#: REDUCTION (atol widened by the square root of the op's reduction length)
ELEMENTWISE: Mapping[str, Tolerance] = _presets.ELEMENTWISE
REDUCTION: Mapping[str, Tolerance] = _presets.REDUCTION

#: the environment variable that checks every result of a kernel registered here against its op's
#: fake rule (read again after ``hal.dispatch.reset()``, as the other HAL_* variables)
DEBUG_ENV = "HAL_DEBUG"

_ARRAY_APIS = ("torch", "numpy")


class KernelResultError(HalError, RuntimeError):
    """A kernel registered with :func:`register_kernel` returned something its op cannot give the
    caller: another array type, ``None``, or results whose shapes, dtypes or devices differ from
    the op's fake rule. The message names the kernel and what to fix."""


def declare(*, dtypes: Sequence[str], **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """:func:`hal.registry.declare` (the arguments are the same), refusing at once what it would
    take silently: a dtype name that is no torch dtype (``"float7"``). A ``backward`` op may be
    declared after this one; a call needing autograd before it is raises, naming it."""
    unknown = [d for d in dtypes if not isinstance(getattr(torch, str(d), None), torch.dtype)]
    if isinstance(dtypes, str) or unknown or not dtypes:
        raise InvalidArgumentError("hal.library.declare", "dtypes", "a non-empty tuple of dtype names such as "
                                   "('float32', 'bfloat16'), each the name of a torch dtype",
                                   f"{dtypes!r}" + (f" ({', '.join(map(repr, unknown))}: no torch dtype)" if unknown else ""))
    if "tolerances" in options:
        _check_tolerances(options["tolerances"])
    declaring = _declare(dtypes=dtypes, **options)

    def declare_new(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = getattr(fn, "__name__", None)
        if name in OPS:
            raise InvalidArgumentError("hal.library.declare", "fn", "a function named as no declared op (an op is declared once "
                                       "per process; rename the function, or register a kernel for the existing op with "
                                       "hal.library.register_kernel)", f"{name!r}, an op declared already")
        _check_parameters(fn)
        _check_backward_named(name, options.get("backward"))
        return declaring(fn)

    return declare_new


def _check_tolerances(tolerances: Any) -> None:
    """``tolerances`` maps dtype names to :class:`Tolerance` (registry.declare iterated a number)."""
    if not isinstance(tolerances, Mapping) or not all(isinstance(k, str) and isinstance(v, Tolerance) for k, v in tolerances.items()):
        raise InvalidArgumentError("hal.library.declare", "tolerances", "a mapping of dtype names to hal.library.Tolerance(atol, "
                                   "rtol), such as hal.library.ELEMENTWISE or hal.library.REDUCTION", repr(tolerances))


def _check_backward_named(name: Any, backward: Any) -> None:
    """A ``backward`` op named by a declaration is a name; if that op is declared already, it must
    be declared as this op's backward (``forward=`` naming it). One not declared yet may be declared
    later, but before the op's kernels are registered (:func:`_check_backward_declared`)."""
    if backward is None:
        return
    if not isinstance(backward, str) or not backward.isidentifier():
        raise InvalidArgumentError("hal.library.declare", "backward", "the name of the op computing the gradients", repr(backward))
    other = OPS.get(backward)
    if other is not None and other.forward != name:
        raise InvalidArgumentError("hal.library.declare", "backward", f"the name of an op declared as {name}'s backward "
                                   f"(hal.library.declare(..., forward={name!r}), taking grad_out first), or of one not declared yet",
                                   f"{backward!r}, an op declared " + (f"as the backward of {other.forward!r}" if other.forward
                                                                        else "as a forward op"))


def _check_backward_declared(decl: OpDecl) -> None:
    """Registering a kernel of an op whose declaration names a backward op that is not declared:
    refused, naming it (a misspelt name would fail only at the first call needing autograd)."""
    if decl.backward is not None and decl.backward not in OPS:
        close = difflib.get_close_matches(decl.backward, list(OPS), n=1, cutoff=0.8)
        raise InvalidArgumentError(
            "hal.library.register_kernel", "op", f"an op whose backward op is declared (declare {decl.backward!r} with "
            f"hal.library.declare(..., forward={decl.name!r}), taking grad_out first, before registering {decl.name}'s kernels"
            + (f"; did you mean {close[0]!r}?" if close else "") + ")",
            f"{decl.name!r}, declared with backward={decl.backward!r}, an op not declared")


#: what an op's parameter may be annotated with, as :func:`declare`'s errors say it
_PARAMETER_TYPES = ("hal.types.Tensor, OptionalTensor, TensorList, OptionalTensorList, ScalarOrTensor or "
                    "OptionalScalarOrTensor for arrays; int, float, bool, str, Optional[int], Optional[float], "
                    "Optional[str], hal.types.IntPair, ShapeLike or Padding for static options")


def _check_parameters(fn: Callable[..., Any]) -> None:
    """Refuse, before anything is registered, a parameter of ``fn`` that an op's schema cannot hold:
    ``*args``, ``**kwargs``, a positional-only one, one without an annotation or with an annotation
    no torch schema type encodes (``hal.registry.declare`` raised a bare TypeError for these, after
    the op's name was taken)."""
    name = str(getattr(fn, "__name__", fn))
    for raw in inspect.signature(fn).parameters.values():
        if raw.kind in (raw.VAR_POSITIONAL, raw.VAR_KEYWORD, raw.POSITIONAL_ONLY):
            raise InvalidArgumentError("hal.library.declare", raw.name, "a plain named parameter (no *args, **kwargs or "
                                       "positional-only parameters: the op's schema names each argument)",
                                       f"{raw.kind.description} parameter {raw.name!r} of {name!r}")
        if raw.annotation is inspect.Parameter.empty:
            raise InvalidArgumentError("hal.library.declare", raw.name, f"annotated with {_PARAMETER_TYPES}",
                                       f"no annotation on parameter {raw.name!r} of {name!r}")
    try:
        params = _params_of(fn)
    except NameError as exc:  # a string annotation naming nothing importable where fn is defined
        raise InvalidArgumentError("hal.library.declare", "fn", f"a function whose annotations resolve where it is "
                                   f"defined, each one of {_PARAMETER_TYPES}", f"{name!r}: {exc}") from None
    stub = OpDecl(name=name, signature="", dtypes=(), tolerances={}, doc="", params=params)
    for p in params:
        try:
            codec(stub, p, None)
        except TypeError:
            raise InvalidArgumentError("hal.library.declare", p.name, f"annotated with {_PARAMETER_TYPES}",
                                       f"{p.annotation!r} on parameter {p.name!r} of {name!r}") from None


def define_backend(
    name: str,
    *,
    priority: int,
    device_types: Iterable[str],
    probe: Callable[[], Optional[str]] = lambda: None,
    devices: Optional[Callable[[], list[DeviceInfo]]] = None,
    arch: Optional[Callable[[Any], Optional[str]]] = None,
    array_api: str = "torch",
) -> None:
    """Define backend ``name`` in this process: it serves ``device_types`` (``"cpu"``, ``"cuda"``)
    at ``priority`` (higher is tried first; hal's ``cpu`` backend has 50, ``cpu_ref`` 0), is usable
    when ``probe()`` returns None (else the sentence it returns says why not), and its kernels take
    ``array_api`` arrays by default ("torch" or "numpy"). Refused (InvalidArgumentError) when a
    backend of that name exists already."""
    _check_array_api("hal.library.define_backend", array_api)
    _check_priority("hal.library.define_backend", priority)
    if isinstance(device_types, str) or not all(isinstance(d, str) and d for d in device_types):
        raise InvalidArgumentError("hal.library.define_backend", "device_types", "a tuple of device type names such as ('cpu',)",
                                   repr(device_types))
    for what, fn in (("probe", probe), ("devices", devices), ("arch", arch)):
        _check_callable("hal.library.define_backend", what, fn)
    with _LOCK:
        taken = set(DISPATCHER.runtime().backends) | {p.backend.name for p in IN_PROCESS.values() if p.backend is not None}
        if name in taken or name == KERNELS_PLUGIN:
            raise InvalidArgumentError("hal.library.define_backend", "name", "the name of no backend installed or defined yet",
                                       f"{name!r}, which exists (backends: {', '.join(sorted(taken))})")
        plugin = Plugin(name, __version__, summary="defined in this process (hal.library)")
        listed = devices or (lambda: [DeviceInfo(0, name, "in-process", "")])
        plugin.define_backend(priority=priority, device_types=tuple(device_types), probe=probe, devices=listed, arch=arch, array_api=array_api)
        IN_PROCESS[name] = plugin
        _refresh()


def register_kernel(
    op: str,
    *,
    backend: str,
    name: str,
    priority: Optional[int] = None,
    dtypes: Optional[Iterable[str]] = None,
    archs: Optional[Archs] = None,
    check: Optional[Callable[[Inputs], Reasons]] = None,
    array_api: Optional[str] = None,
    fused: bool = True,
    differentiable: Union[bool, Callable[[Inputs], Reasons]] = False,
    contexts: Optional[Mapping[str, int]] = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as kernel ``name`` of ``op`` on ``backend`` and return it
    unchanged (the arguments of :meth:`hal.plugin.Plugin.kernel`, which checks the function's
    parameters and dtypes against the op's declaration now). ``backend`` must exist here: an
    installed backend or one made with :func:`define_backend`; ``name`` must be new for the op on
    that backend. ``contexts`` (``{"eager": 30, "compiled": 5}``: the contexts of
    :data:`hal.plugin.CONTEXTS` it serves, with its priority in each) or ``priority`` (every
    context, default 0) ranks it. The dispatcher forgets its decisions, so the kernel is a
    candidate from the next call on."""

    if priority is not None:
        _check_priority("hal.library.register_kernel", priority)
    _check_contexts(priority, contexts)
    _check_callable("hal.library.register_kernel", "check", check)
    if not isinstance(differentiable, bool):
        _check_callable("hal.library.register_kernel", "differentiable", differentiable)

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        with _LOCK:
            rt = DISPATCHER.runtime()
            own = IN_PROCESS.get(backend)
            if backend not in rt.backends and own is None:
                raise InvalidArgumentError(
                    "hal.library.register_kernel", "backend", f"an installed backend ({', '.join(sorted(rt.backends)) or 'none'}) "
                    "or one defined with hal.library.define_backend", repr(backend))
            if any(k.name == name for k in rt.kernels(op, backend)):
                raise InvalidArgumentError("hal.library.register_kernel", "name", f"a kernel name {op} does not have on {backend} yet",
                                           repr(name))
            if array_api is not None:
                _check_array_api("hal.library.register_kernel", array_api)
            api = array_api or (own.backend.array_api if own is not None and own.backend is not None else rt.backends[backend].info.array_api)
            decl = OPS.get(op)
            if decl is not None:
                _check_backward_declared(decl)
            kernel = _checked_results(decl, fn, f"{backend}/{name}", api) if decl is not None else fn
            plugin = own if own is not None else IN_PROCESS.setdefault(KERNELS_PLUGIN, Plugin(KERNELS_PLUGIN, __version__))
            try:
                plugin.kernel(op, name=name, backend=backend, priority=priority, dtypes=dtypes, archs=archs, check=check,
                              array_api=array_api, fused=fused, differentiable=differentiable, contexts=contexts)(kernel)
            except PluginError as exc:
                raise InvalidArgumentError("hal.library.register_kernel", "fn", "a kernel matching the op's declaration",
                                           str(exc)) from None
            _refresh()
        return fn

    return register


def _check_priority(where: str, priority: Any) -> None:
    """A priority is an int (it is compared with the other kernels' and backends' at each decision)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgumentError(where, "priority", "an int (higher is tried first)", repr(priority))


def _check_contexts(priority: Optional[int], contexts: Optional[Mapping[str, int]]) -> None:
    """``contexts`` is None or a routing :class:`hal.plugin.Routing` takes, and comes without a
    ``priority`` (each context has its own)."""
    if contexts is None:
        return
    if priority is not None:
        raise InvalidArgumentError("hal.library.register_kernel", "priority", "no priority beside contexts (each context has its "
                                   "priority there)", f"priority={priority!r} and contexts={contexts!r}")
    try:
        Routing.of(contexts)
    except (ValueError, TypeError) as exc:
        raise InvalidArgumentError("hal.library.register_kernel", "contexts", f"a mapping of some of {', '.join(CONTEXTS)} to int "
                                   "priorities", f"{contexts!r} ({exc})") from None


def _check_callable(where: str, name: str, fn: Any) -> None:
    """An optional hook is None or callable (else it would fail at the first call that uses it)."""
    if fn is not None and not callable(fn):
        raise InvalidArgumentError(where, name, "a function, or None", repr(fn))


def _check_array_api(where: str, array_api: Any) -> None:
    """Refuse an array type hal does not convert (a kernel's results would reach callers as they are)."""
    if array_api not in _ARRAY_APIS:
        raise InvalidArgumentError(where, "array_api", "'torch' or 'numpy', the array type the kernels take and return",
                                   repr(array_api))


@contextlib.contextmanager
def checking_results() -> Iterator[None]:
    """Check every result of the kernels registered here against their ops' fake rules while the
    block runs (in every thread), as ``HAL_DEBUG=1`` does: how the conformance suite runs them."""
    with _LOCK:
        _FULL_CHECKS[0] += 1
        _UNCHECKED[0] = -1
    try:
        yield
    finally:
        with _LOCK:
            _FULL_CHECKS[0] -= 1
            _UNCHECKED[0] = -1


#: how many checking_results() blocks are open
_FULL_CHECKS = [0]
#: the dispatcher generation for which full checks are known to be off (HAL_DEBUG read unset, no
#: checking_results() block open); -1: to be found out. A call compares it with the generation,
#: which hal.dispatch.reset() moves, so HAL_DEBUG is read again as the other HAL_* variables are.
_UNCHECKED = [-1]


def _full_checks() -> bool:
    """Whether every call's results are checked against the fake rule now."""
    generation = DISPATCHER.generation
    on = _FULL_CHECKS[0] > 0 or config.env_flag(DEBUG_ENV)
    if not on:
        _UNCHECKED[0] = generation
    return on


def _checked_results(decl: OpDecl, fn: Callable[..., Any], label: str, api: str) -> Callable[..., Any]:
    """``fn`` with its results checked (see the module doc): the array type at every call (one
    isinstance test and a comparison when it returns one array), the op's fake rule on the first
    call and while full checks are on. Nothing is checked while torch.compile traces."""
    own_type = torch.Tensor if api == "torch" else np.ndarray
    first = [True]

    @functools.wraps(fn)
    def kernel(*args: Any) -> Any:
        out = fn(*args)
        if isinstance(out, own_type) and _UNCHECKED[0] == DISPATCHER.generation and not first[0]:
            return out
        if tracing.is_compiling() or tracing.traced(args):
            return out
        _check_types(decl, label, api, args, out)
        full = first[0] or (_UNCHECKED[0] != DISPATCHER.generation and _full_checks())
        if full and decl.fake is not None:
            _check_against_fake(decl, label, api, args, out)
        first[0] = False
        return out

    return kernel


def _check_types(decl: OpDecl, label: str, api: str, args: Sequence[Any], out: Any) -> None:
    """Every array of ``out`` is of the kernel's array type, and ``out`` is not None where the op
    writes nothing in place (its results are all it gives)."""
    if out is None and not decl.writes(decl.bind(args)):
        raise KernelResultError(
            f"kernel {label} of {decl.name} returned None; {decl.name} writes nothing in place, so its kernels return "
            f"its results{_as_fake_says(decl, api, args)}: return them")
    own = (torch.Tensor,) if api == "torch" else (np.ndarray, np.generic)
    for where, value in _leaves(out):
        if value is not None and not isinstance(value, own):
            fix = ("register it with array_api='numpy' to return NumPy arrays (hal converts them for torch callers)"
                   if api == "torch" and isinstance(value, np.ndarray) else f"return {own[0].__module__}.{own[0].__name__} arrays")
            raise KernelResultError(
                f"kernel {label} of {decl.name} returned {_described(value)} as {where}, but it takes and returns "
                f"{api} arrays (array_api={api!r}): {fix}")


def _check_against_fake(decl: OpDecl, label: str, api: str, args: Sequence[Any], out: Any) -> None:
    """``out`` has the number of results, shapes, dtypes and devices the op's fake rule gives."""
    try:
        want = fake_results(decl, args, api)
    except Exception as exc:
        raise KernelResultError(f"the fake rule of {decl.name} raised {type(exc).__name__}: {exc} on the arguments "
                                f"kernel {label} ran: fix the fake rule (@{decl.name}.fake), which torch.compile relies on") from exc
    got_leaves, want_leaves = _leaves(out), _leaves(want)
    if isinstance(out, (tuple, list)) != isinstance(want, (tuple, list)):  # [y] for y: the caller would get a list
        raise KernelResultError(f"kernel {label} of {decl.name} returned {_results(out)}, its fake rule {_results(want)}: "
                                "make the kernel and the fake rule agree")
    if len(got_leaves) != len(want_leaves):
        raise KernelResultError(f"kernel {label} of {decl.name} returned {len(got_leaves)} result(s), its fake rule "
                                f"{len(want_leaves)}: make the kernel and the fake rule agree")
    for (where, got), (_, expected) in zip(got_leaves, want_leaves):
        if expected is None:
            continue
        if got is None or _signature(got) != _signature(expected):
            raise KernelResultError(
                f"kernel {label} of {decl.name} returned {_described(got)} as {where}, where the op's fake rule "
                f"gives {_described(expected)} for these arguments: fix the kernel (or the fake rule, which "
                "torch.compile and the checks rely on)")


def _results(out: Any) -> str:
    """How many results ``out`` holds and in what, in words ("a list of 1 result", "one array")."""
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)} result(s)"
    return "one array" if out is not None else "None"


def _leaves(out: Any) -> list[tuple[str, Any]]:
    """The results of a call by position ("the result", "result 0" ...)."""
    if isinstance(out, (tuple, list)):
        return [(f"result {i}", v) for i, v in enumerate(out)]
    return [("the result", out)]


def _signature(a: Any) -> tuple:
    shape = tuple(a.shape) if hasattr(a, "shape") else ()
    device = a.device if isinstance(a, torch.Tensor) else "cpu"
    return shape, arrays.dtype_name(a) if arrays.is_array(a) else type(a).__name__, str(device)


def _described(a: Any) -> str:
    if a is None:
        return "None"
    if arrays.is_array(a) or isinstance(a, np.generic):
        shape, dtype, device = _signature(a)
        return f"a {dtype} {type(a).__module__.split('.')[0]}.{type(a).__name__} of shape {shape} on {device}"
    return f"a {type(a).__name__}"


def _as_fake_says(decl: OpDecl, api: str, args: Sequence[Any]) -> str:
    """", the op's fake rule gives ..." where the op has one that runs on ``args``."""
    try:
        want = fake_results(decl, args, api) if decl.fake is not None else None
    except Exception:
        return ""
    return "" if want is None else " (the op's fake rule gives " + ", ".join(_described(v) for _, v in _leaves(want)) + ")"


def _refresh() -> None:
    """Put this process's plugins into the dispatcher's runtime (one is built on first use
    otherwise, with them in it); cached decisions are dropped."""
    with DISPATCHER._lock:
        if DISPATCHER._runtime is not None:
            DISPATCHER.install(DISPATCHER._runtime.with_in_process())


__all__ = ["declare", "register_kernel", "define_backend", "checking_results", "Autocast", "Tolerance", "KernelResultError",
           "ELEMENTWISE", "REDUCTION", "KERNELS_PLUGIN", "DEBUG_ENV"]
