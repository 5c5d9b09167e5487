"""One route per call, described truthfully: for every trainable op called with grad-requiring
inputs (and without), the kernels ``hal.explain`` says will run are exactly the kernels
``hal.stats()`` counts after the forward and the backward pass; under torch.compile the compiled
graph takes in the torch ops of the kernels explain calls traceable and runs, as hal nodes, the
kernels eager explain names for a compiled call (``kernels_run(compiled=True)``)."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hal.conformance.cases import all_cases, draw_call

import hal
from hal.registry import OPS, OpDecl
from tests.compiled import compiled_with_graphs


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
    if decl.nondifferentiable_results:  # (y, amax): the gradient flows through y
        out = out[0]
    if require_grad:
        assert out.grad_fn is not None
        torch.autograd.backward(out, torch.randn_like(out))
    assert _counted() == Counter(decision.kernels_run()), f"explain said:\n{decision}"


def _linear_softmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return hal.ops.softmax(hal.ops.linear(x, w, None, "none"), -1)


def _compiled_run_matches_torch(x: torch.Tensor, w: torch.Tensor) -> list[str]:
    """Compile :func:`_linear_softmax`, run it twice (counting the second run), check its output
    and gradients against torch's; return the graphs' code."""
    compiled, graphs = compiled_with_graphs(_linear_softmax)
    g = torch.randn(x.shape[0], w.shape[0], dtype=x.dtype)
    compiled(x, w).backward(g)  # compiles, then runs
    hal.reset_stats()
    x.grad = w.grad = None
    y = compiled(x, w)
    y.backward(g)
    xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    ref = torch.softmax(xr @ wr.T, -1)
    ref.backward(g)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close((x.grad, w.grad), (xr.grad, wr.grad))
    return graphs


def _explained_compiled(x: torch.Tensor, w: torch.Tensor) -> Counter:
    want = Counter(hal.explain("linear", x, w, None, "none").kernels_run(compiled=True))
    h = hal.ops.linear(x, w, None, "none")
    return want + Counter(hal.explain("softmax", h, -1).kernels_run(compiled=True))


def test_compiled_graph_takes_in_the_torch_ops_of_traceable_kernels(seed: int) -> None:
    """Kernels made of torch's ops (the CPU backend's linear and softmax) join the compiled graph:
    its forward and backward hold torch's ops and no hal node, hal counts nothing, as explain says,
    and the results and gradients are torch's."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    assert hal.explain("softmax", x, -1).traceable
    assert _explained_compiled(x, w) == Counter()
    graphs = _compiled_run_matches_torch(x, w)
    assert len(graphs) == 2 and all("hal." not in code for code in graphs), graphs
    assert "aten._softmax" in graphs[0] and "aten._softmax_backward_data" in graphs[1]
    assert _counted() == Counter()


def test_compiled_graph_runs_the_kernels_explain_names(hal_nodes: None, seed: int) -> None:
    """Where hal keeps its own nodes (HAL_TORCH_AUTOGRAD=0), each op of a compiled function is one
    torch.ops.hal node whose backward runs the backward op: the second run counts exactly the
    kernels eager explain names for a compiled call."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    want = _explained_compiled(x, w)
    assert sum(want.values()) == 4, want  # two forwards, two backward ops
    graphs = _compiled_run_matches_torch(x, w)
    assert "hal.softmax.default" in graphs[0] and "hal.softmax_backward.default" in graphs[1]
    assert _counted() == want


def test_a_hal_use_scope_keeps_compiled_calls_opaque(seed: int) -> None:
    """Inside a ``hal.use`` scope a compiled call is an opaque node deciding at run time, so the
    scope is obeyed (Dynamo recompiles when the scope opens); outside, torch's ops again."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    compiled, graphs = compiled_with_graphs(_linear_softmax)
    compiled(x, w).sum().backward()
    with hal.use(backend="cpu_ref"):
        hal.reset_stats()
        compiled(x, w).sum().backward()
        backends = {b for (_, b, _) in _counted()}
    assert backends == {"cpu_ref"}, _counted()
    assert "hal." not in graphs[0] and "hal.softmax.default" in graphs[2]


def test_a_ranking_scope_traces_compiled_calls_into_the_graph(seed: int) -> None:
    """``hal.graphs.device_bound`` (where ``hal.graphs.graphed`` warms a compiled step up, so where
    torch.compile traces it) only ranks kernels: compiled calls inside it still join the graph as
    torch's ops (a scope that forces kernels keeps them opaque, the test above). Found on the
    H200: every hal call of a graphed compiled step had stayed an opaque node."""
    import hal.graphs

    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    compiled, graphs = compiled_with_graphs(_linear_softmax)
    with hal.graphs.device_bound():
        y = compiled(x, w)
        y.sum().backward()
    assert len(graphs) == 2 and all("hal." not in code for code in graphs), graphs
    torch.testing.assert_close(y, torch.softmax(x @ w.t(), -1))
    with hal.use(backend="cpu_ref"), hal.graphs.device_bound():
        compiled(x, w).sum().backward()
    assert any("hal.softmax.default" in code for code in graphs[2:]), graphs[2:]


def _fused_and_torch_softmax() -> Any:
    """A backend with an opaque softmax (NumPy, ranked first) and one of torch's ops below it."""
    from hal.plugin import Plugin

    plugin = Plugin("graphs", "1.0")
    plugin.define_backend(priority=1000, device_types=("cpu",), array_api="torch")
    plugin.kernel("softmax", name="fused", priority=20, array_api="numpy")(
        lambda x, dim: np.exp(x - x.max(dim, keepdims=True)) / np.exp(x - x.max(dim, keepdims=True)).sum(dim, keepdims=True))
    plugin.kernel("softmax", name="torch", priority=10, differentiable=True)(lambda x, dim: torch.softmax(x, dim))
    plugin.kernel("softmax_backward", name="torch")(lambda grad_out, out, dim: torch._softmax_backward_data(grad_out, out, dim, out.dtype))
    return plugin


@pytest.mark.parametrize("prefer", [True, False], ids=["prefer_torch", "HAL_COMPILE_PREFER_TORCH=0"])
def test_compiled_graph_prefers_a_kernel_of_torch_ops_to_an_opaque_one(install_plugins: Any, monkeypatch: pytest.MonkeyPatch,
                                                                       prefer: bool, seed: int) -> None:
    """Eager calls run the backend's first kernel (opaque: NumPy); a compiled graph takes in the
    torch ops of the kernel below it instead, as explain's ``compiled`` decision says, unless
    HAL_COMPILE_PREFER_TORCH=0 keeps the opaque node."""
    import hal_backend_cpu_ref

    if not prefer:
        monkeypatch.setenv("HAL_COMPILE_PREFER_TORCH", "0")
    install_plugins([hal_backend_cpu_ref.plugin, _fused_and_torch_softmax()])
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    d = hal.explain("softmax", x, -1)
    assert (d.backend, d.kernel, d.autograd_by) == ("graphs", "fused", "hal"), d
    if prefer:
        assert d.compiled is not None and (d.compiled.kernel, d.compiled.traceable) == ("torch", True), d
        assert "in place of the opaque graphs/fused" in str(d)
    else:
        assert d.compiled is None
    compiled, graphs = compiled_with_graphs(lambda t: hal.ops.softmax(t, -1))
    g = torch.randn_like(x)
    compiled(x).backward(g)
    hal.reset_stats()
    x.grad = None
    y = compiled(x)
    y.backward(g)
    assert _counted() == Counter(d.kernels_run(compiled=True))
    assert ("hal.softmax.default" in graphs[0]) is not prefer, graphs
    xr = x.detach().requires_grad_(True)
    ref = torch.softmax(xr, -1)
    ref.backward(g)
    torch.testing.assert_close((y, x.grad), (ref, xr.grad))


def test_compile_caches_do_not_serve_a_graph_traced_with_other_choices(install_plugins: Any, monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Any, seed: int) -> None:
    """Inductor with its on-disk caches (AOTAutograd's keys on Dynamo's graph, the same whatever hal
    chose): a graph traced with the torch kernel must not come back from the cache once
    HAL_COMPILE_PREFER_TORCH=0 makes the opaque kernel the choice (hal keys the caches on its
    choices through torch.compiler.config.cache_key_tag)."""
    import hal_backend_cpu_ref

    import torch._functorch.config
    import torch._inductor.config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # torch's config modules through their own patch(): monkeypatch's undo would delete an entry
    # that is not in the module's __dict__, breaking every later compilation in the process
    stack = contextlib.ExitStack()
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=True))
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=True))
    stack.enter_context(torch.compiler.config.patch(cache_key_tag="user-tag"))
    with stack:
        _compile_twice(install_plugins, monkeypatch, hal_backend_cpu_ref.plugin)


def _compile_twice(install_plugins: Any, monkeypatch: pytest.MonkeyPatch, cpu_ref: Any) -> None:
    install_plugins([cpu_ref, _fused_and_torch_softmax()])
    assert torch.compiler.config.cache_key_tag.startswith("user-tag|hal:")
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    counted = []
    for prefer in ("1", "0"):
        monkeypatch.setenv("HAL_COMPILE_PREFER_TORCH", prefer)
        hal.dispatch.reset()
        torch._dynamo.reset()  # in-memory graphs gone; the on-disk caches stay
        compiled = torch.compile(lambda t: hal.ops.softmax(t, -1), fullgraph=True)
        compiled(x).sum().backward()
        hal.reset_stats()
        y = compiled(x)
        counted.append(_counted())
        torch.testing.assert_close(y, torch.softmax(x, -1))
    assert counted == [Counter(), Counter({("softmax", "graphs", "fused"): 1})]


@pytest.mark.parametrize("own_nodes", [False, True], ids=["torch_ops", "HAL_TORCH_AUTOGRAD=0"])
def test_a_compiled_training_decomposition_runs_its_steps(monkeypatch: pytest.MonkeyPatch, own_nodes: bool, seed: int) -> None:
    """fused_conv_bn_relu in training with autograd: with hal's own nodes it takes its training
    decomposition; by default the CPU backend's kernel of torch's ops (the decomposition's own
    kernels) runs in its place, recorded by torch. Inside a compiled graph (decided as AOTAutograd
    traces) the graph holds no node of the fused op either way, and hal counts exactly the kernels
    explain names for a compiled call (none where torch's ops join the graph; each step and its
    backward op where hal keeps its nodes); outputs, gradients and running statistics are torch's."""
    if own_nodes:
        monkeypatch.setenv("HAL_TORCH_AUTOGRAD", "0")
        hal.dispatch.reset()
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    gamma = (torch.rand(5, dtype=torch.float64) + 0.5).requires_grad_(True)
    beta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    mean, var = torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64) + 0.5
    ref_mean, ref_var = mean.clone(), var.clone()

    def f(x: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        return hal.ops.fused_conv_bn_relu(x, w, None, gamma, beta, mean, var, 1, 1, 1, 1, 1e-5, 0.1, True)

    d = hal.explain("fused_conv_bn_relu", x, w, None, gamma, beta, mean, var, 1, 1, 1, 1, 1e-5, 0.1, True)
    if own_nodes:
        assert d.route == "decomposition", d
    else:
        assert (d.route, d.autograd_by) == ("autograd", "torch") and "in place of the op's training decomposition" in str(d), d
    want = Counter(d.kernels_run(compiled=True))
    assert all(op != "fused_conv_bn_relu" for op, _, _ in want)
    assert (sum(want.values()) == 0) is not own_nodes, want
    compiled, graphs = compiled_with_graphs(f)
    g = torch.randn(3, 5, 6, 6, dtype=torch.float64)
    compiled(x, w, gamma, beta).backward(g)
    hal.reset_stats()
    for t in (x, w, gamma, beta):
        t.grad = None
    y = compiled(x, w, gamma, beta)
    y.backward(g)
    assert _counted() == want
    assert all("fused_conv_bn_relu" not in code for code in graphs), graphs
    leaves = [t.detach().requires_grad_(True) for t in (x, w, gamma, beta)]
    for _ in range(2):
        ref = F.relu(F.batch_norm(F.conv2d(leaves[0], leaves[1], None, 1, 1), ref_mean, ref_var, leaves[2], leaves[3], True, 0.1, 1e-5))
    ref.backward(g)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close([t.grad for t in (x, w, gamma, beta)], [t.grad for t in leaves])
    torch.testing.assert_close((mean, var), (ref_mean, ref_var))


def test_a_compiled_unbatched_call_takes_the_kernel_on_a_batch_of_one(seed: int) -> None:
    """conv2d of a 3-D x (no batch dimension): inside a graph the traced kernel runs on the batch of
    one the dispatcher makes, and the result is unbatched again; results and gradients as torch's."""
    x = torch.randn(3, 6, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    assert hal.explain("conv2d", x, w, None, 1, 1, 1, 1).traceable
    compiled, graphs = compiled_with_graphs(lambda a, b: hal.ops.conv2d(a, b, None, 1, 1, 1, 1))
    g = torch.randn(4, 6, 6, dtype=torch.float64)
    y = compiled(x, w)
    y.backward(g)
    assert all("hal." not in code for code in graphs), graphs
    xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    ref = F.conv2d(xr, wr, None, 1, 1)
    ref.backward(g)
    torch.testing.assert_close((y, x.grad, w.grad), (ref, xr.grad, wr.grad))


def _linear_backend(differentiable: bool) -> Any:
    """A backend whose linear kernel (with its activation) is torch's ops, recorded by torch's
    autograd or not, and the steps of linear's training decomposition (linear, scale_shift_act)."""
    from hal.plugin import Plugin

    plugin = Plugin("records", "1.0")
    plugin.define_backend(priority=1000, device_types=("cpu",), array_api="torch")
    acts = {"none": lambda y: y, "gelu": F.gelu}
    plugin.kernel("linear", name="torch", priority=10, differentiable=differentiable)(
        lambda x, weight, bias, act: acts[act](F.linear(x, weight, bias)))
    plugin.kernel("scale_shift_act", name="torch", priority=10, differentiable=True)(
        lambda x, scale, shift, act: acts[act](x * scale + shift))
    return plugin


@pytest.mark.parametrize("differentiable", [True, False], ids=["recorded", "not_recorded"])
def test_a_recorded_kernel_runs_in_place_of_the_training_decomposition(install_plugins: Any, differentiable: bool, seed: int) -> None:
    """linear with an activation declares a training decomposition (linear, then the activation). A
    backend kernel that torch's autograd records runs as the one call instead: one hal entry, the
    same torch kernels; one that torch does not record leaves the decomposition."""
    import hal_backend_cpu_ref

    install_plugins([hal_backend_cpu_ref.plugin, _linear_backend(differentiable)])
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    d = hal.explain("linear", x, w, None, "gelu")
    if differentiable:
        assert (d.route, d.kernel, d.autograd_by) == ("autograd", "torch", "torch"), d
        assert "in place of the op's training decomposition" in str(d)
    else:
        assert (d.route, d.kernel) == ("decomposition", "composite"), d
    hal.reset_stats()
    y = hal.ops.linear(x, w, None, "gelu")
    y.sum().backward()
    assert _counted() == Counter(d.kernels_run()), (hal.stats(), d.kernels_run())
    xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    F.gelu(F.linear(xr, wr)).sum().backward()
    torch.testing.assert_close((y, x.grad, w.grad), (F.gelu(F.linear(xr, wr)), xr.grad, wr.grad))
