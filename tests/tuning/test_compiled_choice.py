"""What a torch.compile graph runs for a hal call, chosen by measurement (issue 28): inside
``hal.tuning.for_compile()`` an opaque kernel is timed against ``torch.compile`` of a kernel made
of torch's ops, and graphs traced later take the winner. A test plugin's kernels sleep for a set
time, so which one is faster is known on any machine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import hal
from hal import dispatch
from hal.dispatch import measure
from hal.plugin import Plugin

RAN: list[str] = []
#: the slow kernel's cost: far above the timing noise of a loaded 2-core VM
SLOW = 0.02


def plugin(opaque_s: float, torch_ops_s: float) -> Plugin:
    """A CPU backend with two softmax kernels: ``opaque`` (first by priority; not made of torch's
    ops, so a graph keeps it as a node) and ``torch_ops`` (torch's differentiable ops, which a graph
    inlines). Each sleeps for its cost when it runs (the sleep of ``torch_ops`` breaks Dynamo's graph
    and runs in Python, compiled or not)."""
    p = Plugin("timedc", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",))

    @p.kernel("softmax", name="opaque", priority=100)
    def opaque(x, dim):
        RAN.append("opaque")
        time.sleep(opaque_s)
        return torch.softmax(x, dim)

    @p.kernel("softmax", name="torch_ops", priority=50, differentiable=True)
    def torch_ops(x, dim):
        time.sleep(torch_ops_s)
        return torch.softmax(x, dim)

    @p.kernel("softmax_backward", name="opaque", priority=100)
    def opaque_backward(grad_out, out, dim):
        return torch._softmax_backward_data(grad_out, out, dim, out.dtype)

    return p


@pytest.fixture
def tuning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("HAL_TUNE", "off")  # the eager choice stays the priority one: opaque
    monkeypatch.setenv("HAL_TUNE_CACHE", str(tmp_path / "tune"))
    dispatch.reset()
    RAN.clear()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    dispatch.reset()


def _graph_runs_opaque(x: torch.Tensor) -> bool:
    """Whether a torch.compile graph of ``hal.ops.softmax`` runs the opaque kernel as its node."""
    torch._dynamo.reset()
    fn = torch.compile(lambda t: hal.ops.softmax(t, 1) * 2, backend="aot_eager", fullgraph=True)
    RAN.clear()
    out = fn(x)
    torch.testing.assert_close(out, torch.softmax(x, 1) * 2)
    return "opaque" in RAN


def test_an_opaque_kernel_measured_faster_stays_a_node(tuning, install_plugins):
    install_plugins([plugin(opaque_s=0.0, torch_ops_s=SLOW)])
    x = torch.randn(8, 32)
    assert not _graph_runs_opaque(x), "unmeasured, a graph takes the kernel made of torch's ops"
    before = len(measure.LOG)
    with hal.tuning.for_compile():
        torch.testing.assert_close(hal.ops.softmax(x, 1), torch.softmax(x, 1))
    found = [m for m in measure.LOG[before:] if m.context == "compiled"]
    assert len(found) == 1 and found[0].winner == "timedc/opaque", measure.LOG[before:]
    times = dict(found[0].times_us)
    assert times["timedc/torch_ops"] >= SLOW * 1e6 > times["timedc/opaque"]
    assert _graph_runs_opaque(torch.randn(8, 32)), "measured faster, the opaque kernel stays the graph's node"


def test_a_torch_ops_kernel_measured_faster_joins_the_graph(tuning, install_plugins, monkeypatch):
    monkeypatch.setenv("HAL_COMPILE_PREFER_TORCH", "0")  # unmeasured, graphs keep the opaque node
    dispatch.reset()
    install_plugins([plugin(opaque_s=SLOW, torch_ops_s=0.0)])
    x = torch.randn(8, 32)
    assert _graph_runs_opaque(x)
    before = len(measure.LOG)
    with hal.tuning.for_compile():  # HAL_TUNE=off: eagerly the priority choice, opaque (hal.tune would
        hal.ops.softmax(x, 1)       # measure torch_ops faster, which a graph inlines anyway)
    assert [m.winner for m in measure.LOG[before:] if m.context == "compiled"] == ["timedc/torch_ops"]
    assert not _graph_runs_opaque(x)
    d = hal.explain("softmax", x, 1)
    assert d.kernel == "opaque", "the eager choice is not the graph's"


def test_training_calls_are_measured_forward_and_backward(tuning, install_plugins):
    install_plugins([plugin(opaque_s=0.0, torch_ops_s=SLOW)])
    x = torch.randn(8, 32, requires_grad=True)
    before = len(measure.LOG)
    with hal.tuning.for_compile():
        hal.ops.softmax(x, 1).sum().backward()
    found = [m for m in measure.LOG[before:] if m.context.startswith("compiled")]
    assert [m.context for m in found] == ["compiled/train"], found
    assert [label.split(" (")[0] for label, _ in found[0].times_us] == ["timedc/torch_ops", "timedc/opaque"]
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_nothing_is_measured_for_graphs_outside_the_scope_or_on_fake_tensors(tuning, install_plugins):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hal.config import choice_for
    from hal.integration.compile import decide_traced

    install_plugins([plugin(opaque_s=0.0, torch_ops_s=SLOW)])
    before = len(measure.LOG)
    hal.ops.softmax(torch.randn(8, 32), 1)
    assert measure.LOG[before:] == [], "outside hal.tuning.for_compile(), graphs' choices are not measured"
    with hal.tuning.for_compile(), FakeTensorMode() as fake_mode:
        fake = fake_mode.from_tensor(torch.randn(8, 32))
        decided = decide_traced(hal.registry.OPS["softmax"], (fake, 1), choice_for("softmax", hal.config.current()))
    assert decided is not None and decided.route.kernel == "torch_ops", "unmeasured, the torch-ops kernel"
    assert measure.LOG[before:] == [], "a decision on fake tensors measures nothing"


def test_cli_knows_the_compiled_context() -> None:
    from hal.cli import tune as cli

    assert "compiled" in cli._SCOPES


def test_every_call_signature_is_measured_compiled(tuning, install_plugins):
    """Dynamo keeps at most ``recompile_limit`` (8) compiled graphs on a function's code object and
    runs the function uncompiled beyond them. Each measurement compiles its own copy of the call: the
    ninth signature and later ones still time Inductor's code, not eager PyTorch (before, the CPU's
    linear_cross_entropy measured after eight others timed its eager ops)."""
    ran_compiled: list[bool] = []
    p = Plugin("signatures", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",))
    p.kernel("softmax", name="opaque", priority=100)(lambda x, dim: torch.softmax(x, dim))

    @p.kernel("softmax", name="torch_ops", priority=50, differentiable=True)
    def torch_ops(x, dim):
        ran_compiled.append(torch.compiler.is_compiling())  # traced: a side effect each compiled call replays
        return torch.softmax(x, dim)

    install_plugins([p])
    signatures = torch._dynamo.config.recompile_limit + 2
    before = len(measure.LOG)
    with hal.tuning.for_compile():
        for n in range(signatures):
            x = torch.randn(4, 8 + n)
            torch.testing.assert_close(hal.ops.softmax(x, 1), torch.softmax(x, 1))
    assert len([m for m in measure.LOG[before:] if m.context == "compiled"]) == signatures
    assert ran_compiled and all(ran_compiled), f"{ran_compiled.count(False)} of {len(ran_compiled)} runs of the torch-ops kernel were not compiled"
