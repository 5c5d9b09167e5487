"""Zero-size dimensions, property-based: every op's zero-size calls give torch's results.

The calls are the conformance suite's zero-size cases (``empty_*``: an empty batch, sequence, row
set or feature set, experts without tokens, K = 0 ...), drawn for a random dtype, seed and array
type (torch or NumPy). For each call:

- the op's empty rule (``@op.empty`` in its declaration: what the dispatcher runs instead of a
  kernel for zero-size inputs)
  and the op itself (cpu_ref, the reference) return what PyTorch returns for the same call
  (``hal_torch``: the named torch function on the canonical arguments): same types, dtypes, shapes
  and values, and the same in-place writes (none, for an empty batch norm or AdamW step);
- the results have the caller's array type.

Every op of the registry must have zero-size cases and a rule.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from hal.conformance.cases import all_cases, draw_call
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import hal
from hal.arrays import dtype_name, from_numpy, to_numpy
from hal.errors import HalError
from hal.dispatch import prepare
from hal.registry import OpDecl, get_op
from hal.types import ARRAY_KINDS
from hal_torch.table import eager

from .calls import outcome

OPS = [d for d in hal.list_ops()]


def empty_rule(op: str) -> Optional[Callable[..., Any]]:
    """The op's empty rule (None when its declaration has none)."""
    return get_op(op).empty


def empty_cases(op: str) -> list:
    """The op's conformance cases named for zero-size inputs (``empty_*``)."""
    return [c for c in all_cases().get(op, []) if c.name.startswith("empty_")]


def has_zero_size(args: list[Any]) -> bool:
    return any(isinstance(v, torch.Tensor) and v.numel() == 0 for a in args for v in _flat(a))


def call_op(decl: OpDecl, args: list[Any]) -> Any:
    """hal.ops.<name> on arguments in schema order (keyword-only ones by name)."""
    positional = [a for p, a in zip(decl.params, args) if not p.keyword_only]
    keywords = {p.name: a for p, a in zip(decl.params, args) if p.keyword_only}
    return decl.entry(*positional, **keywords)


def test_every_op_has_zero_size_cases_and_a_rule() -> None:
    missing_cases = [d.name for d in OPS if not empty_cases(d.name)]
    missing_rules = [d.name for d in OPS if empty_rule(d.name) is None]
    assert not missing_cases and not missing_rules, (missing_cases, missing_rules)


def _map(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return fn(value) if isinstance(value, (torch.Tensor, np.ndarray)) else value


def _as_numpy(value: Any) -> Any:
    return _map(value, lambda t: to_numpy(t).copy() if isinstance(t, torch.Tensor) else t)


def _as_torch(value: Any) -> Any:
    return _map(value, lambda a: from_numpy(a) if isinstance(a, np.ndarray) else a)


def _flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _rule_call(decl: OpDecl, rule: Callable[..., Any], args: list[Any]) -> Any:
    """The rule on canonical arguments, as the dispatcher would call it (a batch dimension added
    to an unbatched input and removed from the result)."""
    prepared = prepare(decl, args)
    inputs, unbatched = prepared.inputs, prepared.unbatched
    out = rule(decl.bind(inputs.args))
    return out[0] if unbatched is not None else out


def _torch_reference(decl: OpDecl, args: list[Any]) -> Any:
    prepared = prepare(decl, args)
    inputs, unbatched = prepared.inputs, prepared.unbatched
    out = eager(decl.name)(*inputs.args)
    return out[0] if unbatched is not None else out


def _exact_reference(decl: OpDecl, args: list[Any]) -> list[Any]:
    """torch's results for half-precision inputs computed in float64 and rounded once to each
    result's dtype: eager torch rounds every intermediate step (a sum of bfloat16 products, say),
    hal's rules compute in float32 and round once, so within tolerance of either is torch's result."""
    def wide(a: Any) -> Any:
        return a.double() if isinstance(a, torch.Tensor) and a.dtype in (torch.float16, torch.bfloat16) else a

    narrow = _flat(_torch_reference(decl, copy.deepcopy(args)))
    try:
        exact = _flat(_torch_reference(decl, [_map(a, wide) for a in copy.deepcopy(args)]))
    except HalError:  # dtypes tied together (a loss's gradient in float32 for bfloat16 logits): no wide twin
        return [None] * len(narrow)
    return [e.to(n.dtype) if isinstance(e, torch.Tensor) and isinstance(n, torch.Tensor) else e for e, n in zip(exact, narrow)]


def _same(label: str, got: Any, want: Any, kind: str, exact: Any = None) -> None:
    if want is None:
        assert got is None, f"{label}: got {type(got).__name__}, torch gives None"
        return
    assert isinstance(got, np.ndarray if kind == "numpy" else torch.Tensor), f"{label}: {type(got).__name__} for {kind} inputs"
    g = _as_torch(got)
    assert dtype_name(g) == dtype_name(want) and tuple(g.shape) == tuple(want.shape), (
        f"{label}: {dtype_name(g)} {tuple(g.shape)}, torch gives {dtype_name(want)} {tuple(want.shape)}"
    )
    if want.is_floating_point() and want.dtype in (torch.float16, torch.bfloat16):
        if exact is not None and torch.allclose(g.double(), exact.double(), rtol=1.6e-2, atol=1e-3, equal_nan=True):
            return
        torch.testing.assert_close(g.double(), want.double(), rtol=1.6e-2, atol=1e-3, equal_nan=True, msg=label)
    else:
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6, equal_nan=True, msg=label)


def _mutated(decl: OpDecl, args: list[Any]) -> list[tuple[str, Any]]:
    return [(f"@{n}", v) for n in decl.mutates for v in _flat(args[decl.index(n)]) if v is not None]


@pytest.mark.parametrize("decl", OPS, ids=[d.name for d in OPS])
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_zero_size_calls_give_torchs_results(decl: OpDecl, data: st.DataObject) -> None:
    spec = data.draw(st.sampled_from(empty_cases(decl.name)), label="case")
    dtype = data.draw(st.sampled_from([t for t in decl.dtypes if spec.applies_to(t)]), label="dtype")
    kind = data.draw(st.sampled_from(["torch", "numpy"]), label="array type")
    call = draw_call(decl.name, dtype, spec, data.draw(st.integers(0, 2**16), label="seed"), "cpu")
    base = [call.args.get(p.name, p.default) for p in decl.params]
    assume(has_zero_size(base))  # "empty_query_row" is a mask row with nothing to attend to, not a zero size

    torch_args = copy.deepcopy(base)
    want = _flat(_torch_reference(decl, torch_args)) + [v for _, v in _mutated(decl, torch_args)]
    exact = _exact_reference(decl, base) if dtype in ("float16", "bfloat16") and not decl.mutates else [None] * len(want)

    rule = empty_rule(decl.name)
    assert rule is not None
    for label, run in (("rule", lambda a: _rule_call(decl, rule, a)), ("op", lambda a: call_op(decl, a))):
        args = copy.deepcopy(base)
        if kind == "numpy":
            args = [_as_numpy(a) if p.kind in ARRAY_KINDS else a for p, a in zip(decl.params, args)]
        how, out = outcome(lambda: run(args))
        assert how == "result", f"{label} of {decl.name}[{spec.name}] raised {out}"
        got = [(f"out[{i}]", v) for i, v in enumerate(_flat(out))] + _mutated(decl, args)
        assert len(got) == len(want), f"{label}: {len(got)} results, torch gives {len(want)}"
        for (name, g), w, e in zip(got, want, exact):
            _same(f"{label} {decl.name}[{spec.name},{dtype},{kind}] {name}", g, w, kind, e)
