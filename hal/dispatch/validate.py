"""Step 1 of a call's decision: are the arguments acceptable, and what do kernels see of them?

Generic checks come from the schema (arrays where arrays are declared, all of one array type on one
device, dense tensors), then the op's own checker, which canonicalises static options (stride as a
pair, dim non-negative ...). Arrays the op writes are checked writable. The result,
:class:`Prepared`, holds the canonical arguments kernels are called with (:class:`hal.plugin.Inputs`),
the substitutions a cached plan applies to later calls of the same signature, and the slot of an
unbatched input that gets a batch dimension of one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch

from hal import arrays, tracing
from hal.errors import HalError, InvalidArgumentError
from hal.plugin import Inputs
from hal.registry import OpDecl
from hal.types import ARRAY_KINDS, Kind

_grad_enabled = torch.is_grad_enabled
_PLAIN = (int, float, str, bool, type(None))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A validated call: what kernels see, and how a plan turns a later call of the same signature
    into that (static substitutions by slot; the slot of an unbatched input)."""

    inputs: Inputs
    subs: tuple[tuple[int, Any], ...]
    unbatched: Optional[int]

    def original_batch(self, args: Sequence[Any]) -> tuple:
        """The canonical arguments with an unbatched input as the caller gave it."""
        canon = list(self.inputs.args)
        if self.unbatched is not None:
            canon[self.unbatched] = args[self.unbatched]
        return tuple(canon)


def prepare(decl: OpDecl, args: Sequence[Any]) -> Prepared:
    """Validate a call (raising :class:`hal.InvalidArgumentError`) and canonicalise its arguments."""
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
        for name, a in written(decl, canon):
            _check_written(decl, name, a, grad)
    unbatched = None
    if decl.unbatched is not None:
        name, rank = decl.unbatched
        i = decl.index(name)
        if canon[i].ndim == rank:
            unbatched = i
            canon[i] = canon[i][None]
    return Prepared(Inputs(decl, tuple(canon), kind, device, dtype, array_type), tuple(subs), unbatched)


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


def has_zero_size(decl: OpDecl, args: Sequence[Any]) -> bool:
    """Whether an array argument has a zero-size dimension (the op's ``empty`` rule answers)."""
    for p, a in zip(decl.params, args):
        if p.kind not in ARRAY_KINDS:
            continue
        items = a if isinstance(a, (list, tuple)) else (a,)
        for x in items:
            if arrays.is_array(x) and x.ndim and 0 in tuple(x.shape):
                return True
    return False


def written(decl: OpDecl, args: Sequence[Any]) -> list[tuple[str, Any]]:
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


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _expect(decl: OpDecl, name: str, ok: bool, expected: str, value: Any) -> None:
    if not ok:
        raise InvalidArgumentError(decl.name, name, expected, arrays.describe(value))


def _check_array(decl: OpDecl, name: str, a: Any) -> None:
    """An array hal can hand to kernels: a strided, non-nested torch tensor holding its own memory
    (a plain tensor, a parameter, a subclass made with ``as_subclass``) or a NumPy array.

    A wrapper subclass (one that intercepts torch's dispatch, such as ``DTensor`` or a subclass made
    with ``_make_wrapper_subclass``) has no memory a kernel could read: NumPy kernels would fail on
    it and torch kernels would compute through its dispatch, not hal's. Fake and functional tensors
    (a call torch.compile traces, decided on them: :mod:`hal.tracing`) are no such arrays."""
    if not isinstance(a, torch.Tensor):
        return
    if a.is_nested or a.layout != torch.strided:
        what = "a nested tensor" if a.is_nested else f"a tensor of layout {a.layout}"
        fix = "unbind it into dense tensors first" if a.is_nested else "convert it with .to_dense() first"
        raise InvalidArgumentError(decl.name, name, "a dense (strided) torch.Tensor or numpy.ndarray", f"{what}; {fix}")
    if type(a) not in _PLAIN_TENSORS and torch._C._dispatch_keys(a).has(torch._C.DispatchKey.Python) and not tracing.traced((a,)):
        raise InvalidArgumentError(
            decl.name, name, "a torch.Tensor holding its own memory (a plain tensor, a parameter or a subclass made with as_subclass)",
            f"a {type(a).__name__}, a tensor subclass that intercepts torch's dispatch; give hal its plain tensor "
            "(DTensor: .to_local() or .full_tensor())",
        )


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _check_written(decl: OpDecl, name: str, a: Any, grad: bool) -> None:
    """An array an op writes in place: writeable, without internal overlap, and (with grad mode on)
    not requiring grad, as torch's own in-place ops demand."""
    if isinstance(a, np.ndarray):
        if not a.flags.writeable:
            raise InvalidArgumentError(decl.name, name, "a writeable array (the op updates it in place)", f"a read-only {arrays.describe(a)}")
        if arrays.overlaps(a):
            raise InvalidArgumentError(decl.name, name, "an array without repeated elements (it is written in place)",
                                       f"{arrays.describe(a)} with byte strides {a.strides}, whose elements share memory")
        return
    if grad and a.requires_grad:
        raise InvalidArgumentError(
            decl.name, name,
            "a tensor that does not require grad while grad mode is on (hal's in-place ops are not differentiable); "
            "call it under torch.no_grad() or on .detach()ed tensors",
            arrays.describe(a) + " requiring grad",
        )
    if arrays.overlaps(a):
        raise InvalidArgumentError(decl.name, name, "a tensor without overlapping elements (it is written in place)",
                                   f"{arrays.describe(a)} with strides {tuple(a.stride())}, whose elements share memory "
                                   "(an expanded or as_strided view); write into a .contiguous() copy")


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
        array_type = "torch" if isinstance(first, torch.Tensor) else "numpy"
        kind, device = arrays.device_kind(first), (first.device if array_type == "torch" else "cpu")
        for name, a in found[1:]:
            same_type = isinstance(a, torch.Tensor) == (array_type == "torch")
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
