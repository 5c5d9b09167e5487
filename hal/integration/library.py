"""Every hal op as ``torch.ops.hal.<name>``: torch.library operators with fake kernels and autograd.

Why: a model that calls ``hal.ops.*`` must compile (``torch.compile`` with ``fullgraph=True``), and
compile well. Dynamo cannot trace into the dispatcher and its NumPy kernels, so under compile a
``hal.ops.<name>`` call becomes one ``torch.ops.hal.<name>_decide`` node. That operator is
``CompositeImplicitAutograd``: AOTAutograd runs its body on fake tensors while it traces the graph,
and there the dispatcher decides (:func:`hal.integration.compile.traced_kernel`). A kernel made of torch's ops
(registered ``differentiable``) runs, so its ops join the graph: Inductor fuses them with the code
around them and AOTAutograd derives their backward, as for a model without hal; a decomposition
(the training decomposition of a call needing autograd) runs its ops, each decided in turn. Any
other call becomes the opaque ``torch.ops.hal.<name>`` node. Its fake kernel is the op's fake rule
(``@op.fake`` in its declaration); its autograd formula calls the backward op, itself a
``torch.ops.hal`` node, with the arguments :mod:`hal.gradients` reads off the declarations. When the
compiled code runs, a node runs the op's kernel route (:func:`hal.integration.compile.direct`). Eager calls
never come here: they take the dispatcher's direct path or :mod:`hal.integration.autograd`.

Operators are registered as ops are declared (:func:`register_op`, which :func:`hal.wiring.wire`
subscribes with :func:`hal.registry.on_declare`), so an op declared in any module, after ``import
hal``, is a torch operator at once; a forward's autograd formula is attached as soon as both it and
its backward op exist.

How a hal signature becomes a torch schema (each parameter keeps its name): :mod:`hal.integration.schema`.

Trainable ops that mutate (batch norm's running statistics, written when ``mutates_when`` holds)
cannot carry an autograd formula themselves (torch requires functional operators for that), so each
has a functional twin ``<name>_functional`` returning the output and the updated statistics; the
mutating operator is a ``CompositeImplicitAutograd`` kernel calling the twin and copying the
statistics back in place. Autograd and torch.compile's functionalisation both see the twin.

With dynamic shapes the fake kernels run the op's checker on meta tensors of the sizes' hints (it
reads sizes as ints, which would specialise every dimension), and on the hints of symbolic numbers
(a float argument Dynamo does not specialise), while the fake rules compute with the symbolic
values; the kernels validate the real values when they run.

Limits: results are contiguous (a kernel's output is made so on this path, as the fake rules say);
backward ops have no autograd formula of their own (no double backward). Under autocast a call is
cast by its op's rule before the node (:func:`traced_call`), so the operators themselves are not
autocast ops.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional, Sequence

import torch

try:  # the size hint of a symbolic int; older torch versions name it hint_int
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # pragma: no cover - depends on the torch version
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint

from hal import config
from hal.dispatch import autocast, needs_autograd
from hal.gradients import OUT, gradients_of
from hal.registry import OPS, OpDecl

from hal.errors import HalError, UnsupportedError

from . import kept
from .compile import direct, traced_kernel
from .errors import while_tracing
from .schema import Codec, TorchOp, codec, returns

NAMESPACE = "hal"


_LIB: Optional[torch.library.Library] = None
#: The registered operators by hal op name.
TORCH_OPS: dict[str, TorchOp] = {}
_LOCK = threading.RLock()


_CHANNELS_LAST = torch.channels_last


def _layout_of(slots: Sequence[Any]) -> torch.memory_format:
    """The memory format of an operator's 4-D results: channels_last when its first tensor argument
    is a 4-D channels_last tensor (as torch's own kernels keep it), else contiguous. The fake
    kernels and the operators apply this one rule, so their strides agree by construction; a
    channels_last network under torch.compile then stays channels_last through hal's operators
    (no layout copy per operator, and no mix of layouts for Inductor's kernels around them)."""
    for s in slots:
        if isinstance(s, torch.Tensor):
            if s.dim() == 4 and not s.is_contiguous() and s.is_contiguous(memory_format=_CHANNELS_LAST):
                return _CHANNELS_LAST
            return torch.contiguous_format
    return torch.contiguous_format


def _format_of(result: torch.Tensor, layout: torch.memory_format) -> torch.memory_format:
    """One result's memory format under :func:`_layout_of`: 4-D tensors in ``layout``, others contiguous."""
    return layout if result.dim() == 4 else torch.contiguous_format


def _in_layout(out: Any, layout: torch.memory_format) -> Any:
    """Results laid out as :func:`_format_of` says (the fake kernels' side of the rule)."""
    if isinstance(out, (tuple, list)):
        return tuple(_in_layout(o, layout) for o in out)
    if not isinstance(out, torch.Tensor):
        return out
    return out.contiguous(memory_format=_format_of(out, layout))


def _distinct(out: Any, slots: Sequence[Any]) -> Any:
    """A torch operator must not return its inputs or views of them: copy such outputs; and lay
    outputs out as the fake kernels describe them (:func:`_layout_of`)."""
    layout = _layout_of(slots)
    return _distinct_in(out, slots, layout)


def _distinct_in(out: Any, slots: Sequence[Any], layout: torch.memory_format) -> Any:
    if isinstance(out, (tuple, list)):
        return tuple(_distinct_in(o, slots, layout) for o in out)
    if not isinstance(out, torch.Tensor):
        return out
    fmt = _format_of(out, layout)
    ptr = out.untyped_storage().data_ptr()
    for s in slots:
        if isinstance(s, torch.Tensor) and s.numel() and s.untyped_storage().data_ptr() == ptr:
            return out.clone(memory_format=fmt)
    return out.contiguous(memory_format=fmt)


# --- fake kernels -------------------------------------------------------------------------------


_SYMBOLS = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _symbolic(v: Any) -> bool:
    """Whether a traced argument is symbolic: a tensor with symbolic sizes, or a number Dynamo made
    a symbol of (a float argument under ``dynamic=True``: torch 2.13 does not specialise floats)."""
    if isinstance(v, (list, tuple)):
        return any(map(_symbolic, v))
    if isinstance(v, _SYMBOLS):
        return True
    return isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape)


def _probe(v: Any) -> Any:
    """A tensor with symbolic sizes as a meta tensor of their hints, a symbolic number as its hint
    (lists too); others as they are. Nothing is guarded on: the kernels check the real values."""
    if isinstance(v, (list, tuple)):
        return type(v)(map(_probe, v))
    if isinstance(v, _SYMBOLS):
        hint = getattr(getattr(v, "node", None), "hint", None)
        return v if hint is None else type(hint)(hint)
    if isinstance(v, torch.Tensor) and _symbolic(v):
        return torch.empty([optimization_hint(s) for s in v.shape], dtype=v.dtype, device="meta")
    return v


def canonical(decl: OpDecl, args: tuple) -> dict[str, Any]:
    """A traced call's arguments by name, validated and with the checker's canonical static values
    (on fake tensors: the same hal error as in eager, at compile time)."""
    named = decl.bind(args)
    if decl.check is not None:
        probe = tuple(map(_probe, args)) if _symbolic(args) else args
        named.update(decl.check(*probe) or {})
    return named


def _fake_rule(decl: OpDecl) -> Callable[[dict[str, Any]], Any]:
    """The op's fake rule; an op declared without one (``hal.library.declare`` without ``@op.fake``)
    is refused with an UnsupportedError that reaches the user through torch.compile (Dynamo's own
    wrapping of a NotImplementedError drops the message)."""
    if decl.fake is None:
        raise while_tracing(UnsupportedError(
            f"op {decl.name} declares no fake rule, so it cannot run under torch.compile or on meta tensors: add one with "
            f"@hal.ops.{decl.name}.fake (a function of the arguments by name returning empty results of the right shape, "
            "dtype and device), or call it outside torch.compile"))
    return decl.fake


def _checked(decl: OpDecl, args: tuple) -> dict[str, Any]:
    """:func:`canonical` in a fake kernel: a hal error raised as one torch.compile lets reach the
    user as a hal error (:mod:`hal.integration.errors`)."""
    try:
        return canonical(decl, args)
    except HalError as exc:
        raise while_tracing(exc) from exc.__cause__


def _fake_kernel(top: TorchOp) -> Callable[..., Any]:
    decl = top.decl

    def fake(*slots: Any) -> Any:
        return _in_layout(_fake_rule(decl)(_checked(decl, top.decode(slots))), _layout_of(slots))

    return fake


def _fake_twin_kernel(top: TorchOp, mutated: list[str]) -> Callable[..., Any]:
    """The fake kernel of a functional twin: the result, then each mutated array's new value
    (empty when the op does not write it)."""
    decl = top.decl

    def fake(*slots: Any) -> Any:
        a = _checked(decl, top.decode(slots))
        out = _in_layout(_fake_rule(decl)(a), _layout_of(slots))
        writes = decl.writes(a)
        fresh = [a[n].new_empty(a[n].shape) if (writes and a[n] is not None) else out.new_empty(0) for n in mutated]
        return (out, *fresh)

    return fake


# --- registration -------------------------------------------------------------------------------


def _untraced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An operator's Python body, which Dynamo must never trace: it runs hal's dispatcher (or, on
    fake tensors, hal's decisions), never code for a graph. Dynamo does not trace into operators,
    but after a graph break it runs the breaking call eagerly with frame evaluation still on, and
    would compile the frames of a body called there, in which ``hal.ops`` would think itself traced
    and call the operator again, without end. ``torch.compiler.disable`` turns frame evaluation off
    for the call (about 0.7 us a call on the CI machine); it is made on the first call that finds
    Dynamo imported (before, nothing can be compiling: ``import hal`` imports neither Dynamo nor,
    through it, Triton)."""
    disabled: list[Callable[..., Any]] = []

    def body(*slots: Any) -> Any:
        # is_compiling() first: where Dynamo traces this body, a test of sys.modules iterates it
        # while another thread may import ("dictionary changed size during iteration", seen in CI)
        if not disabled and not torch.compiler.is_compiling() and "torch._dynamo" not in sys.modules:
            return fn(*slots)
        if not disabled:
            disable = getattr(torch.compiler, "disable", None) or torch._dynamo.disable
            disabled.append(disable(fn, recursive=True))
        return disabled[0](*slots)

    return body



def _library() -> torch.library.Library:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(NAMESPACE, "DEF")
    return _LIB


def _define(decl: OpDecl) -> TorchOp:
    """Define ``hal::<name>`` (and its functional twin where needed), its kernel and fake kernel,
    and ``hal::<name>_decide``."""
    top = _define_kernel(decl)
    _define_decide(top)
    return top


def _define_decide(top: TorchOp) -> None:
    """``hal::<name>_decide``, the node Dynamo records for a call: a ``CompositeImplicitAutograd``
    operator, so AOTAutograd runs its body on fake tensors as it traces the graph. There the
    dispatcher decides; a kernel made of torch's ops runs, its ops join the graph (Inductor fuses
    them with their neighbours, AOTAutograd derives their backward); a decomposition runs its ops,
    each a ``_decide`` node in turn; any other call becomes the opaque ``hal::<name>`` node (also
    with symbolic sizes, whose decision would specialise them)."""
    decl = top.decl
    name = f"{decl.name}_decide"

    def decide_impl(*slots: Any) -> Any:
        run = None if _symbolic(slots) else traced_kernel(decl, top.decode(slots))
        if run is None:
            return top.opaque(*slots)
        return run()

    _library().define(f"{name}({top.schema_args()}) -> {returns(decl)}")
    _library().impl(name, _untraced(decide_impl), "CompositeImplicitAutograd")
    top.decide = getattr(getattr(torch.ops, NAMESPACE), name).default


def _direct(decl: OpDecl, args: tuple) -> Any:
    """The kernel route of an opaque node's call. A trainable op's forward keeps for its backward op
    (hal.integration.kept): a compiled graph's backward calls that op, and which calls have one to come is not
    known where the node runs."""
    if not decl.trainable:
        return direct(decl, args)
    previous = kept.arm(True)
    try:
        return direct(decl, args)
    finally:
        kept.arm(previous)


def _define_kernel(decl: OpDecl) -> TorchOp:
    """``hal::<name>``: the opaque operator running the op's kernel route, with its fake kernel and
    (trainable ops) autograd; a mutating trainable op's functional twin."""
    lib = _library()
    letters = {name: "abcdefgh"[i] for i, name in enumerate(decl.mutates)}
    top = TorchOp(decl, tuple(codec(decl, p, letters.get(p.name)) for p in decl.params))
    packet = getattr(torch.ops, NAMESPACE)
    lib.define(f"{decl.name}({top.schema_args()}) -> {returns(decl)}")

    if not (decl.trainable and decl.mutates):

        def impl(*slots: Any) -> Any:
            return _distinct(_direct(decl, top.decode(slots)), slots)

        lib.impl(decl.name, _untraced(impl), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{decl.name}", _fake_kernel(top), lib=lib)
        top.overload = getattr(packet, decl.name).default
        top.autograd_name = f"{NAMESPACE}::{decl.name}" if decl.trainable else None
        return top

    twin = f"{decl.name}_functional"
    mutated = [n for n in decl.param_names if n in decl.mutates]
    lib.define(f"{twin}({top.schema_args(functional=True)}) -> (Tensor{', Tensor' * len(mutated)})")

    def twin_impl(*slots: Any) -> Any:
        args = list(top.decode(slots))
        writes = decl.writes(decl.bind(args))
        fresh = []
        for name in mutated:
            i = decl.index(name)
            if writes and args[i] is not None:
                args[i] = args[i].clone()
            fresh.append(args[i] if writes else None)
        out = _distinct(_direct(decl, tuple(args)), slots)
        return (out, *(f if f is not None else out.new_empty(0) for f in fresh))

    lib.impl(twin, _untraced(twin_impl), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{twin}", _fake_twin_kernel(top, mutated), lib=lib)
    top.overload = getattr(packet, twin).default
    top.autograd_name = f"{NAMESPACE}::{twin}"

    def mutating_impl(*slots: Any) -> Any:
        results = top.overload(*slots)
        if decl.writes(decl.bind(top.decode(slots))):
            for name, new in zip(mutated, results[1:]):
                target = top.slot(slots, name)
                if target is not None:
                    target.copy_(new.detach())
        return results[0]

    lib.impl(decl.name, _untraced(mutating_impl), "CompositeImplicitAutograd")
    top.mutating = getattr(packet, decl.name).default
    return top


def _register_autograd(top: TorchOp, bwd: TorchOp) -> None:
    """Autograd of ``top`` through its backward op ``bwd`` (called as a torch operator), with the
    arguments :class:`hal.gradients.Gradients` reads off the declarations."""
    decl = top.decl
    spec = gradients_of(decl)
    twin = top.mutating is not None

    extra = decl.nondifferentiable_results  # results after the first without gradient (an amax)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        args = top.decode(inputs)
        out = output[0] if (twin or extra) else output
        values = spec.saved(decl.bind(args), out)
        where = [j for j, v in enumerate(values) if isinstance(v, torch.Tensor)]
        if twin or extra:
            ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(*(values[j] for j in where))
        ctx.hal = (values, where, [isinstance(args[decl.index(n)], torch.Tensor) for n in decl.gradients])

    def backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple:
        values, where, given = ctx.hal
        values = list(values)
        for j, t in zip(where, ctx.saved_tensors):
            values[j] = t
        bargs, batched = spec.call(grad_out, values)
        grads = spec.results(bwd.overload(*bwd.encode(bargs)), batched)
        out: list = [None] * len(top.slot_names)
        for name, ok in zip(decl.gradients, given):
            if ok:
                out[top.offsets[name]] = grads.get(name)
        return tuple(out)

    torch.library.register_autograd(top.autograd_name, backward, setup_context=setup_context, lib=_library())
    top.has_autograd = True


def _link_autograd(decl: OpDecl) -> None:
    """Attach the autograd formulas that have become possible with ``decl`` registered."""
    top = TORCH_OPS[decl.name]
    if decl.trainable and not top.has_autograd and decl.backward in TORCH_OPS:
        _register_autograd(top, TORCH_OPS[decl.backward])
    if decl.forward is not None:
        # its forward op, and any op that extends it with results without gradient (rms_norm_amax
        # names rms_norm_backward), registered before it
        for other in TORCH_OPS.values():
            if other.decl.backward == decl.name and other.autograd_name and not other.has_autograd:
                _register_autograd(other, top)


def register_op(decl: OpDecl) -> None:
    """Make ``decl`` ``torch.ops.hal.<name>`` (with its autograd formula, where its backward op is
    registered too): :func:`hal.wiring.wire` calls it for every op, as it is declared. A backward op
    declared before its forward op is registered with its forward op."""
    with _LOCK:
        if decl.name in TORCH_OPS:
            return
        if decl.forward is not None and decl.forward not in OPS:
            return  # a backward op declared before its forward: registered with the forward
        TORCH_OPS[decl.name] = _define(decl)
        _link_autograd(decl)
        if decl.trainable and decl.backward in OPS and decl.backward not in TORCH_OPS:
            register_op(OPS[decl.backward])


# --- routing under torch.compile ----------------------------------------------------------------


_SCOPES = config.RUN_TIME_SCOPES


def traced_call(decl: OpDecl, args: tuple) -> Any:
    """``hal.ops.<name>`` under torch.compile: one ``torch.ops.hal.<name>_decide`` node, whose route
    (kernel, the torch ops of a kernel, or the op's training decomposition) is chosen as AOTAutograd
    traces the graph; written so that Dynamo traces it without a graph break, and reads little (each
    read is a guard checked on every call of the compiled code). Inside a ``hal.use`` scope (which
    Dynamo guards on; not a scope that only ranks kernels, such as ``hal.graphs.device_bound``, whose
    ranking the trace's decisions follow) the call is the training decomposition where eager takes
    it, else the opaque ``torch.ops.hal.<name>`` node, deciding as each run of the compiled code
    reaches it, so that the scope of that run is obeyed. Under ``torch.autocast`` the arguments are cast by the op's rule
    and the node runs with autocast off, as an eager call does (:mod:`hal.dispatch.autocast`)."""
    kind = autocast.device_type(decl, args)
    if kind is None:
        return _traced_node(decl, args)
    args = autocast.cast(decl, args, kind)
    with torch.autocast(kind, enabled=False):
        return _traced_node(decl, args)


def _traced_node(decl: OpDecl, args: tuple) -> Any:
    """The graph node(s) of a traced call (see :func:`traced_call`)."""
    top = TORCH_OPS[decl.name]
    if not _SCOPES[0]:
        return top.decide(*top.encode(args))
    if decl.trainable and needs_autograd(args):
        named = canonical(decl, args)
        composite = decl.training_composite(named)
        if composite is not None:
            return composite(*(named[n] for n in decl.param_names))
    return top.opaque(*top.encode(args))


__all__ = ["TORCH_OPS", "TorchOp", "Codec", "canonical", "register_op", "traced_call", "OUT"]
