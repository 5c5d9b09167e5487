"""The case lists of the conformance suite, one list per op of the registry.

A case is a named recipe (:class:`CaseSpec`) that draws the arguments of one op call
(:class:`Call`) for a dtype on a device. Recipes are static, so every case id of a backend is known
without drawing any data (xfail files are checked against the full list), and data is drawn fresh
for each run from a seed derived from ``(seed, op, dtype, case)``: every kernel of an op sees the
same inputs, and a failing case replays exactly.

One module per op family holds a ``CASES`` mapping ``op -> [CaseSpec, ...]``. The family modules
are found, not listed: every public module of this package, searched along its ``__path__`` (a new
family is a new file here). An op of the registry without cases is reported as an error by the
runner, so a new op cannot slip through. The table follows the modules' names; nothing reads its
order (the runner and the reports follow the registry's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from hal.plugin import family_names
from hal.registry import get_op

from ..draw import Draw

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_ID = re.compile(r"^(?P<op>[A-Za-z0-9_]+)\[(?P<kernel>[^,\[\]]+),(?P<dtype>[^,\[\]]+),(?P<case>[^,\[\]]+)\]$")


@dataclasses.dataclass
class Call:
    """The arguments of one op call, by parameter name, and what comparing its results needs."""

    args: dict[str, Any]
    #: dtypes of the arrays the op returns, in order (default: the case dtype for each).
    result_dtypes: Optional[tuple[str, ...]] = None
    #: parameters the reference receives in their own dtype instead of upcast to float64
    #: (float32 master weights, which the op requires to be float32).
    keep_dtype: tuple[str, ...] = ()
    #: static arguments replaced in the reference call (int8_linear computes its reference in float32).
    reference_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: the scale results have with this data (huge or fp16-subnormal inputs), relative to unit-scale
    #: data; atol is multiplied by the larger of this and each result's own magnitude.
    scale: float = 1.0
    #: the float math is exact for these inputs (quantisation ties on power-of-two scales): results
    #: must equal the reference bit for bit.
    exact: bool = False


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """A named recipe drawing one call of an op; ``quick`` cases form the ``--quick`` run."""

    name: str
    build: Callable[[Draw], Call]
    quick: bool = False
    #: the case dtypes this case applies to (None: every dtype the op declares).
    dtypes: Optional[tuple[str, ...]] = None

    def applies_to(self, dtype: str) -> bool:
        return self.dtypes is None or dtype in self.dtypes


def case(name: str, build: Callable[..., Call], *, quick: bool = False, dtypes: Optional[Sequence[str]] = None, **params: Any) -> CaseSpec:
    """A CaseSpec whose recipe is ``build(draw, **params)``."""
    if not _NAME.match(name):
        raise ValueError(f"case name {name!r} must match {_NAME.pattern} (it is part of the case id)")
    return CaseSpec(name, (lambda d: build(d, **params)) if params else build, quick, tuple(dtypes) if dtypes else None)


#: A table of cases: name -> (recipe parameters, quick, also a case of the backward op). A
#: "dtypes" entry among the parameters restricts the case to those dtypes.
Table = Mapping[str, tuple[dict[str, Any], bool, bool]]


def from_table(table: Table, build: Callable[..., Call], backward: bool = False, **common: Any) -> list[CaseSpec]:
    """The cases of every row of ``table`` (``backward``: of the rows marked for the backward op),
    each recipe ``build(draw, **common, **row parameters)``."""
    out = []
    for name, (params, quick, in_backward) in table.items():
        if backward and not in_backward:
            continue
        params = dict(params)
        dtypes = params.pop("dtypes", None)
        out.append(case(name, build, quick=quick, dtypes=dtypes, **common, **params))
    return out


def backward_call(op: str, d: Draw, forward: Call, out_shape: Sequence[int]) -> Call:
    """The call of backward op ``op`` derived from its forward call: a fresh random ``grad_out`` of
    the forward result's shape, and every forward argument the backward op also takes."""
    args: dict[str, Any] = {"grad_out": d.normal(*out_shape)}
    for name in get_op(op).param_names[1:]:
        if name in forward.args:
            args[name] = forward.args[name]
    return dataclasses.replace(forward, args=args, result_dtypes=None)


def case_id(op: str, kernel: str, dtype: str, case_name: str) -> str:
    """The exact, stable id of a case: ``op[kernel,dtype,case]``."""
    return f"{op}[{kernel},{dtype},{case_name}]"


def parse_case_id(text: str) -> Optional[tuple[str, str, str, str]]:
    """(op, kernel, dtype, case) of an id, or None when ``text`` is not shaped like one."""
    m = _ID.match(text.strip())
    return (m["op"], m["kernel"], m["dtype"], m["case"]) if m else None


_TABLE: dict[str, list[CaseSpec]] = {}
#: cases of ops declared outside hal (a plugin's own ops), by op: see :func:`register_cases`.
_REGISTERED: dict[str, list[CaseSpec]] = {}


def register_cases(op: str, specs: Sequence[CaseSpec]) -> None:
    """Add the cases of an op declared outside hal's own ``ops/`` (a plugin that declares its own
    op registers its cases here, next to its declaration); names must be unique per op."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names) or op in _REGISTERED:
        raise ValueError(f"cases of op {op} are registered twice, or have duplicate names: {names}")
    _REGISTERED[op] = list(specs)
    if _TABLE:
        _TABLE[op] = list(specs)


def families() -> list[str]:
    """The names of the family modules: the public modules on this package's ``__path__``, sorted."""
    return family_names(__path__)


def all_cases() -> dict[str, list[CaseSpec]]:
    """op -> its cases, from every family module and :func:`register_cases` (names checked unique per op)."""
    if not _TABLE:
        table: dict[str, list[CaseSpec]] = {}
        for family in families():
            module = importlib.import_module(f"{__name__}.{family}")
            for op, specs in module.CASES.items():
                if op in table:
                    raise ValueError(f"cases of op {op} are defined twice (again in {module.__name__})")
                names = [s.name for s in specs]
                dup = {n for n in names if names.count(n) > 1}
                if dup:
                    raise ValueError(f"op {op}: duplicate case names {sorted(dup)}")
                table[op] = list(specs)
        _TABLE.update(table)
        _TABLE.update(_REGISTERED)
    return _TABLE


def cases_for(op: str, dtype: str, quick: bool = False) -> list[CaseSpec]:
    """The cases of ``op`` that apply to ``dtype`` (only the quick ones when ``quick``)."""
    return [c for c in all_cases().get(op, []) if c.applies_to(dtype) and (c.quick or not quick)]


def find_case(op: str, name: str) -> CaseSpec:
    for c in all_cases().get(op, []):
        if c.name == name:
            return c
    known = ", ".join(c.name for c in all_cases().get(op, [])) or "none"
    raise KeyError(f"op {op} has no conformance case {name!r}; its cases: {known}")


def case_seed(seed: int, op: str, dtype: str, case_name: str) -> int:
    """The seed of one case's data: stable across runs, machines and Python versions."""
    digest = hashlib.sha256(f"{seed}:{op}:{dtype}:{case_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def draw_call(op: str, dtype: str, spec: CaseSpec, seed: int, device: Any) -> Call:
    """The call of one case, drawn for ``dtype`` on ``device`` from the case's seed."""
    rng = np.random.default_rng(case_seed(seed, op, dtype, spec.name))
    return spec.build(Draw(rng, dtype, torch.device(device)))


def case_inputs(op: str, dtype: str, case_name: str, seed: int = 0, device: Any = "cpu") -> dict[str, Any]:
    """The arguments (by parameter name) of a conformance case, as the suite passes them to the op::

        args = case_inputs("conv2d", "float16", "groups4", seed=0, device="cuda:0")
        out = hal.ops.conv2d(**args)
    """
    return draw_call(op, dtype, find_case(op, case_name), seed, device).args


__all__ = [
    "Call",
    "CaseSpec",
    "Draw",
    "case",
    "register_cases",
    "Table",
    "from_table",
    "backward_call",
    "case_id",
    "parse_case_id",
    "families",
    "all_cases",
    "cases_for",
    "find_case",
    "case_seed",
    "draw_call",
    "case_inputs",
]
