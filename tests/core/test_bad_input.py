"""Bad input, property-based: every op called with wrong ranks, shapes, dtypes, array types, devices,
strides and values raises a `hal.HalError` subclass or returns a result of the caller's array type;
never another exception (nothing raw from NumPy or a vendor library reaches the user).

Two kinds of calls: arguments drawn from scratch (mostly stopped by the first checks), and a valid
call of the conformance suite with one or two things broken (a dimension, a rank, a dtype, a device,
the array type of one argument, a static option, a NaN/Inf/huge value, a Python int too large for
a float or for 64 bits, a strided view), which reaches the deeper checks and the kernels. A third
test runs valid calls with NumPy's floating-point errors set to raise (as another library may leave
them) and expects the results of the default error state. Every call is counted
(tests/reliability/calls.py; the session summary prints the counts).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hal.conformance.cases import cases_for, draw_call
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import hal
from hal.arrays import from_numpy, numpy_dtype
from hal.types import Kind
from tests.reliability.calls import outcome

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool", "complex64"]
SPECIAL = [math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0, 1e-40]
#: Python ints no float holds (10**400 overflows float64) or no int64 holds.
HUGE_INTS = [10**400, -(10**400), 2**63, -(2**63) - 1, 2**64, 2**70, 10**5000]


@st.composite
def arrays_(draw: st.DrawFn, kind: str, device: str, like: Any = None) -> Any:
    """A random array: often shaped like ``like`` (to get past the first checks), sometimes not."""
    if like is not None and draw(st.booleans()):
        shape = tuple(like.shape)
        if shape and draw(st.booleans()):
            i = draw(st.integers(0, len(shape) - 1))
            shape = shape[:i] + (draw(st.integers(0, 5)),) + shape[i + 1 :]
    else:
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=5)))
    dtype = draw(st.sampled_from(DTYPES if draw(st.integers(0, 3)) == 0 else ["float32", "float64", "float16"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    data = rng.standard_normal(shape) * draw(st.sampled_from([1.0, 1e4, 1e-3]))
    if data.size and draw(st.booleans()):
        data.reshape(-1)[draw(st.integers(0, data.size - 1))] = draw(st.sampled_from(SPECIAL))
    if dtype.startswith(("int", "uint")):
        data = np.nan_to_num(data, nan=0.0, posinf=1.0, neginf=-1.0).clip(-100, 100)
    with np.errstate(over="ignore", invalid="ignore"):
        arr = data.astype(numpy_dtype(dtype)) if dtype != "bool" else data > 0
    if kind == "numpy":
        return arr if dtype != "bfloat16" else arr  # ml_dtypes bfloat16 array
    t = from_numpy(arr).clone()
    if device == "meta":
        t = t.to("meta")
    if t.ndim >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # non-contiguous
    return t


STATIC_VALUES = st.one_of(
    st.integers(-3, 6),
    st.sampled_from(HUGE_INTS),
    st.sampled_from([None, True, False, "same", "valid", "relu", "gelu", "bogus", "int8", "uint8", "float16", "", (1, 1), (2, 0), (-1, 2), (1, 2, 3), (0, 0, 1, 1), [3], [2, 2], 0.5, -1.0, math.nan, math.inf, 1e-5]),
)


@st.composite
def calls(draw: st.DrawFn, decl: Any) -> tuple[list[Any], dict[str, Any]]:
    kind = draw(st.sampled_from(["torch", "numpy"]))
    device = "meta" if kind == "torch" and draw(st.integers(0, 9)) == 0 else "cpu"
    first = None
    args: list[Any] = []
    for p in decl.params:
        use_default = not p.required and draw(st.integers(0, 2)) == 0
        if use_default:
            args.append(p.default)
            continue
        k = kind if draw(st.integers(0, 19)) else ("numpy" if kind == "torch" else "torch")  # mixed types
        if p.kind in (Kind.TENSOR, Kind.OPTIONAL_TENSOR):
            if p.kind is Kind.OPTIONAL_TENSOR and draw(st.booleans()):
                args.append(None)
            elif draw(st.integers(0, 14)) == 0:
                args.append(draw(STATIC_VALUES))  # not an array at all
            else:
                a = draw(arrays_(k, device, first))
                first = a if first is None else first
                args.append(a)
        elif p.kind in (Kind.TENSOR_LIST, Kind.OPTIONAL_TENSOR_LIST):
            n = draw(st.integers(0, 3))
            args.append([draw(arrays_(k, device, first)) for _ in range(n)] if draw(st.integers(0, 9)) else draw(STATIC_VALUES))
        elif p.kind in (Kind.SCALAR_OR_TENSOR, Kind.OPTIONAL_SCALAR_OR_TENSOR):
            args.append(draw(st.one_of(STATIC_VALUES, st.floats(allow_nan=True), arrays_(k, device))))
        else:
            args.append(draw(STATIC_VALUES))
    kwargs = {p.name: a for p, a in zip(decl.params, args) if p.keyword_only}
    positional = [a for p, a in zip(decl.params, args) if not p.keyword_only]
    return positional, kwargs


def _mutate_tensor(draw: st.DrawFn, t: torch.Tensor) -> Any:
    how = draw(st.sampled_from(["dim", "rank_up", "rank_down", "dtype", "meta", "numpy", "special", "strided", "not_array"]))
    if how == "dim" and t.ndim:
        i = draw(st.integers(0, t.ndim - 1))
        shape = list(t.shape)
        shape[i] = draw(st.sampled_from([0, 1, shape[i] + 1, max(shape[i] - 1, 0)]))
        return torch.randn(shape).to(t.dtype) if t.is_floating_point() else torch.zeros(shape, dtype=t.dtype)
    if how == "rank_up":
        return t.unsqueeze(0)
    if how == "rank_down" and t.ndim:
        if t.ndim > 1:
            return t.reshape(-1)
        return t[:1].reshape(()) if t.numel() else torch.ones((), dtype=t.dtype)
    if how == "dtype":
        return t.to(draw(st.sampled_from([torch.int8, torch.int32, torch.bool, torch.float16, torch.float64, torch.complex64, torch.uint8])))
    if how == "meta":
        return t.to("meta")
    if how == "numpy" and t.device.type == "cpu":
        return t.detach().numpy() if t.dtype != torch.bfloat16 else t.float().numpy()
    if how == "special" and t.is_floating_point() and t.numel():
        t = t.clone(memory_format=torch.contiguous_format)
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(SPECIAL))
        return t
    if how == "strided" and t.ndim:
        return t.repeat_interleave(2, dim=-1)[..., ::2]  # same values, non-contiguous
    if how == "not_array":
        return draw(STATIC_VALUES)
    return t


@st.composite
def broken_valid_calls(draw: st.DrawFn, decl: Any) -> tuple[list[Any], dict[str, Any]]:
    """A conformance case of ``decl`` with one or two arguments broken."""
    dtype = draw(st.sampled_from(decl.dtypes))
    specs = cases_for(decl.name, dtype, quick=True) or cases_for(decl.name, dtype)
    call = draw_call(decl.name, dtype, draw(st.sampled_from(specs)), draw(st.integers(0, 2**16)), "cpu").args
    args = {p.name: call.get(p.name, p.default) for p in decl.params}
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from([p.name for p in decl.params]))
        value = args[name]
        if isinstance(value, torch.Tensor):
            args[name] = _mutate_tensor(draw, value)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            items = list(value)
            if draw(st.booleans()):
                i = draw(st.integers(0, len(items) - 1))
                if isinstance(items[i], torch.Tensor):  # a second pass may find it already broken
                    items[i] = _mutate_tensor(draw, items[i])
            else:
                items = items[:-1]  # one tensor short
            args[name] = items
        else:
            args[name] = draw(STATIC_VALUES)
    if draw(st.integers(0, 4)) == 0:  # the whole call in NumPy (bfloat16 as ml_dtypes)
        args = {k: _to_numpy(v) for k, v in args.items()}
    kwargs = {p.name: args[p.name] for p in decl.params if p.keyword_only}
    return [args[p.name] for p in decl.params if not p.keyword_only], kwargs


def _to_numpy(v: Any) -> Any:
    from hal.arrays import to_numpy

    if isinstance(v, torch.Tensor) and v.device.type == "cpu":
        return to_numpy(v)
    if isinstance(v, list):
        return [_to_numpy(x) for x in v]
    return v


OPS = [d for d in hal.list_ops()]


def _check_outcome(decl: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
    fn = getattr(hal.ops, decl.name)
    how, out = outcome(lambda: fn(*args, **kwargs))
    if how == "hal_error":
        # a checker that crashed is wrapped as "argument '(arguments)'": that is a bug, not a check
        assert "argument '(arguments)'" not in str(out), str(out)
        event(f"raised {type(out).__name__}")  # --hypothesis-show-statistics shows the mix
        return
    event("returned a result")
    values = list(args) + list(kwargs.values())
    arrays_in = [a for a in values if isinstance(a, (np.ndarray, torch.Tensor))]
    arrays_in += [x for a in values if isinstance(a, (list, tuple)) for x in a if isinstance(x, (np.ndarray, torch.Tensor))]
    for o in out if isinstance(out, tuple) else (out,):
        if o is None:
            continue
        assert isinstance(o, (np.ndarray, torch.Tensor)), f"{decl.name} returned {type(o).__name__}"
        if arrays_in:
            assert isinstance(o, torch.Tensor) == isinstance(arrays_in[0], torch.Tensor), f"{decl.name} returned {type(o).__name__}"


@pytest.mark.parametrize("decl", OPS, ids=[d.name for d in OPS])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_calls_raise_hal_errors_or_return_results(decl: Any, data: st.DataObject) -> None:
    args, kwargs = data.draw(calls(decl))
    _check_outcome(decl, args, kwargs)


@pytest.mark.parametrize("decl", OPS, ids=[d.name for d in OPS])
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_broken_valid_calls_raise_hal_errors_or_return_results(decl: Any, data: st.DataObject) -> None:
    args, kwargs = data.draw(broken_valid_calls(decl))
    _check_outcome(decl, args, kwargs)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
    return a == b


def _cloned(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, list):
        return [_cloned(x) for x in v]
    return v


@pytest.mark.parametrize("decl", OPS, ids=[d.name for d in OPS])
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_numpy_errors_set_to_raise_change_nothing(decl: Any, data: st.DataObject) -> None:
    """Another library's ``np.seterr(all="raise")`` must not turn the reference's IEEE arithmetic
    (overflow, NaN, division by zero in the cases' edge values) into FloatingPointError."""
    dtype = data.draw(st.sampled_from(decl.dtypes))
    edges = ("large", "nan", "inf", "underflow", "saturation", "empty", "neg_inf")  # and the quick ones: small
    specs = [c for c in cases_for(decl.name, dtype) if c.quick or any(e in c.name for e in edges)]
    spec = data.draw(st.sampled_from(specs))
    call = draw_call(decl.name, dtype, spec, data.draw(st.integers(0, 2**16)), "cpu").args
    args = {p.name: call.get(p.name, p.default) for p in decl.params}
    positional = lambda a: [a[p.name] for p in decl.params if not p.keyword_only]  # noqa: E731
    keywords = lambda a: {p.name: a[p.name] for p in decl.params if p.keyword_only}  # noqa: E731
    fn = getattr(hal.ops, decl.name)
    quiet = {k: _cloned(v) for k, v in args.items()}
    with np.errstate(all="ignore"):
        how, want = outcome(lambda: fn(*positional(quiet), **keywords(quiet)))
    loud = {k: _cloned(v) for k, v in args.items()}
    with np.errstate(all="raise"):
        how_loud, got = outcome(lambda: fn(*positional(loud), **keywords(loud)))
    assert how_loud == how, got
    if how == "result":
        assert _same(got, want) and all(_same(loud[m], quiet[m]) for m in decl.mutates if loud[m] is not None)

