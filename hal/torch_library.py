"""Every hal op as ``torch.ops.hal.<name>``: torch.library operators with fake kernels and autograd.

Why: a model that calls ``hal.ops.*`` must train (autograd) and compile (``torch.compile`` with
``fullgraph=True``). Dynamo cannot trace into the dispatcher and its NumPy kernels, so under
compile every ``hal.ops.<name>`` call becomes one opaque ``torch.ops.hal.<name>`` node whose fake
kernel (:mod:`hal._torch_fake`) gives output shapes and dtypes; eager calls with grad-requiring
tensors take the same operator so that its registered autograd formula (the registry's
``<op>_backward`` op, itself ``torch.ops.hal.<op>_backward``) builds the graph. Eager calls without
autograd never come here: they keep the dispatcher's direct path.

How a hal signature becomes a torch schema (each parameter keeps its name):

- arrays: ``Tensor``, ``Tensor?``, ``Tensor[]``, ``Tensor[]?``; a parameter in ``decl.mutates`` gets
  an alias annotation (``Tensor(a!)``);
- a number-or-array (``ScalarOrTensor``) takes two slots, ``Tensor? <name>`` and
  ``Scalar? <name>_number``: exactly one is set, so ints stay ints and tensors stay tensors;
- static options: ``int``, ``float``, ``bool``, ``str`` (``?`` when optional); an int-or-pair
  (``IntPair``) travels as ``int[]`` (an int v as ``[v, v]``), a shape as ``int[]`` (an int v as
  ``[v]``), a conv padding as ``int[] padding, str? padding_mode`` ("same"/"valid" in the mode).
  These forms are equivalent for the op's checker, which runs on the decoded values.

Trainable ops that mutate (``batch_norm``, ``fused_conv_bn_relu`` update running statistics)
cannot carry an autograd formula themselves (torch requires functional operators for that), so each
has a functional twin ``<name>_functional`` returning the output and the updated statistics; the
mutating operator is a ``CompositeImplicitAutograd`` kernel calling the twin and copying the
statistics back in place. Autograd and torch.compile's functionalisation both see the twin.

Training decompositions: where the fused forward is the wrong trade for training, a call that needs
autograd runs a decomposition into differentiable hal ops instead (:data:`TRAINING_DECOMPOSITIONS`):

- ``linear`` with an activation: ``linear_backward`` recomputes the pre-activation GEMM; as
  ``linear(act="none")`` then ``scale_shift_act`` the backward reuses the saved pre-activation, which
  costs one elementwise pass instead of a GEMM.
- ``fused_conv_bn_relu``: its backward recomputes the convolution (one extra convolution per step);
  as ``conv2d`` -> ``batch_norm`` -> ``scale_shift_act(relu)`` the convolution output is saved instead
  (more activation memory, one convolution less). Without autograd the fused kernel runs.

Remove a name from :data:`TRAINING_DECOMPOSITIONS` to train through the fused op and its backward.

``import hal`` registers every op (about 30 ms): Dynamo cannot trace the registration, so it must
be done before a model is compiled. An op declared later is registered on its first autograd call
or by :func:`register`.

Limits: results are contiguous (a kernel's output is made so on this path, as the fake kernels
say); backward ops have no autograd formula of their own (no double backward); hal ops are not
autocast ops (``hal.nn`` modules cast their inputs under autocast).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from hal import _torch_fake
from hal.dispatch import DISPATCHER, _needs_autograd
from hal.ops import batch_norm, conv2d, linear, scale_shift_act
from hal.registry import OPS, OpDecl, Param
from hal.types import IntPair, Kind, Padding, ShapeLike

NAMESPACE = "hal"

#: Trainable ops whose result is computed by a decomposition into hal ops when autograd is needed
#: (see the module docstring for why). Edit this set to change the trade.
TRAINING_DECOMPOSITIONS: set[str] = {"linear", "fused_conv_bn_relu"}

#: For each trainable op: the forward parameters that its backward op returns gradients for, in the
#: order of the backward's results (a plain string: the backward returns a single tensor).
GRADIENTS: dict[str, Union[str, tuple[str, ...]]] = {
    "conv2d": ("x", "weight", "bias"),
    "batch_norm": ("x", "weight", "bias"),
    "fused_conv_bn_relu": ("x", "conv_weight", "conv_bias", "bn_weight", "bn_bias"),
    "scale_shift_act": ("x", "scale", "shift"),
    "linear": ("x", "weight", "bias"),
    "matmul": ("a", "b"),
    "grouped_gemm": ("x", "weight"),
    "layer_norm": ("x", "weight", "bias"),
    "rms_norm": ("x", "weight"),
    "softmax": "x",
    "scaled_dot_product_attention": ("q", "k", "v"),
    "fake_quantize": "x",
}

#: Mutating trainable ops write their mutated arguments only when this static option is true.
MUTATES_WHEN = {"batch_norm": "training", "fused_conv_bn_relu": "training"}


# --- from hal parameters to schema slots ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one hal parameter travels through a torch schema: its slots and the two conversions."""

    param: Param
    form: str  # "array", "number_or_array", "plain", "pair", "shape", "padding"
    slots: tuple[str, ...]  # schema text of each slot ("Tensor? scale", "Scalar? scale_number")

    @property
    def width(self) -> int:
        return len(self.slots)

    def encode(self, value: Any, out: list) -> None:
        """Append the slot values of ``value``."""
        form = self.form
        if form == "array" or form == "plain":
            out.append(value)
        elif form == "number_or_array":
            if isinstance(value, torch.Tensor) or value is None:
                out.append(value)
                out.append(None)
            else:
                out.append(None)
                out.append(value.item() if isinstance(value, np.generic) else value)
        elif form == "pair":
            out.append([value, value] if isinstance(value, int) else list(value))
        elif form == "shape":
            out.append([value] if isinstance(value, int) else list(value))
        else:  # padding
            if isinstance(value, str):
                out.append([])
                out.append(value)
            else:
                out.append([value, value] if isinstance(value, int) else list(value))
                out.append(None)

    def decode(self, slots: Sequence[Any]) -> Any:
        """The hal value of this parameter's slot values."""
        form = self.form
        if form == "array" or form == "plain":
            return slots[0]
        if form == "number_or_array":
            return slots[0] if slots[0] is not None else slots[1]
        if form == "padding" and slots[1] is not None:
            return slots[1]
        return tuple(slots[0])


_PLAIN_STATIC = {
    int: "int",
    float: "float",
    bool: "bool",
    str: "str",
    Optional[int]: "int?",
    Optional[float]: "float?",
    Optional[str]: "str?",
}
_SHAPED_STATIC = {IntPair: "pair", ShapeLike: "shape", Padding: "padding"}


def _codec(decl: OpDecl, p: Param, alias: Optional[str]) -> Codec:
    mut = f"({alias}!)" if alias else ""
    k = p.kind
    if k is Kind.TENSOR:
        return Codec(p, "array", (f"Tensor{mut} {p.name}",))
    if k is Kind.OPTIONAL_TENSOR:
        return Codec(p, "array", (f"Tensor{mut}? {p.name}",))
    if k is Kind.TENSOR_LIST:
        return Codec(p, "array", (f"Tensor{mut}[] {p.name}",))
    if k is Kind.OPTIONAL_TENSOR_LIST:
        return Codec(p, "array", (f"Tensor{mut}[]? {p.name}",))
    if k in (Kind.SCALAR_OR_TENSOR, Kind.OPTIONAL_SCALAR_OR_TENSOR):
        return Codec(p, "number_or_array", (f"Tensor? {p.name}", f"Scalar? {p.name}_number"))
    if p.annotation in _PLAIN_STATIC:
        return Codec(p, "plain", (f"{_PLAIN_STATIC[p.annotation]} {p.name}",))
    form = _SHAPED_STATIC.get(p.annotation)
    if form == "padding":
        return Codec(p, form, (f"int[] {p.name}", f"str? {p.name}_mode"))
    if form is not None:
        return Codec(p, form, (f"int[] {p.name}",))
    raise TypeError(
        f"hal.torch_library has no torch schema encoding for parameter {p.name!r} of op {decl.name} "
        f"(annotation {p.annotation!r}); add one to hal/torch_library.py (_PLAIN_STATIC or _SHAPED_STATIC)"
    )


def _returns(decl: OpDecl) -> str:
    """The schema's return type of an op."""
    if decl.forward is not None:  # a backward op: one gradient per differentiable forward input
        grads = GRADIENTS[decl.forward]
        return "Tensor" if isinstance(grads, str) else "(" + ", ".join(["Tensor"] * len(grads)) + ")"
    ret = getattr(decl.entry, "__annotations__", {}).get("return")
    return "()" if ret in (None, "None") else "Tensor"


# --- one registered operator ------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class TorchOp:
    """A hal op registered as a torch operator: its schema, codecs and the OpOverload to call."""

    decl: OpDecl
    codecs: tuple[Codec, ...]
    #: the overload called for this op (the functional twin's, for mutating trainable ops).
    overload: Any = None
    #: the mutating operator ``torch.ops.hal.<name>`` of an op with a functional twin.
    mutating: Any = None
    #: slot index of each parameter's first slot, by name.
    offsets: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        at = 0
        for c in self.codecs:
            self.offsets[c.param.name] = at
            at += c.width

    @property
    def slot_names(self) -> list[str]:
        return [s.split()[-1] for c in self.codecs for s in c.slots]

    def schema_args(self, functional: bool = False) -> str:
        """The schema's arguments; ``functional``: without alias annotations (the twin's)."""
        slots = [s for c in self.codecs for s in c.slots]
        if functional:
            slots = [re.sub(r"\([a-z]!\)", "", s) for s in slots]
        return ", ".join(slots)

    def encode(self, args: Sequence[Any]) -> list:
        out: list = []
        for c, a in zip(self.codecs, args):
            c.encode(a, out)
        return out

    def decode(self, slots: Sequence[Any]) -> tuple:
        at, out = 0, []
        for c in self.codecs:
            out.append(c.decode(slots[at : at + c.width]))
            at += c.width
        return tuple(out)

    def slot(self, slots: Sequence[Any], name: str) -> Any:
        """The first slot value of parameter ``name`` (its tensor slot for a number-or-array)."""
        return slots[self.offsets[name]]


_LIB: Optional[torch.library.Library] = None
#: The registered operators by hal op name (filled by :func:`register`).
TORCH_OPS: dict[str, TorchOp] = {}
_LOCK = threading.Lock()


def _distinct(out: Any, slots: Sequence[Any]) -> Any:
    """A torch operator must not return its inputs or views of them: copy such outputs, and make
    outputs contiguous as the fake kernels describe them."""
    if isinstance(out, (tuple, list)):
        return tuple(_distinct(o, slots) for o in out)
    if not isinstance(out, torch.Tensor):
        return out
    ptr = out.untyped_storage().data_ptr()
    for s in slots:
        if isinstance(s, torch.Tensor) and s.numel() and s.untyped_storage().data_ptr() == ptr:
            return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


def _define(lib: torch.library.Library, decl: OpDecl, table: dict[str, TorchOp]) -> TorchOp:
    """Define ``hal::<name>`` (and its functional twin where needed), its kernel, fake and autograd."""
    letters = {name: "abcdefgh"[i] for i, name in enumerate(decl.mutates)}
    top = TorchOp(decl, tuple(_codec(decl, p, letters.get(p.name)) for p in decl.params))
    packet = getattr(torch.ops, NAMESPACE)
    lib.define(f"{decl.name}({top.schema_args()}) -> {_returns(decl)}")

    if not (decl.trainable and decl.mutates):

        def impl(*slots: Any) -> Any:
            return _distinct(DISPATCHER.call_direct(decl, top.decode(slots)), slots)

        lib.impl(decl.name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{decl.name}", _torch_fake.fake_kernel(top), lib=lib)
        top.overload = getattr(packet, decl.name).default
        if decl.trainable:
            _register_autograd(lib, top, table[decl.backward], f"{NAMESPACE}::{decl.name}")
        return top

    twin = f"{decl.name}_functional"
    mutated = [n for n in decl.param_names if n in decl.mutates]
    flag = MUTATES_WHEN[decl.name]
    lib.define(f"{twin}({top.schema_args(functional=True)}) -> (Tensor{', Tensor' * len(mutated)})")

    def twin_impl(*slots: Any) -> Any:
        args = list(top.decode(slots))
        writes = bool(args[decl.index(flag)])
        fresh = []
        for name in mutated:
            i = decl.index(name)
            if writes and args[i] is not None:
                args[i] = args[i].clone()
            fresh.append(args[i] if writes else None)
        out = _distinct(DISPATCHER.call_direct(decl, tuple(args)), slots)
        return (out, *(f if f is not None else out.new_empty(0) for f in fresh))

    lib.impl(twin, twin_impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{twin}", _torch_fake.fake_twin_kernel(top, mutated, flag), lib=lib)
    top.overload = getattr(packet, twin).default
    _register_autograd(lib, top, table[decl.backward], f"{NAMESPACE}::{twin}")

    def mutating_impl(*slots: Any) -> Any:
        results = top.overload(*slots)
        if slots[top.offsets[flag]]:
            for name, new in zip(mutated, results[1:]):
                target = top.slot(slots, name)
                if target is not None:
                    target.copy_(new.detach())
        return results[0]

    lib.impl(decl.name, mutating_impl, "CompositeImplicitAutograd")
    top.mutating = getattr(packet, decl.name).default
    return top


# --- autograd ---------------------------------------------------------------------------------


def _register_autograd(lib: torch.library.Library, top: TorchOp, bwd: TorchOp, qualname: str) -> None:
    """Autograd of ``top`` through the registry's backward op ``bwd`` (called as a torch operator).

    The forward saves what the backward op takes besides ``grad_out``: forward inputs by name (a
    mutated one only when it is not written, as the backward never reads written statistics) and,
    for ``out``, the forward's result. The backward's results go to the slots of the inputs named
    in :data:`GRADIENTS`; an input that was None or a number gets no gradient.
    """
    decl = top.decl
    grads = GRADIENTS[decl.name]
    grad_names = (grads,) if isinstance(grads, str) else grads
    needs = [c for c in bwd.codecs if c.param.name != "grad_out"]
    flag = MUTATES_WHEN.get(decl.name)
    twin = flag is not None
    batch_rank = decl.unbatched[1] if decl.unbatched else None  # conv2d: its backward needs batched x
    arrays = ("array", "number_or_array")

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        writes = twin and bool(inputs[top.offsets[flag]])
        saved, statics = [], []
        for c in needs:
            name = c.param.name
            if name == "out":
                saved.append(output[0] if twin else output)
                statics.append(())
                continue
            at = top.offsets[name]
            values = inputs[at : at + c.width]
            if writes and name in decl.mutates:
                values = (None,)
            saved.append(values[0] if c.form in arrays else None)
            statics.append(values[1:] if c.form in arrays else values)
        if twin:
            ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(*saved)
        ctx.hal_statics = statics
        ctx.hal_given = [inputs[top.offsets[n]] is not None for n in grad_names]

    def backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple:
        batched = False
        slots: list = [grad_out]
        for c, tensor, rest in zip(needs, ctx.saved_tensors, ctx.hal_statics):
            if c.param.name == "x" and batch_rank is not None and tensor.ndim == batch_rank:
                tensor, slots[0], batched = tensor.unsqueeze(0), grad_out.unsqueeze(0), True
            if c.form in arrays:
                slots.append(tensor)
            slots.extend(rest)
        results = bwd.overload(*slots)
        if isinstance(grads, str):
            results = (results,)
        out: list = [None] * len(top.slot_names)
        for name, given, g in zip(grad_names, ctx.hal_given, results):
            if given:
                out[top.offsets[name]] = g.squeeze(0) if (batched and name == "x") else g
        return tuple(out)

    torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=lib)


# --- registration and routing -----------------------------------------------------------------


def register() -> dict[str, TorchOp]:
    """Register every op of the registry as ``torch.ops.hal.<name>`` (``import hal`` does; an op
    declared later is registered by the next call). Backward ops come first: the forward ops'
    autograd calls them."""
    global _LIB
    with _LOCK:
        if _LIB is None:
            _LIB = torch.library.Library(NAMESPACE, "DEF")
        for decl in sorted(OPS.values(), key=lambda d: d.forward is None):
            if decl.name not in TORCH_OPS:
                TORCH_OPS[decl.name] = _define(_LIB, decl, TORCH_OPS)
    return TORCH_OPS


def _run(decl: OpDecl, args: Sequence[Any]) -> Any:
    """Call the torch operator of ``decl`` on hal arguments (the mutating one for twin ops)."""
    top = TORCH_OPS[decl.name]
    slots = top.encode(args)
    if top.mutating is not None:
        return top.mutating(*slots)
    return top.overload(*slots)


def autograd_call(decl: OpDecl, args: Sequence[Any]) -> Any:
    """The dispatcher's route for eager calls with grad-requiring tensors (args already validated)."""
    if decl.name not in TORCH_OPS:
        register()
    if decl.name in TRAINING_DECOMPOSITIONS:
        return TRAINING_DECOMPOSITION_FNS[decl.name](*args)
    return _run(decl, args)


def traced_call(decl: OpDecl, args: Sequence[Any]) -> Any:
    """``hal.ops.<name>`` under torch.compile: one ``torch.ops.hal.<name>`` node (or the training
    decomposition's nodes), written so that Dynamo traces it without a graph break."""
    if decl.name in TRAINING_DECOMPOSITIONS and _needs_autograd(args):
        return TRAINING_DECOMPOSITION_FNS[decl.name](*args)
    return _run(decl, args)


# --- training decompositions ------------------------------------------------------------------


def _linear_for_training(x: Any, weight: Any, bias: Any, act: str) -> Any:
    if act == "none":
        return _run(OPS["linear"], (x, weight, bias, act))
    return scale_shift_act(linear(x, weight, bias, "none"), 1.0, 0.0, act)


def _fused_conv_bn_relu_for_training(
    x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training
):
    y = conv2d(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    y = batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
    return scale_shift_act(y, 1.0, 0.0, "relu")


TRAINING_DECOMPOSITION_FNS: dict[str, Callable[..., Any]] = {
    "linear": _linear_for_training,
    "fused_conv_bn_relu": _fused_conv_bn_relu_for_training,
}
