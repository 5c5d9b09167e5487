"""Op declarations: the single source of truth for every op's name, schema, dtypes and tolerances.

An op is declared once, in ``ops/``, as a typed Python function whose signature is its schema::

    @declare(dtypes=FLOATS, tolerances=MATMUL_TOLERANCES, backward="matmul_backward")
    def matmul(a: Tensor, b: Tensor) -> Tensor:
        \"\"\"Matrix product with broadcasting, as torch.matmul.\"\"\"

``declare`` records an :class:`OpDecl` and returns the public, dispatching function that users
call as ``hal.ops.matmul``. The returned function carries decorators to attach the op's argument
checker (``@matmul.checker``) and, where useful, a composite decomposition into other ops
(``@matmul.composite``).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Callable, Mapping, Optional, Sequence

from hal.types import Kind, kind_of


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Allowed error of a kernel against the float64 reference: |out - ref| <= atol + rtol * |ref|.

    An op's tolerances are keyed by the dtype of each result (for most ops the input dtype; for
    quantize int8, for int8_linear its out_dtype).

    ``per_sqrt_k`` widens ``atol`` for ops that accumulate: the conformance suite multiplies atol by
    ``sqrt(K)`` where K is the op's reduction length (see :attr:`OpDecl.reduction`).
    """

    atol: float
    rtol: float
    per_sqrt_k: bool = False

    def widened(self, k: int) -> tuple[float, float]:
        """(atol, rtol) for a reduction of length ``k``."""
        if self.per_sqrt_k and k > 1:
            return self.atol * (k**0.5), self.rtol
        return self.atol, self.rtol


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of an op's schema."""

    name: str
    kind: Kind
    annotation: Any
    default: Any  # inspect.Parameter.empty when required
    keyword_only: bool

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty


@dataclasses.dataclass(eq=False)
class OpDecl:
    """The declaration of one op (fields ``name``, ``signature``, ``dtypes``, ``tolerances``, ``doc``
    are the public ``hal.list_ops()`` record)."""

    name: str
    signature: str
    dtypes: tuple[str, ...]
    tolerances: Mapping[str, Tolerance]
    doc: str
    params: tuple[Param, ...]
    #: name of the backward op of a trainable op, None otherwise.
    backward: Optional[str] = None
    #: for a backward op, the name of its forward op.
    forward: Optional[str] = None
    #: parameters written in place by the op.
    mutates: tuple[str, ...] = ()
    #: the parameter whose dtype is "the op's dtype" (kernels declare supported dtypes against it).
    dtype_from: str = ""
    #: a rank at which the input named by ``unbatched[0]`` is unbatched: it gets a batch dimension
    #: before the kernel runs and the output loses it again (conv2d's CHW inputs).
    unbatched: Optional[tuple[str, int]] = None
    #: reduction length K of a call (canonical arguments by name), used to widen tolerances.
    reduction: Optional[Callable[[Mapping[str, Any]], int]] = None
    #: parameters whose values change from call to call (a learning rate, a step count): the decision
    #: cache keys them by type only, and these validators (op, name, value) -> canonical value check
    #: them on every call instead of once per input signature.
    volatile: Mapping[str, Callable[[str, str, Any], Any]] = dataclasses.field(default_factory=dict)
    #: validates a call and returns canonical values for static parameters (see ``checker``).
    check: Optional[Callable[..., Optional[Mapping[str, Any]]]] = None
    #: a decomposition into other ops, used when a backend has no kernel that runs the inputs.
    composite: Optional[Callable[..., Any]] = None
    #: the public function (set by ``declare``).
    entry: Optional[Callable[..., Any]] = None

    @property
    def trainable(self) -> bool:
        return self.backward is not None

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def index(self, name: str) -> int:
        """Position of a parameter in the canonical argument tuple."""
        return self.param_names.index(name)

    def bind(self, args: Sequence[Any]) -> dict[str, Any]:
        """Arguments by parameter name."""
        return dict(zip(self.param_names, args))

    def __repr__(self) -> str:
        return f"<op {self.name}{self.signature}>"


#: Every declared op, by name, in declaration order.
OPS: dict[str, OpDecl] = {}


def get_op(name: str) -> OpDecl:
    """The declaration of an op; raises KeyError with the known names when there is none."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"no op named {name!r}; declared ops: {', '.join(sorted(OPS))}") from None


def _params_of(fn: Callable[..., Any]) -> tuple[Param, ...]:
    hints = typing.get_type_hints(fn, include_extras=True)
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"op {fn.__name__}: parameter {p.name} must be a plain named parameter")
        ann = hints.get(p.name, Any)
        out.append(Param(p.name, kind_of(ann), ann, p.default, p.kind == p.KEYWORD_ONLY))
    return tuple(out)


def _signature_text(fn: Callable[..., Any]) -> str:
    sig = inspect.signature(fn)
    parts = []
    star = False
    for p in sig.parameters.values():
        if p.kind == p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return "(" + ", ".join(parts) + ")"


def declare(
    *,
    dtypes: Sequence[str],
    tolerances: Mapping[str, Tolerance],
    backward: Optional[str] = None,
    forward: Optional[str] = None,
    mutates: Sequence[str] = (),
    dtype_from: Optional[str] = None,
    unbatched: Optional[tuple[str, int]] = None,
    reduction: Optional[Callable[[Mapping[str, Any]], int]] = None,
    volatile: Optional[Mapping[str, Callable[[str, str, Any], Any]]] = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare an op from a typed function (its signature is the schema, its docstring the doc).

    Returns the public dispatching function. ``dtype_from`` names the parameter whose dtype is the
    op's dtype (default: the first tensor parameter).
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__
        if name in OPS:
            raise ValueError(f"op {name!r} is declared twice")
        params = _params_of(fn)
        for m in list(mutates) + list(volatile or {}):
            if m not in {p.name for p in params}:
                raise ValueError(f"op {name!r}: mutates or volatile names an unknown parameter {m!r}")
        first_tensor = next((p.name for p in params if p.kind in (Kind.TENSOR, Kind.TENSOR_LIST)), "")
        decl = OpDecl(
            name=name,
            signature=_signature_text(fn),
            dtypes=tuple(dtypes),
            tolerances=dict(tolerances),
            doc=inspect.cleandoc(fn.__doc__ or ""),
            params=params,
            backward=backward,
            forward=forward,
            mutates=tuple(mutates),
            dtype_from=dtype_from or first_tensor,
            unbatched=unbatched,
            reduction=reduction,
            volatile=dict(volatile or {}),
        )
        OPS[name] = decl
        from hal.dispatch import make_entry  # the dispatcher imports this module

        entry = make_entry(decl, fn)
        decl.entry = entry
        return entry

    return wrap


def attach_decorators(entry: Any, decl: OpDecl) -> None:
    """Give an op's public function the ``checker`` and ``composite`` decorators and its ``op``."""

    def checker(fn: Callable[..., Optional[Mapping[str, Any]]]) -> Callable[..., Any]:
        """Register the op's argument checker.

        It is called with the arguments of a call (positionally, in schema order) before any kernel
        runs, raises :class:`hal.InvalidArgumentError` for bad input, and returns a mapping of
        canonical values for static parameters (``{"stride": (1, 1)}``) or None. Its result is
        cached with the dispatch decision, so it runs once per distinct input signature.
        """
        _check_same_parameters(decl, fn, "checker")
        decl.check = fn
        return fn

    def composite(fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register a decomposition of the op into other ops (called with canonical arguments)."""
        _check_same_parameters(decl, fn, "composite")
        decl.composite = fn
        return fn

    entry.op = decl
    entry.checker = checker
    entry.composite = composite


def _check_same_parameters(decl: OpDecl, fn: Callable[..., Any], what: str) -> None:
    names = tuple(inspect.signature(fn).parameters)
    if names != decl.param_names:
        raise TypeError(
            f"{what} {fn.__qualname__} of op {decl.name} takes parameters {names}; "
            f"the declaration has {decl.param_names}"
        )


def check_kernel_signature(decl: OpDecl, fn: Callable[..., Any]) -> Optional[str]:
    """Why ``fn`` cannot be a kernel of ``decl`` (None when it can): same parameter names, in order.

    Kernels are called positionally with the canonical arguments, so names and order must match the
    declaration; keyword-only parameters of the declaration are positional in kernels.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        return f"cannot read its signature ({exc})"
    names = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return f"parameter {p.name} is variadic; kernels take exactly the declared parameters"
        if p.kind == p.KEYWORD_ONLY:
            return f"parameter {p.name} is keyword-only; kernels are called positionally"
        names.append(p.name)
    if tuple(names) != decl.param_names:
        return f"takes parameters {tuple(names)}, but op {decl.name} declares {decl.param_names}"
    return None
