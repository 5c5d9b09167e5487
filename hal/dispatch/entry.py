"""Where a call enters: ``hal.ops.<name>``, generated from the op's declaration, and its cache key.

``inspect.getsource(hal.ops.softmax)`` shows the function (its source is registered with
``linecache``, so tracebacks and debuggers show it too); its first lines say where each name it uses
comes from. It leads to the dispatcher in two places: :meth:`Dispatcher.plan
<hal.dispatch.dispatcher.Dispatcher.plan>` on a cache miss, and the plan the dispatcher cached for
the call's key on a hit. :func:`make_entry` builds it; :func:`hal.registry.declare` asks for it
through the factory :func:`hal.wiring.wire` installs.

A call's key holds, for every argument, what can change the decision: for arrays their type,
dtype, device, shape, strides and requires_grad (and, for NumPy arrays an op writes, whether they
are writeable); for other values their type and value; plus the ``hal.use`` scope and grad mode.
On a hit the call is that key, one dictionary lookup and the cached plan; on a miss
:meth:`hal.dispatch.dispatcher.Dispatcher.plan` decides and caches. An argument whose key cannot be
computed (unhashable; a sparse or nested tensor, which has no strides) is decided without caching,
so that validation says what is wrong with it, not the key. Fake and functional tensors
(torch.compile tracing) are tensor subclasses, so they never share a key with real tensors.

Why generated: the entry function is the hot path of every op call, and generating it from the
declaration lets Python itself bind the arguments and computes the key inline (no
``inspect.Signature.bind``, no per-argument function calls). A plain ``def entry(*args,
**kwargs)`` shared by every op, keying each argument in a loop, cost 2-3.5 us more per call on the
2-core CI VM (softmax on a (4, 4) tensor 6.1 -> 9.6 us, NumPy 5.5 -> 7.8 us, the trivial-kernel rows
of benchmarks/dispatch_overhead.py, 2026-12-07), and one forwarding to the generated function
about 1 us (10% of a softmax call through the CPU backend).

Under ``torch.autocast`` (one C call tells) the key also holds the autocast state of the call's
device (:func:`hal.dispatch.autocast.state`: its device type and autocast dtype; None where autocast
is off there, so such a call shares the plans of calls without autocast), and a miss is decided by
:func:`hal.dispatch.autocast.planner`, whose plan casts by the op's rule and runs, with autocast
off, the plan the cast arguments have as a call of their own (keyed by ``_key_of``, the key
generated beside the entry). A hit is then one key and one lookup, as without autocast.
"""

from __future__ import annotations

import inspect
import linecache
import operator
from typing import Any, Callable

import numpy as np
import torch

from hal import arrays, config, tracing
from hal.registry import OpDecl, Param
from hal.types import ARRAY_KINDS, Kind

from . import autocast
from .dispatcher import DISPATCHER

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_ndarray = np.ndarray


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
    return (type(a), tuple(map(argkey, a)))


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


def argkey(a: Any) -> Any:
    """What of an argument can change a dispatch decision (hashable)."""
    keyer = _KEYERS.get(type(a))
    if keyer is not None:
        return keyer(a)
    if isinstance(a, _Tensor):  # subclasses
        return (type(a), *_tensor_key(a))
    if isinstance(a, _ndarray):
        return (type(a), *_ndarray_key(a))
    return _plain_key(a)


def written_key(a: Any) -> Any:
    """The key of an argument an op writes: NumPy arrays also by whether they are writeable (so a
    read-only array is refused before anything is written, never half way)."""
    if isinstance(a, (list, tuple)):
        if a and set(map(type, a)) <= _TENSOR_TYPES:
            return _sequence_key(a)
        return (type(a), tuple(map(written_key, a)))
    if type(a) is _ndarray:
        return (a.dtype, a.shape, a.strides, a.flags.writeable)
    return argkey(a)


#: annotations whose values are keyed inline as (type, value) by the generated entry functions.
_SIMPLE_ANNOTATIONS = (int, float, str, bool)
#: the types :func:`argkey` keys as (type, value): a static value of one of them (an ``Optional[float]``
#: eps, None, an int) is keyed so inline, without argkey's two frames (0.2-0.3 us a call).
_PLAIN = frozenset(t for t, keyer in _KEYERS.items() if keyer is _plain_key)


def _key_source(p: Param, i: int, decl: OpDecl) -> list[str]:
    """Source lines computing ``k{i}``, parameter ``p``'s part of the cache key (as :func:`argkey`
    would, inlined for the common types: the hot path of an op call is these lines and one dict
    lookup)."""
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
    if p.kind is Kind.STATIC:  # tuples of numbers (stride, padding, dims): the values and their types; or a plain value
        return [
            f"    t{i} = type({v})",
            f"    if t{i} is tuple:",
            f"        k{i} = ({v}, *map(type, {v}))",
            f"    elif t{i} in _PLAIN:  # an optional number (eps, scale), None, an int dim: argkey's (type, value)",
            f"        k{i} = (t{i}, {v})",
            "    else:",
            f"        k{i} = _argkey({v})",
        ]
    return [f"    k{i} = _argkey({v})"]


def make_entry(decl: OpDecl, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Build ``hal.ops.<name>``: a function with the declaration's exact signature that dispatches.
    Under ``torch.compile`` (Dynamo) the call becomes a ``torch.ops.hal.<name>`` node."""
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
    first = next((p for p in decl.params if p.kind in ARRAY_KINDS), None)
    if first is None:  # no array parameter: no tensor whose device autocast could be on for
        state = "None"
    else:  # a tensor in the first array parameter (the common case) inline, else the general search
        v = first.name
        state = (f"(_autocast_state({v}) if type({v}) is _Tensor or type({v}) is _Parameter else _autocast_state_of({arg_tuple}))"
                 " if _autocast_any() else None")
    doc = f'    """hal.ops.{decl.name}, generated from its declaration by hal.dispatch.entry.make_entry."""'
    src = "\n".join(
        [
            f"def {decl.name}({', '.join(params)}):",
            doc,
            *_NAMES_COMMENT,
            "    if _is_compiling():  # Dynamo is tracing: one torch.ops.hal.<name> node",
            f"        return _DISPATCHER.traced(_decl, {arg_tuple})",
            "    # torch.autocast on for the call's device: (device type, autocast dtype), a part of the key (hal.dispatch.autocast)",
            f"    _amp = {state}",
            "    try:",
            *("    " + line for line in key_lines),
            f"        key = (_decl, _amp, _local.overrides if _scopes[0] else None, _grad_enabled(){keys})",
            "        plan = _cache_get(key)",
            "    except Exception:  # unhashable, or a tensor without strides (sparse, nested): validation refuses it",
            "        key = plan = None",
            "    if plan is None:  # decided once per key: the dispatcher validates, selects, routes and caches",
            f"        plan = _DISPATCHER.plan(_decl, {arg_tuple}, key) if _amp is None else _autocast_plan({arg_tuple}, key, _amp)",
            "    plan[0]()  # counts the call in hal.stats()",
            f"    return plan[1]({arg_list})  # the route: the kernel, hal's autograd node or a decomposition",
            "",
            f"def _key_of({arg_list}):",
            f'    """The key hal.ops.{decl.name} computes for these arguments with autocast off for their device."""',
            *key_lines,
            f"    return (_decl, None, _local.overrides if _scopes[0] else None, _grad_enabled(){keys})",
            "",
        ]
    )
    filename = f"<hal.ops.{decl.name}>"
    namespace: dict[str, Any] = {
        "_DISPATCHER": DISPATCHER,
        "_cache_get": DISPATCHER._cache.get,
        "_decl": decl,
        "_is_compiling": tracing.is_compiling,
        "_autocast_any": autocast.any_enabled,
        "_autocast_state": autocast.state,
        "_autocast_state_of": autocast.state_of(decl),
        "_local": config._local,
        "_scopes": config.ACTIVE_SCOPES,
        "_grad_enabled": torch.is_grad_enabled,
        "_Tensor": _Tensor,
        "_Parameter": _Parameter,
        "_ndarray": _ndarray,
        "_argkey": argkey,
        "_PLAIN": _PLAIN,
        "_written_key": written_key,
        "_is_array": arrays.is_array,
        **defaults,
    }
    exec(compile(src, filename, "exec"), namespace)
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace["_autocast_plan"] = autocast.planner(decl, namespace["_key_of"])
    entry = namespace[decl.name]
    entry.__doc__ = fn.__doc__
    entry.__module__ = "hal.ops"
    entry.__qualname__ = decl.name
    entry.__signature__ = sig
    entry.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    return entry


#: The first lines of every generated entry's body: where the names it uses come from.
_NAMES_COMMENT = (
    "    # _DISPATCHER: hal.dispatch.DISPATCHER; _cache_get: the get of its cached plans (key -> (count, run));",
    "    # _decl: the op's declaration (hal.ops.<name>.op); _is_compiling: hal.tracing.is_compiling;",
    "    # _autocast_state(_of): hal.dispatch.autocast.state (state_of(_decl)); _autocast_plan: autocast.planner(_decl, _key_of);",
    "    # _local, _scopes: the hal.use scopes (hal.config);",
    "    # _argkey, _written_key, _PLAIN: hal.dispatch.entry; _d_<name>: the declared defaults.",
)
