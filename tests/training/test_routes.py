"""One route per call, described truthfully: for every trainable op called with grad-requiring
inputs (and without), the kernels ``hal.explain`` says will run are exactly the kernels
``hal.stats()`` counts after the forward and the backward pass; under torch.compile the compiled
code runs the kernels eager explain names for a compiled call (``kernels_run(compiled=True)``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from hal.conformance.cases import all_cases, draw_call

import hal
from hal.registry import OPS, OpDecl


def _calls() -> list[Any]:
    out = []
    for name, decl in OPS.items():
        if not decl.trainable:
            continue
        spec = next((s for s in all_cases()[name] if s.quick and s.applies_to("float64")), None)
        if spec is not None:
            out.append(pytest.param(name, spec, id=f"{name}-{spec.name}"))
    return out


def _args(decl: OpDecl, spec: Any, seed: int, require_grad: bool) -> list[Any]:
    call = draw_call(decl.name, "float64", spec, seed, "cpu")
    args = [call.args[p.name] if p.name in call.args else p.default for p in decl.params]
    if require_grad:
        for name in decl.gradients:
            i = decl.index(name)
            if isinstance(args[i], torch.Tensor) and args[i].is_floating_point():
                args[i] = args[i].detach().clone().requires_grad_(True)
    return args


def _counted() -> Counter:
    return Counter({k: v["calls"] for k, v in hal.stats().items() if v["calls"]})


@pytest.mark.parametrize("require_grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("op_name,spec", _calls())
def test_explain_names_what_stats_count(op_name: str, spec: Any, require_grad: bool, seed: int) -> None:
    decl = OPS[op_name]
    args = _args(decl, spec, seed, require_grad)
    positional = [a for p, a in zip(decl.params, args) if not p.keyword_only]
    keywords = {p.name: a for p, a in zip(decl.params, args) if p.keyword_only}
    decision = hal.explain(op_name, *positional, **keywords)
    assert decision.route in (("autograd", "decomposition") if require_grad else ("kernel",)), str(decision)
    hal.reset_stats()
    out = decl.entry(*positional, **keywords)
    if require_grad:
        assert out.grad_fn is not None
        torch.autograd.backward(out, torch.randn_like(out))
    assert _counted() == Counter(decision.kernels_run()), f"explain said:\n{decision}"


def test_compiled_graph_runs_the_kernels_explain_names(seed: int) -> None:
    """A compiled function of two hal ops with autograd: its forward and backward run the kernels
    that eager explain reports for the same calls (each op one torch.ops.hal node)."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return hal.ops.softmax(hal.ops.linear(x, w, None, "none"), -1)

    want = Counter(hal.explain("linear", x, w, None, "none").kernels_run(compiled=True))
    h = hal.ops.linear(x, w, None, "none")
    want += Counter(hal.explain("softmax", h, -1).kernels_run(compiled=True))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled(x, w).sum().backward()  # compiles (fake kernels only), then runs
    hal.reset_stats()
    x.grad = w.grad = None
    compiled(x, w).sum().backward()
    assert _counted() == want
