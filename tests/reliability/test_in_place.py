"""In-place ops, property-based (classes 1 and 2 of the reliability issue): on every op that writes
its arguments, drawn from the conformance cases of the op (so the calls are valid and reach the
kernels):

* every tensor the call writes has its autograd version counter bumped, so a backward that saved it
  refuses to run (as after a torch in-place op) instead of using the new values silently; running
  statistics (``mutates_statistics``: batch norm's) are written as torch's batch norm writes them,
  without a bump, and counted in hal's write count (``hal.arrays.writes_of``) instead;
* with one written argument anywhere in the argument list made unwritable (a read-only NumPy array
  in an all-NumPy call, or a tensor requiring grad while grad mode is on) the call raises a
  ``hal.HalError`` naming it and writes nothing: every array of the call is as before.

Which arguments an op writes comes from its declaration (``mutates`` and ``mutates_when``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from hal.conformance.cases import cases_for, draw_call
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hal
from hal.arrays import to_numpy, writes_of

from .calls import outcome

IN_PLACE = [d for d in hal.list_ops() if d.mutates]


#: the most elements a drawn call holds in all: the properties do not depend on size
MAX_ELEMENTS = 1 << 16


@functools.cache
def _writing_specs(name: str) -> list[Any]:
    """The float32 conformance cases of op ``name`` whose calls write something, with at most
    MAX_ELEMENTS elements (one call of each drawn to see). Sampling only these keeps Hypothesis from
    drawing the first, ResNet-sized eval-mode cases, which write nothing, again and again (the
    fused convolution's test spent three minutes there)."""
    decl = hal.dispatch.OPS[name]
    keep = []
    for spec in cases_for(name, "float32"):
        args = _drawn(decl, spec, 0)
        if _written(decl, args) and sum(a.size if isinstance(a, np.ndarray) else a.numel() for a in _arrays(args)) <= MAX_ELEMENTS:
            keep.append(spec)
    return keep


def _valid_call(data: st.DataObject, decl: Any) -> dict[str, Any]:
    """A call of one of :func:`_writing_specs`, drawn from a fresh seed."""
    specs = _writing_specs(decl.name)
    assert specs, f"{decl.name}: no small conformance case that writes something"
    while True:
        args = _drawn(decl, data.draw(st.sampled_from(specs)), data.draw(st.integers(0, 2**16)))
        if _written(decl, args):
            return args


def _drawn(decl: Any, spec: Any, seed: int) -> dict[str, Any]:
    """The arguments, by name, of the float32 CPU call of conformance case ``spec`` drawn from ``seed``."""
    call = draw_call(decl.name, "float32", spec, seed, "cpu").args
    return {p.name: call.get(p.name, p.default) for p in decl.params}


def _written(decl: Any, args: dict[str, Any]) -> list[tuple[str, int, Any]]:
    """(argument, index in its list or -1, array) of every array the call writes, non-empty ones."""
    if decl.mutates_when is not None and not args.get(decl.mutates_when):
        return []
    out = []
    for name in decl.mutates:
        value = args.get(name)
        items = value if isinstance(value, (list, tuple)) else [value]
        for i, a in enumerate(items):
            size = a.size if isinstance(a, np.ndarray) else a.numel() if isinstance(a, torch.Tensor) else 0
            if size:
                out.append((name, i if isinstance(value, (list, tuple)) else -1, a))
    return out


def _call(decl: Any, args: dict[str, Any]) -> tuple[str, Any]:
    fn = getattr(hal.ops, decl.name)
    kwargs = {p.name: args[p.name] for p in decl.params if p.keyword_only}
    return outcome(lambda: fn(*[args[p.name] for p in decl.params if not p.keyword_only], **kwargs))


def _arrays(args: dict[str, Any]) -> list[Any]:
    out = []
    for v in args.values():
        out += [x for x in v if isinstance(x, (torch.Tensor, np.ndarray))] if isinstance(v, (list, tuple)) else [v]
    return [a for a in out if isinstance(a, (torch.Tensor, np.ndarray))]


def _copy(a: Any) -> Any:
    return a.clone() if isinstance(a, torch.Tensor) else a.copy()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("decl", IN_PLACE, ids=[d.name for d in IN_PLACE])
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_written_tensor_is_marked_written(decl: Any, data: st.DataObject) -> None:
    args = _valid_call(data, decl)
    before = [(name, i, t, t._version, writes_of(t)) for name, i, t in _written(decl, args)]
    with torch.no_grad():
        how, out = _call(decl, args)
    assert how == "result", out
    where = lambda name, i: f"{name}[{i}]" if i >= 0 else name  # noqa: E731
    if decl.mutates_statistics:  # as torch's batch norm: no version bump, counted by hal
        bumped = [where(name, i) for name, i, t, v, _ in before if t._version != v]
        assert not bumped, f"{decl.name} bumped the version counters of its statistics {bumped} (torch does not)"
        stale = [where(name, i) for name, i, t, _, w in before if writes_of(t) <= w]
        assert not stale, f"{decl.name} wrote {stale} without counting the writes"
    else:
        stale = [where(name, i) for name, i, t, v, _ in before if t._version <= v]
        assert not stale, f"{decl.name} wrote {stale} without bumping their version counters"


def test_a_backward_that_saved_a_parameter_refuses_after_the_optimizer_wrote_it() -> None:
    """The issue's example: torch raises, so must a backward after hal's fused_adamw_."""
    p = torch.nn.Parameter(torch.randn(4))
    y = (p * p).sum()
    with torch.no_grad():
        hal.ops.fused_adamw_([p], [torch.randn(4)], [torch.zeros(4)], [torch.zeros(4)], lr=0.1, beta1=0.9, beta2=0.99,
                             eps=1e-8, weight_decay=0.0, step=1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("decl", IN_PLACE, ids=[d.name for d in IN_PLACE])
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_one_unwritable_output_means_nothing_is_written(decl: Any, data: st.DataObject) -> None:
    args = _valid_call(data, decl)
    how = data.draw(st.sampled_from(["read_only_numpy", "requires_grad"]))
    if how == "read_only_numpy":
        args = {k: ([to_numpy(x) for x in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)
                    else to_numpy(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    written = _written(decl, args)
    name, i, target = data.draw(st.sampled_from(written))
    if how == "read_only_numpy":
        target.flags.writeable = False
    else:
        target.requires_grad_(True)
    snapshot = [(a, _copy(a.detach() if isinstance(a, torch.Tensor) else a)) for a in _arrays(args)]
    with torch.enable_grad():
        result, err = _call(decl, args)
    assert result == "hal_error", f"{decl.name} accepted an unwritable {name}"
    assert name in str(err), str(err)
    changed = [k for k, (a, b) in enumerate(snapshot) if not _same(a.detach() if isinstance(a, torch.Tensor) else a, b)]
    assert not changed, f"{decl.name} wrote {len(changed)} arrays before refusing {name}"
