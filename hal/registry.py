"""Op declarations: the single home of everything hal knows about an op.

An op is declared once, in ``ops/``, as a typed Python function whose signature is its schema::

    @declare(dtypes=FLOATS, tolerances=MATMUL_TOLERANCES, backward="matmul_backward", gradients=("a", "b"))
    def matmul(a: Tensor, b: Tensor) -> Tensor:
        \"\"\"Matrix product with broadcasting, as torch.matmul.\"\"\"

``declare`` records an :class:`OpDecl` and returns the public, dispatching function that users
call as ``hal.ops.matmul``. That function carries decorators for the rest of the declaration:

- ``@matmul.checker``: validates a call and returns canonical static values;
- ``@matmul.fake``: the shapes, dtypes and devices of the results (the meta rule torch.compile
  traces with, and what ``hal.explain`` follows a decomposition with);
- ``@matmul.composite(...)``: a decomposition into other ops, used where no kernel runs the inputs
  (``fallback=True``) and/or where a call needs autograd (``training=True``, optionally ``when`` a
  predicate of the canonical arguments holds);
- ``@matmul.empty``: the results for inputs with a zero-size dimension (kernels never see those);
- ``@matmul.values``: a check of argument values run on every call whose arrays are in host memory.

A declaration is *open* while the module declaring it attaches these, and *sealed* (immutable:
assigning a field raises :class:`dataclasses.FrozenInstanceError`, and so does a decorator) once it
is registered with the dispatcher: hal's own ops when ``import hal`` completes
(:func:`hal.wiring.wire` seals every op declared by then), an op declared later (``hal.library``)
by its first call, its first ``hal.explain`` or its first trace. What the dispatcher caches for a
call is therefore made from the declaration every later call sees.

The core reads these fields and nothing else about an op: it holds no table keyed by op names. This
module imports neither the dispatcher nor the torch integration: :func:`hal.wiring.wire` installs
the dispatcher's builder of public functions (:func:`set_entry_factory`) and subscribes the torch
integration to every declaration (:func:`on_declare`) before hal's own ops are declared.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, Callable, Mapping, Optional, Sequence, Union

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


#: canonical arguments by parameter name, as rules and predicates of a declaration receive them.
Named = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Decomposition:
    """One decomposition of an op into other ops (called with canonical arguments, positionally).

    ``fallback``: runs where no kernel of a backend can run the inputs. ``training``: runs instead
    of the op's own kernel when a call needs autograd (each op inside then saves what its own
    backward needs), where ``when`` (a predicate of the canonical arguments) holds or is None.
    ``rounds``: for a decomposition whose steps hand each other results in the op's dtype, the
    intermediate value (from the arguments by name) that is rounded there; conformance allows the
    op's result one more rounding of it (linear's ``x @ weight.T`` before its bias: where the two
    cancel, that rounding dominates the result's error, as in unfused eager code).
    """

    fn: Callable[..., Any]
    fallback: bool = True
    training: bool = False
    when: Optional[Callable[[Named], bool]] = None
    rounds: Optional[Callable[[Named], Any]] = None

    def for_training(self, named: Named) -> bool:
        return self.training and (self.when is None or bool(self.when(named)))


@dataclasses.dataclass(frozen=True)
class Autocast:
    """How an op behaves under ``torch.autocast``: as the PyTorch function it names does there
    (API.md: the result dtype is that function's under the same autocast, eagerly and compiled).

    ``policy`` is torch's cast policy for that function: ``"lower"`` (torch's lower_precision_fp:
    the floating tensors among ``args`` are cast to the autocast dtype, as for ``F.linear``,
    ``torch.matmul``, ``F.conv2d``, SDPA) or ``"fp32"`` (cast to float32, as for
    ``F.cross_entropy``, and for ``F.layer_norm`` and ``F.softmax`` on CUDA). ``args``: the parameters
    cast (None: every tensor parameter); float64 tensors and tensors on another device type stay as
    they are, as torch leaves them. ``devices``: the device types (``"cpu"``, ``"cuda"``; ROCm is
    ``"cuda"`` to torch) where the policy holds, None for every one: torch's CPU and CUDA lists
    differ. An op without a rule is not an autocast op (torch's fallthrough): its kernels run on the
    arrays as given. Either way its kernels run with autocast disabled, as torch's autocast wrappers
    run the op they wrap (:mod:`hal.dispatch.autocast`)."""

    policy: str
    args: Optional[tuple[str, ...]] = None
    devices: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        if self.policy not in ("lower", "fp32"):
            raise ValueError(f"autocast policy must be 'lower' or 'fp32', not {self.policy!r}")


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
    #: for a trainable op: the parameters its backward op returns gradients for, in the order of the
    #: backward's results; ``single_gradient`` when the backward returns one tensor, not a tuple.
    gradients: tuple[str, ...] = ()
    single_gradient: bool = False
    #: for a backward op, the name of its forward op.
    forward: Optional[str] = None
    #: a trainable op returning a tuple: how many of its results, after the first, carry no gradient
    #: (a statistic reduced beside the output, such as rms_norm_amax's amax). Autograd marks them
    #: non-differentiable; the backward op receives the first result's gradient only. A forward op
    #: declared so may name the backward op of the op it extends (rms_norm_amax: rms_norm_backward).
    nondifferentiable_results: int = 0
    #: parameters written in place by the op.
    mutates: tuple[str, ...] = ()
    #: a static parameter: the op writes its ``mutates`` only when this argument is true (batch
    #: norm's running statistics, written in training). None: whenever it runs.
    mutates_when: Optional[str] = None
    #: the ``mutates`` parameters are running statistics, written as torch's batch norm writes
    #: them: in place without a bump of autograd's version counter. Torch's batch-norm node saves
    #: them, so a bump would fail the backward of a module applied twice (or recomputed by
    #: activation checkpointing) before one backward, where torch's own runs. hal counts these
    #: writes itself (:func:`hal.arrays.writes_of`), for caches derived from the statistics.
    mutates_statistics: bool = False
    #: the parameter whose dtype is "the op's dtype" (kernels declare supported dtypes against it).
    dtype_from: str = ""
    #: a rank at which the input named by ``unbatched[0]`` is unbatched: it gets a batch dimension
    #: before the kernel runs and the output loses it again (conv2d's CHW inputs).
    unbatched: Optional[tuple[str, int]] = None
    #: two gradient parameters often passed as the halves of one tensor's last dimension
    #: (``gate, up = h.chunk(2, -1)``): then the autograd node differentiates that tensor, and a
    #: backward kernel that writes both gradients into one buffer of its shape spares the backward
    #: a concatenation (:func:`hal.arrays.halves_of`, :mod:`hal.integration.autograd`).
    halves: Optional[tuple[str, str]] = None
    #: reduction length K of a call (canonical arguments by name), used to widen tolerances.
    reduction: Optional[Callable[[Named], int]] = None
    #: what the op does under torch.autocast (None: not an autocast op; see :class:`Autocast`).
    autocast: Optional[Autocast] = None
    #: the op's time is arithmetic, not memory traffic (a GEMM, convolution or attention): selective
    #: activation recomputation keeps its output (:mod:`hal.nn.recompute`). Ops that autocast lowers
    #: are compute-bound by that rule (see :attr:`compute_bound`); this declares the others (the FP8
    #: and int8 GEMMs, which take quantised operands and so are on no autocast list).
    declared_compute_bound: bool = False
    #: parameters whose values change from call to call (a learning rate, a step count): the decision
    #: cache keys them by type only, and these validators (op, name, value) -> canonical value check
    #: them on every call instead of once per input signature.
    volatile: Mapping[str, Callable[[str, str, Any], Any]] = dataclasses.field(default_factory=dict)
    #: validates a call and returns canonical values for static parameters (see ``checker``).
    check: Optional[Callable[..., Optional[Mapping[str, Any]]]] = None
    #: the results' shapes, dtypes and devices from canonical arguments (see ``fake``).
    fake: Optional[Callable[[Named], Any]] = None
    #: the results for inputs with a zero-size dimension (see ``empty``).
    empty: Optional[Callable[[Named], Any]] = None
    #: a check of argument values (not only shapes and dtypes) run on every call whose arrays are in
    #: host memory, where reading them is free (see ``values``).
    values: Optional[Callable[[Named], None]] = None
    #: decompositions into other ops (see ``composite``).
    decompositions: tuple[Decomposition, ...] = ()
    #: the public function (set by ``declare``).
    entry: Optional[Callable[..., Any]] = None
    #: the module that declared the op: its family module (``hal.ops.conv``) for hal's own ops,
    #: which :mod:`hal.ops` finds and orders by family (:func:`arrange`).
    module: str = ""

    @property
    def compute_bound(self) -> bool:
        """Whether the op's time is arithmetic: declared so, or an op autocast lowers (linear,
        matmul, attention, convolution: autocast's lower-precision list is torch's list of
        compute-bound operators)."""
        return self.declared_compute_bound or (self.autocast is not None and self.autocast.policy == "lower")

    @property
    def trainable(self) -> bool:
        return self.backward is not None

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def fallback_composite(self) -> Optional[Callable[..., Any]]:
        """The decomposition used where no kernel can run the inputs (None: the op has none)."""
        fallback = self.fallback_decomposition
        return fallback.fn if fallback is not None else None

    @property
    def fallback_decomposition(self) -> Optional[Decomposition]:
        return next((d for d in self.decompositions if d.fallback), None)

    def training_composite(self, named: Named) -> Optional[Callable[..., Any]]:
        """The decomposition a call needing autograd runs instead of the op (None: the op itself)."""
        return next((d.fn for d in self.decompositions if d.for_training(named)), None)

    def index(self, name: str) -> int:
        """Position of a parameter in the canonical argument tuple."""
        return self.param_names.index(name)

    def bind(self, args: Sequence[Any]) -> dict[str, Any]:
        """Arguments by parameter name."""
        return dict(zip(self.param_names, args))

    def writes(self, named: Named) -> bool:
        """Whether a call with these canonical arguments writes the ``mutates`` parameters."""
        return bool(self.mutates) and (self.mutates_when is None or bool(named[self.mutates_when]))

    def __repr__(self) -> str:
        return f"<op {self.name}{self.signature}>"

    # --- sealing: immutable once registered ------------------------------------------------------

    @property
    def sealed(self) -> bool:
        """Whether the declaration is complete and immutable (see the module docstring)."""
        return self.__dict__.get("_sealed", False)

    def seal(self) -> None:
        """Make the declaration immutable (again a no-op once sealed): its fields can no longer be
        assigned, its tables no longer changed, and its decorators raise."""
        if self.sealed:
            return
        object.__setattr__(self, "tolerances", types.MappingProxyType(dict(self.tolerances)))
        object.__setattr__(self, "volatile", types.MappingProxyType(dict(self.volatile)))
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        self._refuse_if_sealed(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._refuse_if_sealed(name)
        object.__delattr__(self, name)

    def _refuse_if_sealed(self, name: str) -> None:
        if self.sealed:
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field {name!r} of op {self.name}: its declaration is sealed (registered with the dispatcher "
                f"when `import hal` completed, or by the first call of an op declared later); complete a declaration, "
                f"@{self.name}.checker, .fake, .composite, .empty, .values included, where the op is declared, before its first call")

    def __copy__(self) -> "OpDecl":
        return self  # a declaration is one object: decisions are cached by its identity

    def __deepcopy__(self, memo: dict) -> "OpDecl":
        return self

    def __reduce__(self) -> tuple:
        return get_op, (self.name,)  # pickled by name: the receiving process has its own declaration


#: Every declared op, by name, in declaration order.
OPS: dict[str, OpDecl] = {}

#: called with each new declaration, after its public function exists (see :func:`on_declare`).
_LISTENERS: list[Callable[[OpDecl], None]] = []
#: builds the public function of a declaration (the dispatcher's; see :func:`set_entry_factory`).
_ENTRY_FACTORY: list[Callable[[OpDecl, Callable[..., Any]], Callable[..., Any]]] = []


def get_op(name: str) -> OpDecl:
    """The declaration of an op; raises KeyError with the known names when there is none."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"no op named {name!r}; declared ops: {', '.join(sorted(OPS))}") from None


def on_declare(listener: Callable[[OpDecl], None]) -> None:
    """Call ``listener(decl)`` for every op declared from now on, and now for every op declared so
    far. Decorators (checker, fake, ...) may still be attached after the call: read them lazily."""
    _LISTENERS.append(listener)
    for decl in list(OPS.values()):
        listener(decl)


def set_entry_factory(factory: Callable[[OpDecl, Callable[..., Any]], Callable[..., Any]]) -> None:
    """Install the function that builds an op's public function (:func:`hal.wiring.wire` installs
    the dispatcher's, :func:`hal.dispatch.entry.make_entry`)."""
    _ENTRY_FACTORY[:] = [factory]


def arrange(names: Sequence[str]) -> None:
    """Put the ops ``names`` first in :data:`OPS`, in that order, and the others after them in the
    order they were declared. :func:`hal.wiring.wire` gives hal's own ops the order of their
    families (:data:`hal.ops.NAMES`), whatever order their modules were imported in."""
    unknown = [n for n in names if n not in OPS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"hal.registry.arrange: names must be declared ops, each once; unknown {unknown}, given {list(names)}")
    first = set(names)
    ordered = [(n, OPS[n]) for n in names] + [(n, d) for n, d in OPS.items() if n not in first]
    OPS.clear()
    OPS.update(ordered)


def seal_declared() -> None:
    """Seal every op declared so far (:func:`hal.wiring.wire`, once hal's own ops are declared)."""
    for decl in list(OPS.values()):
        decl.seal()


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
    gradients: Union[str, Sequence[str], None] = None,
    forward: Optional[str] = None,
    mutates: Sequence[str] = (),
    mutates_when: Optional[str] = None,
    mutates_statistics: bool = False,
    dtype_from: Optional[str] = None,
    unbatched: Optional[tuple[str, int]] = None,
    halves: Optional[tuple[str, str]] = None,
    reduction: Optional[Callable[[Named], int]] = None,
    volatile: Optional[Mapping[str, Callable[[str, str, Any], Any]]] = None,
    autocast: Optional[Autocast] = None,
    compute_bound: bool = False,
    nondifferentiable_results: int = 0,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare an op from a typed function (its signature is the schema, its docstring the doc).

    Returns the public dispatching function. A trainable op names its ``backward`` op and the
    ``gradients`` that op returns (a tuple of parameter names, or one name when it returns a single
    tensor). ``dtype_from`` names the parameter whose dtype is the op's dtype (default: the first
    tensor parameter). ``autocast``: the op's cast policy under ``torch.autocast`` (:class:`Autocast`).
    ``compute_bound``: the op's time is arithmetic though autocast does not lower it (an FP8 or int8
    GEMM; see :attr:`OpDecl.compute_bound`). ``nondifferentiable_results``: a trainable op's results
    after the first that carry no gradient (:attr:`OpDecl.nondifferentiable_results`).
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__
        if name in OPS:
            raise ValueError(f"op {name!r} is declared twice")
        params = _params_of(fn)
        names = {p.name for p in params}
        grads = (gradients,) if isinstance(gradients, str) else tuple(gradients or ())
        cast = list(autocast.args or ()) if autocast is not None else []
        for m in [*mutates, *(volatile or {}), *grads, *([mutates_when] if mutates_when else []), *cast]:
            if m not in names:
                raise ValueError(f"op {name!r}: a field of its declaration names an unknown parameter {m!r}")
        kinds = {p.name: p.kind for p in params}
        if halves is not None and (len(set(halves)) != 2 or any(h not in grads or kinds[h] is not Kind.TENSOR for h in halves)):
            raise ValueError(f"op {name!r}: halves names two tensor parameters the backward returns gradients for")
        if (backward is None) != (not grads):
            raise ValueError(f"op {name!r}: a trainable op names both its backward op and the gradients it returns")
        if nondifferentiable_results and (backward is None or not isinstance(nondifferentiable_results, int) or nondifferentiable_results < 0):
            raise ValueError(f"op {name!r}: nondifferentiable_results counts results of a trainable op that carry no gradient")
        first_tensor = next((p.name for p in params if p.kind in (Kind.TENSOR, Kind.TENSOR_LIST)), "")
        decl = OpDecl(
            name=name,
            signature=_signature_text(fn),
            dtypes=tuple(dtypes),
            tolerances=dict(tolerances),
            doc=inspect.cleandoc(fn.__doc__ or ""),
            params=params,
            backward=backward,
            gradients=grads,
            single_gradient=isinstance(gradients, str),
            forward=forward,
            nondifferentiable_results=int(nondifferentiable_results),
            mutates=tuple(mutates),
            mutates_when=mutates_when,
            mutates_statistics=mutates_statistics,
            dtype_from=dtype_from or first_tensor,
            unbatched=unbatched,
            halves=tuple(halves) if halves else None,
            reduction=reduction,
            volatile=dict(volatile or {}),
            autocast=_autocast_of(autocast, params),
            declared_compute_bound=bool(compute_bound),
            module=getattr(fn, "__module__", None) or "",
        )
        if not _ENTRY_FACTORY:
            raise RuntimeError("hal.registry.declare needs the dispatcher's entry builder, which hal.wiring.wire installs: import hal first")
        entry = _ENTRY_FACTORY[0](decl, fn)
        attach_decorators(entry, decl)
        decl.entry = entry
        OPS[name] = decl  # hal.ops.<name> too, for an op declared outside ops/ (set there by hal.wiring)
        for listener in list(_LISTENERS):
            listener(decl)
        return entry

    return wrap


def _autocast_of(rule: Optional[Autocast], params: tuple[Param, ...]) -> Optional[Autocast]:
    """The rule with its ``args`` spelled out (every tensor parameter where it names none)."""
    if rule is None or rule.args is not None:
        return rule
    tensors = tuple(p.name for p in params if p.kind in (Kind.TENSOR, Kind.OPTIONAL_TENSOR))
    return dataclasses.replace(rule, args=tensors)


def attach_decorators(entry: Any, decl: OpDecl) -> None:
    """Give an op's public function its ``op`` and the decorators that complete its declaration."""

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

    def fake(fn: Callable[[Named], Any]) -> Callable[[Named], Any]:
        """Register the op's fake (meta) rule: from the canonical arguments by name, results with
        the shapes, dtypes and devices the kernels return (``x.new_empty(...)``), computing nothing.
        It must work on meta and fake tensors with symbolic sizes as well as on real tensors."""
        decl.fake = fn
        return fn

    def empty(fn: Callable[[Named], Any]) -> Callable[[Named], Any]:
        """Register the op's results for inputs with a zero-size dimension (canonical arguments by
        name); the dispatcher calls it instead of a kernel (API.md: what torch gives)."""
        decl.empty = fn
        return fn

    def values(fn: Callable[[Named], None]) -> Callable[[Named], None]:
        """Register a check of the values held by the op's arrays (a quantisation scale that is 0,
        say), called with the canonical arguments by name on every call whose arrays are in host
        memory, before the kernel; it raises hal.InvalidArgumentError. Device arrays are not read
        (that would synchronise with the device): their kernels handle bad values."""
        decl.values = fn
        return fn

    def composite(fn: Optional[Callable[..., Any]] = None, *, fallback: bool = True, training: bool = False,
                  when: Optional[Callable[[Named], bool]] = None, rounds: Optional[Callable[[Named], Any]] = None) -> Any:
        """Register a decomposition of the op into other ops (called with canonical arguments).

        ``@op.composite`` is the fallback where no kernel runs the inputs; ``@op.composite(training=True,
        fallback=False, when=...)`` a decomposition that calls needing autograd run instead of the op;
        ``rounds`` as in :class:`Decomposition`.
        """

        def register(f: Callable[..., Any]) -> Callable[..., Any]:
            _check_same_parameters(decl, f, "composite")
            decl.decompositions = (*decl.decompositions, Decomposition(f, fallback, training, when, rounds))
            return f

        return register(fn) if fn is not None else register

    entry.op = decl
    entry.checker = checker
    entry.fake = fake
    entry.empty = empty
    entry.values = values
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
