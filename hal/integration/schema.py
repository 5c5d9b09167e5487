"""How a hal op's signature becomes a torch schema: one :class:`Codec` per parameter (its slots and
the two conversions) and :class:`TorchOp`, an op registered as a torch operator.

- arrays: ``Tensor``, ``Tensor?``, ``Tensor[]``, ``Tensor[]?``; a parameter in ``decl.mutates`` gets
  an alias annotation (``Tensor(a!)``);
- a number-or-array (``ScalarOrTensor``) takes two slots, ``Tensor? <name>`` and
  ``Scalar? <name>_number``: exactly one is set, so ints stay ints and tensors stay tensors;
- static options: ``int``, ``float``, ``bool``, ``str`` (``?`` when optional); an int-or-pair
  (``IntPair``) travels as ``int[]`` (an int v as ``[v, v]``), a shape as ``int[]`` (an int v as
  ``[v]``), a conv padding as ``int[] padding, str? padding_mode`` ("same"/"valid" in the mode).
  These forms are equivalent for the op's checker, which runs on the decoded values;
- a backward op's ``output_mask`` takes no slot: the operator computes every gradient (its schema
  returns tensors, never None), so a mask given under torch.compile is not honoured.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from hal.gradients import MASK
from hal.registry import OPS, OpDecl, Param
from hal.types import IntPair, Kind, Padding, ShapeLike


# --- from hal parameters to schema slots ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one hal parameter travels through a torch schema: its slots and the two conversions."""

    param: Param
    form: str  # "array", "number_or_array", "plain", "pair", "shape", "padding", "mask"
    slots: tuple[str, ...]  # schema text of each slot ("Tensor? scale", "Scalar? scale_number")

    @property
    def width(self) -> int:
        return len(self.slots)

    def encode(self, value: Any, out: list) -> None:
        """Append the slot values of ``value``."""
        form = self.form
        if form == "array" or form == "plain":
            out.append(value)
        elif form == "mask":
            pass
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
        if form == "mask":
            return self.param.default
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


def codec(decl: OpDecl, p: Param, alias: Optional[str]) -> Codec:
    mut = f"({alias}!)" if alias else ""
    if p.name == MASK:  # no slot: every gradient is computed (the schema returns tensors, not None)
        return Codec(p, "mask", ())
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
        f"hal.integration.library has no torch schema encoding for parameter {p.name!r} of op {decl.name} "
        f"(annotation {p.annotation!r}); use one of the types of hal.types for static options"
    )


def returns(decl: OpDecl) -> str:
    """The schema's return type of an op."""
    if decl.forward is not None:  # a backward op: one gradient per differentiable forward input
        fwd = OPS[decl.forward] if decl.forward in OPS else None
        if fwd is None:
            raise TypeError(f"backward op {decl.name} is declared before its forward op {decl.forward}")
        return "Tensor" if fwd.single_gradient else "(" + ", ".join(["Tensor"] * len(fwd.gradients)) + ")"
    ret = getattr(decl.entry, "__annotations__", {}).get("return")
    if ret in (None, "None"):
        return "()"
    text = ret if isinstance(ret, str) else repr(ret)
    if text.startswith("tuple[") and text.endswith("]"):  # a fixed number of arrays: tuple[Tensor, Tensor]
        items = [t.strip().rsplit(".", 1)[-1] for t in text[len("tuple["):-1].split(",")]
        if items and all(t == "Tensor" for t in items):
            return "(" + ", ".join(items) + ")"
    return "Tensor"


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
    #: ``torch.ops.hal.<name>_decide``: the node a traced call becomes (see :func:`_define_decide`).
    decide: Any = None
    #: the qualified name autograd is registered on (None: not trainable), and whether it is.
    autograd_name: Optional[str] = None
    has_autograd: bool = False
    #: slot index of each parameter's first slot, by name.
    offsets: dict[str, int] = dataclasses.field(default_factory=dict)
    #: per parameter, a function of the slots giving its hal value (decode's hot path: one call each)
    readers: tuple[Callable[[Sequence[Any]], Any], ...] = ()

    def __post_init__(self) -> None:
        at = 0
        readers = []
        for c in self.codecs:
            self.offsets[c.param.name] = at
            if c.form in ("array", "plain"):
                readers.append(operator.itemgetter(at))
            else:
                readers.append(lambda slots, c=c, a=at, b=at + c.width: c.decode(slots[a:b]))
            at += c.width
        self.readers = tuple(readers)

    @property
    def opaque(self) -> Any:
        """The operator a call that stays one opaque node calls (the mutating one for twin ops)."""
        return self.mutating or self.overload

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
        return tuple([read(slots) for read in self.readers])

    def slot(self, slots: Sequence[Any], name: str) -> Any:
        """The first slot value of parameter ``name`` (its tensor slot for a number-or-array)."""
        return slots[self.offsets[name]]
