"""NumPy arrays in the other byte order (``dtype('>f4')`` on a little-endian machine, as arrays read
from some files are): every op takes them as NumPy takes them, with the results of the same call on
native arrays. torch has no byte-swapped dtypes (``torch.from_numpy`` refuses them with a
ValueError) and numba none either, so hal converts them to a native copy (numba kernels decline them
and say why) and writes an op's in-place results back into the caller's arrays.

The calls are each op's quick conformance cases in float32 (float64 where an op has no float32
cases), drawn from a fresh seed, on the CPU backends as dispatched. Since the numba kernels decline
the swapped arrays, the two calls may take different routes (a serial numba reduction against
torch's blocked one), so results agree within the op's declared tolerance, widened by the call's
reduction length as conformance widens it, not bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hal.conformance.cases import all_cases, draw_call

import hal
from hal.arrays import to_numpy
from hal.registry import get_op

from .calls import outcome

OPS = [d.name for d in hal.list_ops()]


def _map(value: Any, fn) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return fn(value)


def _numpy(value: Any) -> Any:
    return _map(value, lambda t: to_numpy(t).copy() if isinstance(t, torch.Tensor) else t)


def _swapped(value: Any) -> Any:
    """Float arrays in the other byte order (the same numbers); other arrays and values as they are."""
    def swap(a: Any) -> Any:
        if isinstance(a, np.ndarray) and a.dtype.kind == "f" and a.dtype.itemsize > 1 and a.dtype.isnative:
            return a.astype(a.dtype.newbyteorder("S"))
        return a
    return _map(value, swap)


def _flat(out: Any) -> list[Any]:
    return [v for x in (out if isinstance(out, (list, tuple)) else [out]) for v in (x if isinstance(x, (list, tuple)) else [x])]


def _call(op: str, args: dict[str, Any]) -> Any:
    decl = get_op(op)
    positional = [args[p.name] for p in decl.params if not p.keyword_only and p.name in args]
    keywords = {p.name: args[p.name] for p in decl.params if p.keyword_only and p.name in args}
    return decl.entry(*positional, **keywords)


def _tolerance(op: str, dtype: str, call: Any) -> tuple[float, float]:
    """(atol, rtol) between two results that are each within the op's declared tolerance of the
    reference: twice that tolerance, widened by the call's reduction length and scaled by the case's
    data scale, as conformance widens and scales it."""
    decl = get_op(op)
    k = decl.reduction(call.args) if decl.reduction else 1
    atol, rtol = decl.tolerances[dtype].widened(int(k))
    return 2 * atol * max(1.0, call.scale), 2 * rtol


def _dtype_of_cases(op: str) -> str:
    dtypes = get_op(op).dtypes
    return "float32" if "float32" in dtypes else "float64" if "float64" in dtypes else ""


@pytest.mark.parametrize("op", OPS)
def test_byte_swapped_arrays_give_the_native_results(op: str, seed: int) -> None:
    dtype = _dtype_of_cases(op)
    cases = [c for c in all_cases().get(op, []) if c.quick and c.applies_to(dtype)] if dtype else []
    if not cases:
        pytest.skip(f"{op}: no float32/float64 quick case (its arrays are integers or FP8 codes)")
    swapped_any = False
    for spec in cases:
        call = draw_call(op, dtype, spec, seed, "cpu")
        native = {k: _numpy(v) for k, v in call.args.items()}
        swapped = {k: _swapped(_numpy(v)) for k, v in call.args.items()}
        swapped_any |= any(isinstance(a, np.ndarray) and not a.dtype.isnative for v in swapped.values() for a in _flat(v))
        how_n, want = outcome(lambda: _call(op, native))
        how_s, got = outcome(lambda: _call(op, swapped))
        label = f"{op}[{spec.name}, {dtype}]"
        atol, rtol = _tolerance(op, dtype, call)
        assert how_s == how_n, f"{label}: {how_s} ({got}) where native arrays give {how_n} ({want})"
        if how_n != "result":
            continue
        for i, (g, w) in enumerate(zip(_flat(got), _flat(want))):
            if isinstance(w, np.ndarray):
                assert isinstance(g, np.ndarray) and g.shape == w.shape and g.dtype.newbyteorder("=") == w.dtype, f"{label} out[{i}]"
                np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"{label} out[{i}]")
        for name in get_op(op).mutates:  # in-place results reach the caller's arrays
            for g, w in zip(_flat(swapped[name]), _flat(native[name])):
                if isinstance(w, np.ndarray):
                    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"{label} @{name}")
    if not swapped_any:
        pytest.skip(f"{op}: its quick cases have no float arrays")
