"""Routing as data (issue 42 item 4) for the cpu, cuda and rocm backends: their kernels route as they
did before their context predicates and graph priorities became ``contexts=`` data.

tests/core/data/backend_routing.json was recorded before any registration changed (at 09ace6c): for
each kernel its contexts with their priorities, its dtypes and whether torch's autograd may record
it; for each op, each quick conformance case of each dtype and each situation a call can be in (a
torch.compile trace or not, inputs requiring grad or not, inside ``hal.graphs.device_bound`` or
not), the call's context and every kernel of the backend in the order the dispatcher tries them
there, with its rejection reasons and, where it accepts, why torch's autograd may not record it.
Nothing here needs a GPU: the cuda and rocm plugins load on a CPU-only torch (as
tests/cuda/test_plugin.py and tests/rocm/test_selection.py use them) and their checks see the
cases' CPU tensors as on an sm_90 or gfx942 device. What a check asks of the machine is answered
the same everywhere (:func:`_one_machine`), so that the recording holds on any CI host. Reasons are
stored once each, in ``reasons``, and referred to by their index.
``python tests/core/test_backend_routing.py`` writes the recording again from the registrations as
they are.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import pytest
import torch

from hal.config import Choice
from hal.dispatch import prepare
from hal.dispatch.adapt import inputs_as
from hal.dispatch.context import context_of
from hal.dispatch.select import _context_reasons, _reasons, ranked
from hal.plugin import Inputs, KernelSpec, Plugin
from hal.registry import OpDecl, get_op

RECORDED = Path(__file__).parent / "data" / "backend_routing.json"

#: each backend: its plugin's module, the device kind its checks see, and the architecture they see.
BACKENDS = {"cpu": ("hal_backend_cpu", "cpu", None), "cuda": ("hal_backend_cuda", "cuda", "sm_90"), "rocm": ("hal_backend_rocm", "rocm", "gfx942")}

#: every situation a kernel's check can tell apart: (inside device_bound, traced, inputs require grad).
SITUATIONS = [(bound, traced, grad) for bound in (False, True) for traced in (False, True) for grad in (False, True)]


def _label(bound: bool, traced: bool, grad: bool) -> str:
    """"eager", or the situation's parts: "device_bound+traced+grad"."""
    return "+".join(word for word, on in (("device_bound", bound), ("traced", traced), ("grad", grad)) if on) or "eager"


@contextlib.contextmanager
def _one_machine() -> Iterator[None]:
    """Every check that asks the machine gets one answer: Triton, numba, CuPy and hiprtc present and
    working, a CPU without the ISA extensions of oneDNN's half-precision primitives. The recording
    then does not depend on the host it is made or compared on."""
    import hal_backend_cpu._device
    import hal_backend_cpu._numba
    import hal_backend_cuda.cpp_kernels
    import hal_backend_cuda.losses
    import hal_backend_rocm.cpp_kernels
    import hal_triton.checks

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(hal_backend_cpu._device, "cpu_flags", lambda: frozenset()))
        stack.enter_context(mock.patch.object(hal_backend_cpu._numba, "unavailable_reason", lambda: None))
        stack.enter_context(mock.patch.object(hal_triton.checks, "unavailable_reason", lambda: None))
        stack.enter_context(mock.patch.object(hal_backend_cuda.losses, "_TRITON", True))
        for runtime in (hal_backend_cuda.cpp_kernels.RUNTIME, hal_backend_rocm.cpp_kernels.RUNTIME):
            stack.enter_context(mock.patch.object(runtime, "unavailable_reason", lambda: None))
        yield


def _plugin(backend: str) -> Plugin:
    module = __import__(BACKENDS[backend][0])
    return module.plugin


def _table(k: KernelSpec) -> dict[str, Any]:
    """A kernel's registration as the dispatcher reads it."""
    differentiable = k.differentiable if isinstance(k.differentiable, bool) else "check"
    return {"contexts": dict(k.routing.priorities), "dtypes": sorted(k.dtypes) if k.dtypes is not None else None,
            "differentiable": differentiable}


def _with_grad(decl: OpDecl, args: tuple) -> tuple:
    """``args`` with the floating tensors the op differentiates requiring grad."""
    return tuple(a.detach().clone().requires_grad_(True)
                 if p.name in decl.gradients and isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for p, a in zip(decl.params, args))


def _autograd_reasons(k: KernelSpec, inputs: Inputs) -> list[str]:
    try:
        return k.torch_autograd_reasons(inputs)
    except Exception as exc:  # noqa: BLE001 - recorded as a reason, as selection records a raising check
        return [f"its differentiable check raised {type(exc).__name__}: {exc}"]


def _decisions(plugin: Plugin, backend: str, op: str, kernels: list[KernelSpec]) -> dict[str, Any]:
    """Per ``dtype/case``: the distinct outcomes over :data:`SITUATIONS`, each with the situations
    it is the outcome of, the call's context and the kernels in the order they are tried, each as
    [name, rejection reasons, reasons torch's autograd may not record it (None where rejected)]."""
    from hal.conformance.cases import cases_for, draw_call

    decl = get_op(op)
    _, kind, arch = BACKENDS[backend]
    out: dict[str, Any] = {}
    for dtype in sorted(decl.dtypes):
        for spec in cases_for(op, dtype, quick=True):
            given = draw_call(op, dtype, spec, 0, "cpu").args
            prepared = prepare(decl, tuple(given.get(q.name, q.default) for q in decl.params)).inputs
            outcomes: list[dict[str, Any]] = []
            for bound, traced, grad in SITUATIONS:
                args = _with_grad(decl, prepared.args) if grad else prepared.args
                inputs = Inputs(decl, args, kind, prepared.device, prepared.dtype, "torch", arch, traced)
                context = context_of(decl, inputs, Choice(None, "", None, "", False, False, device_bound=bound))
                views: dict[str, Inputs] = {}
                tried = []
                for k in ranked(kernels, context):
                    seen = inputs_as(inputs, k.array_api or plugin.backend.array_api, views)
                    reasons = _context_reasons(k, context) or _reasons(k, seen)
                    tried.append([k.name, reasons, None if reasons else _autograd_reasons(k, seen)])
                outcome = {"context": context, "tried": tried}
                same = next((o for o in outcomes if {"context": o["context"], "tried": o["tried"]} == outcome), None)
                if same is None:
                    outcomes.append({"situations": [], **outcome})
                    same = outcomes[-1]
                same["situations"].append(_label(bound, traced, grad))
            out[f"{dtype}/{spec.name}"] = outcomes
    return out


def routing_of(backend: str) -> dict[str, Any]:
    """A backend's registration table and its decisions on the quick conformance cases."""
    plugin = _plugin(backend)
    kernels = [k for k in plugin.kernels if k.backend == backend]
    by_op: dict[str, list[KernelSpec]] = {}
    for k in kernels:
        by_op.setdefault(k.op, []).append(k)
    return {"kernels": {f"{k.op}/{k.name}": _table(k) for k in kernels},
            "decisions": {op: _decisions(plugin, backend, op, ks) for op, ks in sorted(by_op.items())}}


def _tried_entries(routing: dict[str, Any]) -> Iterator[list]:
    """Every [name, reasons, autograd reasons] entry of a backend's decisions."""
    for cases in routing["decisions"].values():
        for outcomes in cases.values():
            for outcome in outcomes:
                yield from outcome["tried"]


def _record() -> dict[str, Any]:
    """The recording of every backend, each reason replaced by its index in ``reasons``."""
    with _one_machine():
        backends = {b: routing_of(b) for b in sorted(BACKENDS)}
    reasons: dict[str, int] = {}
    for routing in backends.values():
        for entry in _tried_entries(routing):
            entry[1] = [reasons.setdefault(r, len(reasons)) for r in entry[1]]
            entry[2] = None if entry[2] is None else [reasons.setdefault(r, len(reasons)) for r in entry[2]]
    return {"reasons": list(reasons), "backends": backends}


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    """The recording, its reasons written out again."""
    data = json.loads(RECORDED.read_text())
    reasons = data["reasons"]
    for routing in data["backends"].values():
        for entry in _tried_entries(routing):
            entry[1] = [reasons[i] for i in entry[1]]
            entry[2] = None if entry[2] is None else [reasons[i] for i in entry[2]]
    return data["backends"]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_the_backend_s_registration_table_is_as_recorded(backend: str, recorded: dict[str, Any]) -> None:
    plugin = _plugin(backend)
    now = {f"{k.op}/{k.name}": _table(k) for k in plugin.kernels if k.backend == backend}
    assert now == recorded[backend]["kernels"]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_the_backend_routes_every_quick_case_in_every_situation_as_recorded(backend: str, recorded: dict[str, Any]) -> None:
    with _one_machine():
        now = routing_of(backend)["decisions"]
    want = recorded[backend]["decisions"]
    assert sorted(now) == sorted(want)
    for op in now:
        assert now[op] == want[op], op


if __name__ == "__main__":
    RECORDED.write_text(json.dumps(_record(), sort_keys=True, separators=(",", ":")) + "\n")
